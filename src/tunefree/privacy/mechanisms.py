"""Mechanisms: each release of private data adds its noise and returns the DpEvent it must be
accounted as. The optimizer records the events of one step in the ledger as one sampled event.

A release of a run that spans processes sums every process's private values and adds the noise of each
coordinate exactly once, whatever the number of processes: how is the run's parallelism's business
(``parallel/``: :class:`Reduction` is what a mechanism asks of it); :data:`SINGLE_PROCESS` is one
process."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import dp_accounting as dpa
import torch
from torch import nn

from ..clipping.groups import ClipGroup
from ..dtypes import accumulation_dtype
from .randomness import NoiseSource

NOISE_ALLOCATIONS = ("global", "equal-budget", "weighted")
# The most coordinates of noise a release holds at once (64 MiB in float32), unless one parameter has more.
NOISE_PIECE = 2**24


def allocation_weights(thresholds: Sequence[float], sizes: Sequence[int], allocation: str) -> list[float]:
    """γₖ of the group-wise clipping paper (Algorithm 1, line 13) for groups of thresholds Cₖ and
    dₖ coordinates: global γₖ = 1, equal-budget γₖ = Cₖ, weighted γₖ = Cₖ/√dₖ."""
    if allocation == "global":
        return [1.0] * len(thresholds)
    if allocation == "equal-budget":
        return list(thresholds)
    if allocation == "weighted":
        return [c / math.sqrt(d) for c, d in zip(thresholds, sizes)]
    raise ValueError(f"unknown noise_allocation {allocation!r}: use one of {NOISE_ALLOCATIONS}")


def group_noise_stds(thresholds: Sequence[float], sizes: Sequence[int], noise_multiplier: float,
                     allocation: str = "global") -> list[float]:
    """Noise standard deviation σₖ = c·γₖ of each group, with c chosen so that the release is exactly
    a Gaussian mechanism of noise multiplier σ: ``Σₖ (Cₖ/σₖ)² = 1/σ²``. With γₖ = 1 every coordinate
    gets σ·S, S = √(Σₖ Cₖ²)."""
    gammas = allocation_weights(thresholds, sizes, allocation)
    scale = noise_multiplier * math.sqrt(sum((c / gamma) ** 2 for c, gamma in zip(thresholds, gammas)))
    return [scale * gamma for gamma in gammas]


class Reduction(Protocol):
    """What a mechanism asks of the run's parallelism: the sum over the processes of their private values,
    with the noise of every coordinate added exactly once."""

    def noisy_sum(self, sums: Mapping[nn.Parameter, torch.Tensor],
                  stds: Sequence[tuple[nn.Parameter, float]],
                  randomness: NoiseSource) -> dict[nn.Parameter, torch.Tensor]:
        """Every parameter of ``stds`` (in release order, each with its noise standard deviation): the
        sum of every process's ``sums[p]`` (zeros where a process has none) plus Gaussian noise."""

    def noisy_values(self, values: torch.Tensor, noise: torch.Tensor,
                     randomness: NoiseSource) -> torch.Tensor:
        """``values`` (float64, CPU) summed over the processes, plus ``noise`` (drawn from ``randomness``
        by every process, scaled) counted once: each coordinate's from the process that owns it."""

    def all_groups(self, own: Mapping[str, tuple[float, int]]) -> dict[str, tuple[float, int]]:
        """Every clip group of the run, by name in the run's order, with its current value (a threshold,
        or an estimate of one) and its size: ``own`` for this process's groups, and those of the groups
        other processes hold. Where every process holds every group (one process, DDP, FSDP2) it is
        ``own``; pipeline stages hold one group each (``parallel/stages.py``)."""


class OneProcess:
    """The reduction of a run in one process: its values are the sums, noised here."""

    def noisy_sum(self, sums: Mapping[nn.Parameter, torch.Tensor],
                  stds: Sequence[tuple[nn.Parameter, float]],
                  randomness: NoiseSource) -> dict[nn.Parameter, torch.Tensor]:
        """The sums are taken over: the noise is added into them in place, drawn in pieces of at most
        ``NOISE_PIECE`` coordinates, each dropped once added, so that the release holds the sums and one
        piece of noise. A seeded source draws each parameter's noise whole, shape by shape as one draw
        of every parameter in order would (so the pieces do not change its numbers; a parameter larger
        than a piece is a piece); a secret one may cut a parameter's (contiguous) sum into pieces."""
        noisy, to_noise = {}, {}
        for p, std in stds:
            noisy[p] = clipped_sum(p, sums.get(p))
            if std > 0:
                cut = not randomness.replayable and noisy[p].is_contiguous()
                to_noise.setdefault((noisy[p].device, noisy[p].dtype), []).append((p, std, cut))
        for (device, dtype), entries in to_noise.items():
            for piece in _pieces(entries, NOISE_PIECE):
                draws = randomness.normals([_span_shape(p, a, b) for p, _, a, b in piece], device, dtype)
                # sum += std·noise, the piece's spans in two calls (the draws are fresh, used once)
                torch._foreach_mul_(draws, [std for _, std, _, _ in piece])
                torch._foreach_add_([_span(noisy[p], a, b) for p, _, a, b in piece], draws)
                del draws
        return noisy

    def noisy_values(self, values: torch.Tensor, noise: torch.Tensor,
                     randomness: NoiseSource) -> torch.Tensor:
        return values + noise

    def all_groups(self, own: Mapping[str, tuple[float, int]]) -> dict[str, tuple[float, int]]:
        return dict(own)


