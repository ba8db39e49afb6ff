"""Gradient canaries in a user's own run (``make_private(..., audit_canaries=m)``): what the one-run
audit of ``tunefree.audit.audit_training`` observes.

m canaries, each a member of the run independently with probability ½. A canary is an example whose
clipped gradient is ``C·eⱼ``: C the current threshold of the *host* group (the clip group of largest
initial threshold), eⱼ the j-th coordinate of a block of m coordinates that belongs to no model. The
block joins the host group's release: every step, each member canary is sampled at the run's rate q
(``NoiseSource.inclusion``, as the loader samples examples), ``C·eⱼ`` is added to the block's sum, and
the block is released by the run's own mechanism — in the same ``GradientRelease.release`` call as the
model's coordinates, with the host group's noise. The noisy block is recorded, then dropped: it never
reaches the model, the optimizer or the user's outputs.

Privacy: no private example has a gradient on the block, so its release is canary contributions plus
fresh noise — independent of the private data. Under data parallelism every rank holds the same canaries
(their randomness is shared: rank 0's secret seed, or the run's seed), only rank 0 adds their
contributions, and the block is reduced and noised with the model's sums. It costs the data nothing and
the ledger records nothing for it (ε is the same with or without canaries). The model's coordinates keep
their noise scale (the ``"weighted"`` noise allocation, whose scales depend on group sizes, is refused).
Canary membership and sampling come from a stream of their own: secure in a secure run, derived from the
seed in a seeded one.
Observations cover the steps since ``make_private``; they are not part of the run's checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import dp_accounting as dpa
import numpy as np
import torch
from torch import nn

from ..clipping.groups import ClipGroup
from ..dtypes import accumulation_dtype
from .mechanisms import GradientRelease, group_noise_stds
from .randomness import NoiseSource, side_randomness

CANARY_STREAM = 0xCA9A7  # the seeded stream of canary membership and sampling
MEMBERSHIP_KEY = 0  # membership is drawn as "step 0" of the canary stream; step t ≥ 1 samples step t


class GradientCanaries:
    """The canaries of one run and what the releases showed of them.

    Args:
        count: m, the number of canaries (at least 2).
        groups: the run's clip groups; the canaries live in the one of largest threshold.
        sample_rate: q, the run's accounted sampling rate, at which member canaries are sampled.
        randomness: the canaries' own source (:func:`canary_randomness`).
    """

    def __init__(self, count: int, groups: Sequence[ClipGroup], sample_rate: float,
                 randomness: NoiseSource):
        self.host = max(groups, key=lambda g: g.threshold)
        anchor = self.host.params[0]
        self.block = nn.Parameter(torch.zeros(count, device=anchor.device, dtype=anchor.dtype),
                                  requires_grad=False)
        self.sample_rate, self.randomness = sample_rate, randomness
        self.included = randomness.inclusion(MEMBERSHIP_KEY, count, 0.5).numpy()
        self.z: list[np.ndarray] = []  # per step: each canary's coordinate, in claimed noise stds
        self.shift: list[float] = []  # per step: what a sampled member adds, in claimed noise stds

    @property
    def count(self) -> int:
        return len(self.included)

    def block_sum(self, threshold: float) -> torch.Tensor:
        """The next step's clipped sum on the block: ``threshold`` on each sampled member canary."""
        sampled = self.randomness.inclusion(len(self.z) + 1, self.count, self.sample_rate).numpy()
        present = torch.from_numpy(self.included & sampled).to(self.block.device)
        return threshold * present.to(accumulation_dtype(self.block.dtype))

    def record(self, noisy_block: torch.Tensor, threshold: float, claimed_std: float) -> None:
        """Keep one release of the block, in units of the noise the run claims to add."""
        self.z.append(noisy_block.detach().to("cpu", torch.float64).numpy() / claimed_std)
        self.shift.append(threshold / claimed_std)


class CanaryRelease:
    """A decorator of the run's gradient mechanism: it releases the canary block in the host group, in the
    same call (and with the same noise scale) as the model's coordinates, records the block and returns
    the model's sums only. It is what it decorates in every other respect (σ, groups, noise scales)."""

    def __init__(self, release: GradientRelease, canaries: GradientCanaries,
                 adds_contributions: bool = True):
        self.model_release, self.canaries = release, canaries
        self.adds_contributions = adds_contributions  # under data parallelism, rank 0 only
        host = canaries.host
        self._with_block = release.with_groups(
            [replace(g, params=[*g.params, canaries.block]) if g is host else g for g in release.groups])
        self.groups, self.noise_multiplier = release.groups, release.noise_multiplier
        self.randomness, self.allocation = release.randomness, release.allocation

    def release(self, sums: dict[nn.Parameter, torch.Tensor], thresholds: Mapping[str, float]
                ) -> tuple[dict[nn.Parameter, torch.Tensor], dpa.DpEvent]:
        host = self.canaries.host
        block = self.canaries.block
        block_sum = self.canaries.block_sum(thresholds[host.name])
        if self.adds_contributions:
            sums = {**sums, block: block_sum}
        noisy, event = self._with_block.release(sums, thresholds)
        self.canaries.record(noisy.pop(block), thresholds[host.name], self._claimed_std(thresholds))
        return noisy, event

    def noise_stds(self, thresholds: Mapping[str, float]) -> list[float]:
        """The model's groups' noise standard deviations (the block takes the host group's)."""
        return self.model_release.noise_stds(thresholds)

    def param_stds(self, thresholds: Mapping[str, float]) -> list[tuple[nn.Parameter, float]]:
        """The model's parameters with their noise standard deviations (not the block's)."""
        return self.model_release.param_stds(thresholds)

    def event(self) -> dpa.DpEvent:
        return self.model_release.event()

    def _claimed_std(self, thresholds: Mapping[str, float]) -> float:
        """The host group's noise standard deviation as the plan claims it (from the noise multiplier,
        not from the release's own arithmetic, which is what the audit checks)."""
        groups = self.groups
        stds = group_noise_stds([thresholds[g.name] for g in groups], [g.size for g in groups],
                                self.noise_multiplier, self.allocation)
        return stds[[g.name for g in groups].index(self.canaries.host.name)]


def canary_randomness(seed: int | None) -> NoiseSource:
    """The canaries' own stream: secure unless the run is seeded (or under data parallelism, where the
    ranks share one: ``seed`` is then rank 0's :func:`~.randomness.secret_seed` for a secret run)."""
    return side_randomness(seed, CANARY_STREAM)
