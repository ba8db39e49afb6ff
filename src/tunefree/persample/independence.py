"""Structural check that each example's captured activations and output gradients depend on it alone.

Per-sample clipping bounds one example's contribution only if nothing mixes examples: a batch statistic,
a time-major layout, a custom ``autograd.Function`` or hook whose backward mixes. The check releases
nothing: it runs inside ``engine.no_capture()``, writes no ``.grad`` and restores the RNG state (CPU and
CUDA).

It runs on the whole batch, with two kinds of probe. A forward probe changes some examples and requires
every other example's activations at every trainable unit to stay as they were; a gradient probe gives
some examples zero loss weight and requires their output gradients at every trainable unit to be zero.
A private run checks at random steps (:class:`ProbeSchedule`), each check one probe of a random kind on a
random half of the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..errors import PrivacyError
from ..privacy.randomness import Randomness

_FIX = ("Keep the example dimension first (batch_first=True), use no batch statistics (e.g. h - h.mean(0), "
        "BatchNorm), and no custom autograd.Function or hook that mixes examples.")


def _floats(value: object) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _pattern(like: torch.Tensor) -> torch.Tensor:
    """A fixed, non-uniform tensor shaped like ``like``: the check's probe values (not noise)."""
    index = torch.arange(like.numel(), device=like.device, dtype=like.dtype)
    return torch.cos(index * 0.7 + 0.3).reshape(like.shape)


def _perturbed(args: tuple, kwargs: dict, n: int, mask: torch.Tensor) -> tuple[tuple, dict]:
    """Change the examples of ``mask`` in every batched tensor input: floats get a pattern added,
    integers take the next example's values."""
    rows = torch.arange(n)
    source = torch.where(mask, (rows + 1) % n, rows)

    def change(t: object) -> object:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n:
            return t
        if not t.is_floating_point():
            return t.detach()[source.to(t.device)]
        t = t.detach().clone()
        where = mask.to(t.device)
        t[where] += _pattern(t[where]) + 1.0
        return t
    return tuple(change(a) for a in args), {key: change(v) for key, v in kwargs.items()}


def _seed(seed: int) -> None:
    """Seed the CPU generator and, if CUDA is in use, every CUDA generator (those the check forks). Unlike
    ``torch.manual_seed`` this queues no seed for a CUDA that the caller has not initialised."""
    torch.default_generator.manual_seed(seed)
    if _rng_devices():
        torch.cuda.manual_seed_all(seed)


Visit = Callable[[str, list[torch.Tensor], tuple[int, ...]], None]


def _forward(model: nn.Module, units: list, args: tuple, kwargs: dict, seed: int, visit: Visit) -> object:
    """One forward under a fixed seed; ``visit(unit name, tensors, example dims)`` sees each call of a
    trainable unit (its float inputs and outputs) as it happens. Returns the model output."""
    def hook_for(unit):
        def hook(module, inputs, output):
            outs = _floats(output)
            rule = unit.rule
            dims = rule.output_batch_dims(module, len(outs)) if rule is not None else (0,) * len(outs)
            visit(unit.name, _floats(inputs) + outs, (0,) * len(_floats(inputs)) + tuple(dims))
        return hook

    handles = [u.module.register_forward_hook(hook_for(u)) for u in units]
    try:
        _seed(seed)
        return model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()


def _record_fingerprints(records: dict[str, list], n: int) -> Visit:
    """A visit that keeps every call's fingerprints (not its activations), by unit name in call order."""
    def visit(name: str, tensors: list[torch.Tensor], dims: tuple[int, ...]) -> None:
        records.setdefault(name, []).append([_fingerprint(t, d, n) for t, d in zip(tensors, dims)])
    return visit