SINGLE_PROCESS = OneProcess()

_Span = tuple[nn.Parameter, float, int, int]  # a parameter, its noise deviation, coordinates [a, b)


def _pieces(entries: list[tuple[nn.Parameter, float, bool]], limit: int) -> list[list[_Span]]:
    """``entries`` (parameter, deviation, whether it may be cut) in order, as runs of at most ``limit``
    coordinates: a parameter that may be cut in spans of at most ``limit``, else whole (alone when
    larger)."""
    pieces: list[list[_Span]] = []
    size = 0
    for p, std, cut in entries:
        n = p.numel()
        spans = [(a, min(a + limit, n)) for a in range(0, n, limit)] if cut and n > limit else [(0, n)]
        for a, b in spans:
            if not pieces or size + b - a > limit:
                pieces.append([])
                size = 0
            pieces[-1].append((p, std, a, b))
            size += b - a
    return pieces


def _span_shape(p: nn.Parameter, a: int, b: int) -> torch.Size:
    """The shape of the noise of coordinates ``[a, b)`` of ``p``: its own shape when whole."""
    return p.shape if (a, b) == (0, p.numel()) else torch.Size([b - a])


def _span(total: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Coordinates ``[a, b)`` of a sum, as a view (a cut sum is contiguous)."""
    return total if (a, b) == (0, total.numel()) else total.view(-1)[a:b]


def clipped_sum(p: nn.Parameter, total: torch.Tensor | None) -> torch.Tensor:
    """``p``'s clipped sum in its accumulation precision (zeros if no example reached ``p``)."""
    if total is None:
        return torch.zeros(p.shape, device=p.device, dtype=accumulation_dtype(p.dtype))
    return total


class GradientRelease:
    """Releases the clipped gradient sums with Gaussian noise (the Gaussian mechanism of DP-SGD), under
    the run's parallelism.

    Args:
        groups: the clip groups whose sums are released.
        noise_multiplier: σ, the noise relative to the total sensitivity √(Σₖ Cₖ²) of the thresholds
            each release is made with.
        randomness: the run's source of noise.
        allocation: how the noise is spread over groups (``"global"``, ``"equal-budget"``,
            ``"weighted"``); the privacy cost is that of σ whatever the choice.
        parallelism: how the processes' sums are reduced and noised (one process by default).
    """

    def __init__(self, groups: Sequence[ClipGroup], noise_multiplier: float,
                 randomness: NoiseSource, allocation: str = "global",
                 parallelism: Reduction = SINGLE_PROCESS):
        # σ comes from a solved plan and the allocation from a validated RunConfig
        assert noise_multiplier >= 0 and allocation in NOISE_ALLOCATIONS, (noise_multiplier, allocation)
        self.groups, self.noise_multiplier = list(groups), noise_multiplier
        self.randomness, self.allocation, self.parallelism = randomness, allocation, parallelism
        self._sizes = [g.size for g in self.groups]
        self._stds_for: tuple[tuple, list[float]] | None = None  # (key, noise_stds)

    def noise_stds(self, thresholds: Mapping[str, float]) -> list[float]:
        """Each group's noise standard deviation when its sum was clipped at ``thresholds[name]``: its
        share among every clip group of the run (pipeline stages: every stage's group, at its current
        threshold), computed again only when a threshold, σ or the allocation changes."""
        everyone = self.parallelism.all_groups(
            {g.name: (thresholds[g.name], size) for g, size in zip(self.groups, self._sizes)})
        key = (tuple(everyone.items()), self.noise_multiplier, self.allocation)
        if self._stds_for is None or self._stds_for[0] != key:
            stds = dict(zip(everyone, group_noise_stds([t for t, _ in everyone.values()],
                                                       [size for _, size in everyone.values()],
                                                       self.noise_multiplier, self.allocation)))
            self._stds_for = (key, [stds[g.name] for g in self.groups])
        return list(self._stds_for[1])

    def release(self, sums: dict[nn.Parameter, torch.Tensor], thresholds: Mapping[str, float]
                ) -> tuple[dict[nn.Parameter, torch.Tensor], dpa.DpEvent]:
        """Noisy sums for every parameter of every group (a parameter without a sum gets noise only).

        ``thresholds`` are those the sums were clipped with (by group name): each group's sum has
        sensitivity ``thresholds[name]``, and the noise is calibrated to them. Under several processes
        (the parallelism), the sums of every process are released, each coordinate noised once. The
        sums are taken over (in one process the noise is added into them in place)."""
        noisy = self.parallelism.noisy_sum(sums, self.param_stds(thresholds), self.randomness)
        return noisy, self.event()

    def param_stds(self, thresholds: Mapping[str, float]) -> list[tuple[nn.Parameter, float]]:
        """Every parameter of every group, in group order, with its group's noise standard deviation."""
        if len(thresholds) != len(self.groups) or any(g.name not in thresholds for g in self.groups):
            raise ValueError(f"thresholds must name exactly the clip groups {[g.name for g in self.groups]}")
        return [(p, std) for group, std in zip(self.groups, self.noise_stds(thresholds))
                for p in group.params]

    def with_groups(self, groups: Sequence[ClipGroup]) -> GradientRelease:
        """The same mechanism over other groups (a decorator's, e.g. the canaries' extended host group)."""
        return GradientRelease(groups, self.noise_multiplier, self.randomness, self.allocation,
                               self.parallelism)

    def event(self) -> dpa.DpEvent:
        """What one release costs: a Gaussian mechanism of multiplier σ on the total sensitivity."""
        return dpa.GaussianDpEvent(self.noise_multiplier)


def add_bucket_noise(flat: torch.Tensor, params: Sequence[tuple[nn.Parameter, float]],
                     randomness: NoiseSource, shard: tuple[int, int]) -> None:
    """Rank ``shard[0]`` of ``shard[1]``'s share of the Gaussian noise of one flat bucket of parameters
    (``params``: each with its noise standard deviation, in the bucket's order), added to ``flat`` in
    place; summed over the ranks, every coordinate has received exactly one draw.

    The noised coordinates (those of a parameter with a positive deviation) are one draw of the source,
    parameter by parameter; the source says which of them this rank adds (``owned_range``: a secret
    source's own slice, a replayable source's all on rank 0, as one process adds them) and draws them
    (``normals_at``: a replayable source keeps every rank's stream where rank 0's is)."""
    offsets = [0, *itertools.accumulate(p.numel() for p, _ in params)]
    noised = [(offset, p.numel(), std) for offset, (p, std) in zip(offsets, params) if std > 0]
    if not noised:
        return
    starts = [0, *itertools.accumulate(size for _, size, _ in noised)]
    low, high = randomness.owned_range(starts[-1], shard)
    ranges = [(min(max(low - start, 0), size), min(max(high - start, 0), size))
              for start, (_, size, _) in zip(starts, noised)]  # the owned part of each piece
    draws = randomness.normals_at([size for _, size, _ in noised], ranges, flat.device, flat.dtype)
    for (offset, _, std), (a, b), noise in zip(noised, ranges, draws):
        if b > a:
            flat[offset + a:offset + b] += std * noise


def add_shard_noise(shards: Mapping[nn.Parameter, torch.Tensor], params: Sequence[tuple[nn.Parameter, float]],
                    randomness: NoiseSource, shard: tuple[int, int]) -> None:
    """Rank ``shard[0]`` of ``shard[1]``'s share of the Gaussian noise of parameters sharded along dim 0
    as FSDP2 shards them (rank r holds rows from ⌈rows/W⌉·r on): ``shards[p]`` holds this rank's rows of
    ``p``'s sum and gets their noise in place (``params``: each parameter with its standard deviation, in
    release order). Summed over the ranks, every coordinate has received exactly one draw.

    The noise is one draw per device and precision, parameter by parameter in release order (as
    ``GradientRelease.release`` draws it), of which this rank asks for its own rows (``normals_at``): a
    secret source draws only those; a replayable one draws one process's noise whole and cuts it, so
    that every rank's stream stays at the same place."""
    rank, world_size = shard
    by_kind: dict[tuple[torch.device, torch.dtype], list[tuple[nn.Parameter, float]]] = {}
    for p, std in params:
        if std > 0:
            by_kind.setdefault((shards[p].device, shards[p].dtype), []).append((p, std))
    for (device, dtype), entries in by_kind.items():
        ranges = []
        for p, _ in entries:
            row = math.prod(p.shape[1:])  # coordinates per row
            start = math.ceil(p.shape[0] / world_size) * rank * row
            ranges.append((start, start + shards[p].numel()))
        draws = randomness.normals_at([p.numel() for p, _ in entries], ranges, device, dtype)
        for (p, std), noise in zip(entries, draws):
            shards[p] += std * noise.view(shards[p].shape)


def release_values(values: torch.Tensor, sensitivity: float, noise_multiplier: float, randomness: NoiseSource,
                   parallelism: Reduction = SINGLE_PROCESS) -> tuple[torch.Tensor, dpa.DpEvent]:
    """A Gaussian release of a few sums (a step component's: clip counts, losses; under several processes,
    summed over them) whose joint L2 sensitivity is ``sensitivity``: each coordinate gets noise of standard
    deviation ``noise_multiplier·sensitivity``, once. Its event is Gaussian of that multiplier."""
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"a release's noise multiplier must be a finite number ≥ 0, got {noise_multiplier}")
    values = values.detach().to("cpu", torch.float64)
    std = noise_multiplier * sensitivity
    noise = std * randomness.normal(values.shape, torch.device("cpu"), torch.float64) if std > 0 \
        else torch.zeros_like(values)
    return parallelism.noisy_values(values, noise, randomness), dpa.GaussianDpEvent(noise_multiplier)