def _compare(base: dict[str, list], mask: torch.Tensor) -> Visit:
    """A visit that checks each call against the same call of ``base`` as it happens: only the examples
    of ``mask`` may differ."""
    calls: dict[str, int] = {}
    n = mask.numel()

    def visit(name: str, tensors: list[torch.Tensor], dims: tuple[int, ...]) -> None:
        index = calls[name] = calls.get(name, -1) + 1
        recorded = base.get(name, [])
        if index >= len(recorded) or len(recorded[index]) != len(tensors):
            raise PrivacyError(f"module {name!r} mixes examples in its forward: changing {_which(mask)} "
                               f"changed how it is called. {_FIX}")
        for before, t, d in zip(recorded[index], tensors, dims):
            moved = _moved_elsewhere(before, _fingerprint(t, d, n), mask)
            if moved is not None:
                raise PrivacyError(f"module {name!r} mixes examples in its forward: changing {_which(mask)} "
                                   f"changed {moved}. {_FIX}")
    return visit


def _which(mask: torch.Tensor) -> str:
    rows = mask.nonzero().flatten().tolist()
    return f"example {rows[0]}" if len(rows) == 1 else f"examples {_listed(rows)}"


def _listed(rows: list[int]) -> str:
    return ", ".join(map(str, rows[:8])) + (", …" if len(rows) > 8 else "")


_CHUNK = 1 << 20  # elements of a half-precision tensor converted at once by a fingerprint
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # an integer type of each float's size


@dataclass(frozen=True)
class _Fingerprint:
    """What the forward checks keep of one tensor instead of the tensor: its shape and, for each example
    (for the whole tensor if it has no example dimension), a projection of its values on a fixed pattern
    (float32; float64 for float64 tensors) and the wrapping integer sum of their bit patterns. A
    deterministic forward reproduces both bit for bit. A changed row changes the checksum unless its bit
    changes cancel modulo 2^32 (2^64 for float64) and the projection unless the change is within the
    rounding of its sum or cancels against the pattern: both at once is a coincidence, not a pattern of
    code (a change of one value always changes the checksum)."""

    shape: tuple[int, ...]
    batched: bool
    rows: torch.Tensor
    checksums: torch.Tensor


def _fingerprint(t: torch.Tensor, dim: int, n: int) -> _Fingerprint:
    batched = t.dim() > dim and t.shape[dim] == n
    flat = t.detach().movedim(dim, 0).flatten(1) if batched else t.detach().reshape(1, -1)
    return _Fingerprint(tuple(t.shape), batched, _projection(flat), _checksums(flat))


def _projection(flat: torch.Tensor) -> torch.Tensor:
    dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
    pattern = _pattern(flat[0].to(dtype)) + 2.0  # nowhere near zero
    if flat.dtype == dtype:
        return flat @ pattern
    rows = max(1, _CHUNK // max(1, flat.shape[1]))  # a few rows at a time: no copy of the whole tensor
    return torch.cat([flat[i:i + rows].to(dtype) @ pattern for i in range(0, flat.shape[0], rows)])


def _checksums(flat: torch.Tensor) -> torch.Tensor:
    bits = flat.contiguous().view(_BITS[flat.element_size()])
    return bits.sum(1, dtype=torch.int64 if bits.dtype == torch.int64 else torch.int32)


def _moved_elsewhere(a: _Fingerprint, b: _Fingerprint, mask: torch.Tensor) -> str | None:
    """What moved outside the examples of ``mask`` between ``a`` and ``b`` (``None``: nothing). A tensor
    without the batch in its example dimension (a shared table, a mask) must not change at all."""
    if a.shape != b.shape or a.batched != b.batched:
        return "the shape of its activations"
    differs = (a.rows != b.rows) | (a.checksums != b.checksums)
    if not a.batched:
        return "an activation shared by all examples" if differs.any() else None
    moved = (differs & ~mask.to(differs.device)).nonzero()
    return f"example {int(moved[0])}'s activations" if len(moved) else None


def _rng_devices() -> list[int]:
    """CUDA devices whose RNG state the check seeds and restores: all of them, once CUDA is initialised."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return list(range(torch.cuda.device_count()))


@dataclass(frozen=True)
class Probes:
    """The examples one check changes and silences. Each mask in ``perturbed`` costs one forward pass: its
    examples are changed and every other example's activations must stay as they were. Each mask in
    ``zeroed`` costs one backward pass: its examples get zero loss weight and must get zero output
    gradients. A pair of examples (i, j) in which j's data reaches i (forward or backward) is seen by a
    mask holding j but not i."""

    perturbed: tuple[torch.Tensor, ...]
    zeroed: tuple[torch.Tensor, ...]

    @staticmethod
    def ends(n: int) -> Probes:
        """The first and the last example, each alone (deterministic: for direct calls and tests). Mixing
        that neither reaches nor leaves these two is not seen."""
        masks = tuple(_mask(n, [k]) for k in (0, n - 1))
        return Probes(masks, masks)


class ProbeSchedule:
    """When a private run checks example independence, and how: drawn from the run's randomness (secret
    by default; in a seeded run keyed by the step, so that the run replays), so that a model cannot tell
    a checked step from another.

    Each step is checked with probability ``1/every``, independently. A check is a forward probe or a
    gradient probe (probability ½ each; the run's first check runs both) on a random half of the batch:
    each example in it with probability ½, drawn again while it holds all examples or none, independently
    for each probe. A pair of examples (i, j) in which j's data reaches i's activations (seen by forward
    probes) or output gradients (seen by gradient probes, which also see forward mixing after a trainable
    unit that gradients flow through) is caught by a probe of a kind that sees it when j is in its half
    and i is not: with probability ≥ 1/4 · 1/2 = 1/8 per check (≥ 1/4 when both kinds see it; at the first
    check ≥ 1/4, and 7/16 when both kinds see it), independently from check to check. Mixing present in T
    steps is missed by all of them with probability at most (1 − 1/(8·every))^T.
    """

    _KEY = 1 << 62  # keys of the run's randomness far beyond any step number the sampling uses

    def __init__(self, randomness: Randomness):
        self.randomness = randomness

    def due(self, step: int, every: int) -> bool:
        """Whether logical step ``step`` is checked (each step with probability ``1/every``)."""
        return every == 1 or bool(self._draw(step, 0, 1, 1 / every)[0])

    def probes(self, step: int, n: int, both: bool = False) -> Probes:
        """Step ``step``'s probe of a batch of ``n`` ≥ 2 examples: one random half, for one kind (for
        both kinds if ``both``)."""
        if both:
            return Probes((self._half(step, 2, n),), (self._half(step, 3, n),))
        half = (self._half(step, 2, n),)
        return Probes(half, ()) if self._draw(step, 1, 1, 0.5)[0] else Probes((), half)

    def _half(self, step: int, purpose: int, n: int) -> torch.Tensor:
        """A random subset of the n examples, neither empty nor all of them (drawn again up to 64 times,
        then the first example alone: a fair source gets there with probability below 2^-64)."""
        for attempt in range(64):
            mask = self._draw(step, purpose, n, 0.5, attempt)
            if 0 < int(mask.sum()) < n:
                return mask
        return _mask(n, [0])

    def _draw(self, step: int, purpose: int, count: int, rate: float, attempt: int = 0) -> torch.Tensor:
        """Each of ``count`` flags set with probability ``rate``; in a seeded run, keyed by (step, purpose,
        attempt) on keys that no sampling step uses."""
        return self.randomness.inclusion(self._KEY + ((4 * step + purpose) << 16) + attempt, count, rate)


def _mask(n: int, rows: list[int]) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[rows] = True
    return mask


def verify_example_independence(model: nn.Module, engine, args: tuple, kwargs: dict | None = None,
                                seed: int = 0, probes: Probes | None = None) -> None:
    """Raise PrivacyError unless example i's activations and output gradients at every trainable unit
    depend on example i alone. ``args``/``kwargs`` are one real batch's root-call inputs, examples in
    dimension 0 (at least 2). ``probes``: the examples changed and silenced, by default the first and the
    last, each alone (a private run draws one probe on a random half, see :class:`ProbeSchedule`). Costs,
    on the whole batch, one forward without gradients per changed mask (and one more if there is any),
    and one forward with gradients plus one backward per silenced mask."""
    kwargs = kwargs or {}
    n = next((t.shape[0] for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim()),
             0)
    if n < 2:
        raise ValueError("verify_example_independence needs a batch of at least 2 examples in dimension 0")
    probes = probes or Probes.ends(n)
    units = [u for u in engine.units if any(p.requires_grad for p in u.direct.values())]
    with torch.random.fork_rng(devices=_rng_devices()), engine.no_capture():
        if probes.perturbed:
            _check_forward(model, units, args, kwargs, seed, probes.perturbed)
        if probes.zeroed:
            _check_gradients(model, units, args, kwargs, seed, probes.zeroed)


def _check_forward(model: nn.Module, units: list, args: tuple, kwargs: dict, seed: int,
                   masks: tuple[torch.Tensor, ...]) -> None:
    """Changing the examples of each mask must leave every other example's activations at every
    trainable unit unchanged. Forwards without gradients, each unit call compared as it happens."""
    n = masks[0].numel()
    with torch.no_grad():
        base: dict[str, list] = {}
        _forward(model, units, args, kwargs, seed, _record_fingerprints(base, n))
        for mask in masks:
            _forward(model, units, *_perturbed(args, kwargs, n, mask), seed, _compare(base, mask))


def _check_gradients(model: nn.Module, units: list, args: tuple, kwargs: dict, seed: int,
                     masks: tuple[torch.Tensor, ...]) -> None:
    """For each mask, a backward of Σ w·output with the mask's examples weighted 0: every output gradient
    of those examples at every trainable unit must be zero. Gradients are taken with respect to the
    units' tensors only (no parameter gradient is formed, none is written to ``.grad``), checked by hooks
    as the backward computes them and dropped; the hooks hold no activation."""
    probe = _Probe()
    handles: list = []
    hooked: list[torch.Tensor] = []
    n = masks[0].numel()

    def visit(name: str, tensors: list[torch.Tensor], dims: tuple[int, ...]) -> None:
        for t, d in zip(tensors, dims):
            if t.requires_grad:
                handles.append(t.register_hook(_zero_at(probe, d, name)))
                hooked.append(t)
    try:
        output = _forward(model, units, args, kwargs, seed, visit)
        batched = [t for t in _floats(output) if t.dim() and t.shape[0] == n and t.requires_grad]
        if not hooked or not batched:
            return
        for i, mask in enumerate(masks):
            probe.mask = mask
            weights = [_pattern(t) * (~mask.to(t.device)).reshape(-1, *[1] * (t.dim() - 1)) for t in batched]
            torch.autograd.grad(batched, hooked, grad_outputs=weights, allow_unused=True,
                                retain_graph=i < len(masks) - 1)  # returned, dropped
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class _Probe:
    """The examples whose loss weight is zero in the current gradient probe."""

    mask: torch.Tensor | None = None


def _zero_at(probe: _Probe, dim: int, name: str) -> Callable[[torch.Tensor], None]:
    """A gradient hook refusing any nonzero gradient at the silenced examples of unit ``name``'s tensor."""
    def check(grad: torch.Tensor) -> None:
        rows = grad.movedim(dim, 0)
        silenced = probe.mask.to(rows.device)
        if rows.shape[0] != silenced.numel() or rows[silenced].abs().sum() == 0:
            return
        k = int((rows.flatten(1).abs().sum(1) != 0).logical_and(silenced).nonzero()[0])
        raise PrivacyError(f"module {name!r} mixes examples in its backward: example {k} has "
                           f"zero loss weight but nonzero output gradients. {_FIX}")
    return check
