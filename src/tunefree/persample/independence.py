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

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from ..errors import PrivacyError
from ..privacy.randomness import NoiseSource
from ..rules.layout import Axis, Dim, Structure
from .layout import layout_hint

_FIX = ("Keep the example dimension first (batch_first=True), use no batch statistics (e.g. h - h.mean(0), "
        "BatchNorm), and no custom autograd.Function or hook that mixes examples.")


def _floats(value: object) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _pattern(like: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """A fixed, non-uniform tensor shaped like ``like``, cos(0.7·k + 0.3) + ``offset`` at flat index k: the
    check's probe values (not noise)."""
    return _pattern_values(like.numel(), like.dtype, like.device, offset).reshape(like.shape)


def _row_pattern(row: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """``_pattern(row, offset)`` for one example's row of a model's tensor, read only: kept for the next
    checks (a model's rows keep their sizes) up to ``_KEPT_PATTERN`` elements."""
    if row.numel() > _KEPT_PATTERN:
        return _pattern(row, offset)
    return _kept_pattern(row.numel(), row.dtype, row.device, offset).reshape(row.shape)


_KEPT_PATTERN = 1 << 20  # elements of the largest pattern kept (16 kept: at most 16 Mi elements)


def _pattern_values(numel: int, dtype: torch.dtype, device: torch.device, offset: float) -> torch.Tensor:
    """Computed in place in one buffer (a batch's inputs can be large: out of place, three such buffers at
    once); for 16-bit tensors in float32, then rounded once (float16 cannot hold an index past 65,504:
    the pattern would be NaN)."""
    wide = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    index = torch.arange(numel, device=device, dtype=wide)
    return index.mul_(0.7).add_(0.3).cos_().add_(offset).to(dtype)


_kept_pattern = functools.lru_cache(maxsize=16)(_pattern_values)


def _perturbed(args: tuple, kwargs: dict, n: int, mask: torch.Tensor, dim: int = 0) -> tuple[tuple, dict]:
    """Change the examples of ``mask`` in every batched tensor input (``n`` in dimension ``dim``): floats
    get a pattern added, integers take the next example's values (the last one its predecessor's, unless
    that one changes too). A batch whose rows are in order (sorted lengths) stays in order."""
    index = torch.arange(n)
    source = torch.where(mask, (index + 1).clamp(max=n - 1), index)
    if mask[-1] and n > 1 and not mask[-2]:
        source[-1] = n - 2

    def change(t: object) -> object:
        if not isinstance(t, torch.Tensor) or t.dim() <= dim or t.shape[dim] != n:
            return t
        if not t.is_floating_point():
            return t.detach().index_select(dim, source.to(t.device))
        t = t.detach().clone()
        rows = t.movedim(dim, 0)  # a view: writing its rows writes t
        where = mask.to(t.device)
        rows[where] += _pattern(rows[where], 1.0)
        return t
    return tuple(change(a) for a in args), {key: change(v) for key, v in kwargs.items()}


def _seed(seed: int) -> None:
    """Seed the CPU generator and, if CUDA is in use, every CUDA generator (those the check forks). Unlike
    ``torch.manual_seed`` this queues no seed for a CUDA that the caller has not initialised."""
    torch.default_generator.manual_seed(seed)
    if _rng_devices():
        torch.cuda.manual_seed_all(seed)


@dataclass(frozen=True)
class _Seen:
    """One float tensor of a unit call, as the checks read it: which input or output it is, and its
    axis (where the call's layout puts its examples; ``None``: not per example, it must not change)."""

    what: str
    tensor: torch.Tensor
    axis: Axis | None


Visit = Callable[[object, list[_Seen]], None]


def _seen(unit, args: tuple, kwargs: dict, output: object) -> list[_Seen]:
    """A unit call's float inputs and outputs, each with its axis from the call's layout, and its inputs
    that say where the examples are (offsets, batch sizes: axis :class:`Structure`, any dtype)."""
    outs = _floats(output)
    layout = unit.layout(args, kwargs, len(outs))
    leaves = tree_flatten((args, kwargs))[0]
    inputs = [_Seen(f"input {i}", x, a) for i, (x, a) in enumerate(zip(leaves, layout.inputs))
              if isinstance(x, torch.Tensor) and (x.is_floating_point() or isinstance(a, Structure))]
    return inputs + [_Seen(f"output {i}", t, a) for i, (t, a) in enumerate(zip(outs, layout.outputs))]


def _values(seen: list[_Seen]) -> list[_Seen]:
    """The tensors whose values the forward check compares (not the structure of the examples, which
    may move when one example's length changes)."""
    return [s for s in seen if not isinstance(s.axis, Structure)]


def _storage(x: torch.Tensor) -> int:
    return x.untyped_storage().data_ptr() if x.layout == torch.strided else id(x)


def _refuse_structure_from_inputs(unit, seen: list[_Seen], model_inputs: set[int]) -> None:
    """A tensor saying where the examples are (a bag's offsets, a PackedSequence's batch sizes), taken
    straight from the model's inputs: changing one example's row of the inputs would move the others."""
    for s in seen:
        if isinstance(s.axis, Structure) and _storage(s.tensor) in model_inputs:
            raise PrivacyError(
                f"module {unit.name!r} ({type(unit.module).__name__}) takes its {s.what} (shape "
                f"{tuple(s.tensor.shape)}), which says where each example's values are "
                f"({s.axis.describe()}), "
                "straight from the model's inputs: tunefree checks example independence by changing one "
                "example's rows of the model's inputs, and cannot tell which of the other inputs' values "
                "belong to that example. Give the model each example's values as one row, padded, with "
                "their lengths (e.g. ids [B, L] and lengths [B]), and build the offsets or the packed "
                "sequence inside forward (nn.EmbeddingBag also takes the padded ids [B, L] directly, "
                "with padding_idx marking the padding)")


def _forward(model: nn.Module, units: list, args: tuple, kwargs: dict, seed: int, visit: Visit,
             touch: Callable[[object], object] | None = None) -> object:
    """One forward under a fixed seed; ``visit(unit, seen)`` sees each call of a trainable unit (its float
    inputs and outputs) as it happens, and ``touch`` (if given) maps its output to what the model goes on
    with. Returns the model output."""
    def hook_for(unit):
        def hook(module, args, kwargs, output):
            visit(unit, _seen(unit, args, kwargs, output))
            return None if touch is None else touch(output)
        return hook

    handles = [u.module.register_forward_hook(hook_for(u), with_kwargs=True) for u in units]
    try:
        _seed(seed)
        return model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()


@dataclass(frozen=True)
class _Call:
    """What the forward check keeps of one unit call: its tensors' fingerprints, and its structure
    tensors (a bag's offsets, a PackedSequence's batch sizes: a few integers each)."""

    fingerprints: list
    structure: list[torch.Tensor]


def _structure(seen: list[_Seen]) -> list[torch.Tensor]:
    return [s.tensor.detach().clone() for s in seen if isinstance(s.axis, Structure)]


def _record_fingerprints(records: dict[str, list], n: int, model_inputs: set[int]) -> Visit:
    """A visit that keeps every call's fingerprints (not its activations), by unit name in call order;
    ``model_inputs``: the storages of the model's per-example inputs."""
    structured = [False]  # a call with structure seen: from there on, keep the rows' magnitudes too

    def visit(unit, seen: list[_Seen]) -> None:
        _refuse_structure_from_inputs(unit, seen, model_inputs)
        structure = _structure(seen)
        structured[0] |= bool(structure)
        fingerprints = [_fingerprint(s.tensor, s.axis, n, magnitude=structured[0]) for s in _values(seen)]
        records.setdefault(unit.name, []).append(_Call(fingerprints, structure))
    return visit


def _compare(base: dict[str, list], n: int, mask: torch.Tensor) -> Visit:
    """A visit that checks each call against the same call of ``base`` as it happens: only the examples
    of ``mask`` may differ."""
    calls: dict[str, int] = {}
    regrouped = [False]  # whether a call's structure (hence the kernels' grouping of examples) changed

    def visit(unit, seen: list[_Seen]) -> None:
        index = calls[unit.name] = calls.get(unit.name, -1) + 1
        before = base.get(unit.name, [])
        structure, seen = _structure(seen), _values(seen)
        if index >= len(before) or len(seen) != len(before[index].fingerprints):
            raise PrivacyError(f"module {unit.name!r} mixes examples in its forward: changing {_which(mask)} "
                               f"changed which tensors it is called with. {_FIX}")
        call = before[index]
        regrouped[0] |= len(structure) != len(call.structure) or not all(
            torch.equal(x, y) for x, y in zip(structure, call.structure))
        for a, s in zip(call.fingerprints, seen):
            b = _fingerprint(s.tensor, s.axis, n, magnitude=a.magnitude is not None)
            if not _unchanged_elsewhere(a, b, mask, regrouped[0]):
                raise PrivacyError(_forward_mixing(unit, s, a, b, mask))
    return visit


def _which(mask: torch.Tensor, noun: str = "example") -> str:
    """``example 3`` for one example, ``examples 0, 2, 5`` for several (the first eight named)."""
    rows = mask.nonzero().flatten().tolist()
    if len(rows) == 1:
        return f"{noun} {rows[0]}"
    return f"{noun}s " + ", ".join(map(str, rows[:8])) + (", …" if len(rows) > 8 else "")


def _forward_mixing(unit, seen: _Seen, a: _Fingerprint, b: _Fingerprint, mask: torch.Tensor) -> str:
    where = "as a whole (not per example)" if not a.batched else \
        f"with its examples in {seen.axis.describe()}"
    found = next((dim for dim in a.other_dims if _unchanged_elsewhere(a.other_dims[dim],
                                                                      b.other_dims.get(dim), mask)), None)
    hint = _FIX if found is None or not isinstance(seen.axis, Dim) else \
        f"Changing {_which(mask)} changed only {_which(mask, 'row')} of dimension {found} of this " + \
        "tensor: " + layout_hint(unit.name, unit.module, unit.rule, seen.axis.dim, found) + "."
    return (f"module {unit.name!r} mixes examples in its forward: changing {_which(mask)} changed another "
            f"example's activations in its {seen.what} (shape {tuple(seen.tensor.shape)}, read {where}). "
            f"{hint}")


_CHUNK = 1 << 20  # elements converted or multiplied at once by a fingerprint
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # an integer type of each float's size


@dataclass(frozen=True)
class _Fingerprint:
    """What the forward checks keep of one tensor instead of the tensor: its shape and, for each example
    (for the whole tensor if it has no example axis), a projection of its values on a fixed pattern and
    the wrapping integer sum of their bit patterns. A deterministic forward reproduces both bit for bit;
    a changed value always changes the checksum (several changes could cancel modulo 2^32, 2^64 for
    float64, and within the projection's rounding at once: a coincidence, not a pattern of code).
    With ``magnitude`` (kept after a call with example structure, where rounding may be tolerated) the
    projection is accumulated in float64, with each row's |values| on |pattern|, and no checksum.
    ``other_dims``: for a tensor with its examples along a dimension, the fingerprints along its other
    dimensions of the batch's size, which say where a change went when it is not where the layout says."""

    shape: tuple[int, ...]
    batched: bool
    rows: torch.Tensor
    magnitude: torch.Tensor | None  # each row's |values| on |pattern|: the scale of its rounding (if kept)
    eps: float  # the tensor's machine epsilon
    other_dims: dict[int, _Fingerprint] = field(default_factory=dict)
    checksums: torch.Tensor | None = None


def _fingerprint(t: torch.Tensor, axis: Axis | None, n: int, others: bool = True,
                 magnitude: bool = False) -> _Fingerprint:
    t = t.detach()
    batched = axis is not None and axis.examples(t) == n
    rows = axis.batch_first(t) if batched else t.reshape(1, -1)
    other_dims = {}
    if others and isinstance(axis, Dim):
        other_dims = {dim: _fingerprint(t, Dim(dim), n, others=False)
                      for dim in range(t.dim()) if dim != axis.dim and t.shape[dim] == n}
    # Packed sequences and bags are padded to the longest example, which a changed example may change.
    shape = (n,) if batched and not isinstance(axis, Dim) else tuple(t.shape)
    flat = rows.reshape(rows.shape[0], -1)
    eps = torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0
    if magnitude:
        return _Fingerprint(shape, batched, _projection(flat), _projection(flat, absolute=True), eps,
                            other_dims)
    return _Fingerprint(shape, batched, _fast_projection(flat), None, eps, other_dims, _checksums(flat))


def _projection(flat: torch.Tensor, absolute: bool = False) -> torch.Tensor:
    """Each row of ``flat`` projected on a fixed pattern (``absolute``: |row| on |pattern|), in float64."""
    pattern = _row_pattern(flat[0], 2.0)  # nowhere near zero, and positive
    rows = max(1, _CHUNK // max(1, flat.shape[1]))  # a few rows at a time: no copy of the whole tensor
    return torch.cat([((flat[i:i + rows].abs() if absolute else flat[i:i + rows]) * pattern)
                      .sum(1, dtype=torch.float64) for i in range(0, flat.shape[0], rows)])


def _fast_projection(flat: torch.Tensor) -> torch.Tensor:
    """Each row of ``flat`` projected on the pattern: one matrix-vector product, in float32 (float64 for
    float64 tensors)."""
    dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
    pattern = _row_pattern(flat[0].to(dtype), 2.0)
    if flat.dtype == dtype:
        return flat @ pattern
    rows = max(1, _CHUNK // max(1, flat.shape[1]))  # a few rows converted at a time
    return torch.cat([flat[i:i + rows].to(dtype) @ pattern for i in range(0, flat.shape[0], rows)])


def _checksums(flat: torch.Tensor) -> torch.Tensor:
    """Each row's wrapping sum of its values' bit patterns (integer addition: the same in any order)."""
    bits = flat.contiguous().view(_BITS[flat.element_size()])
    return bits.sum(1, dtype=torch.int64 if bits.dtype == torch.int64 else torch.int32)


# When a call's structure changes (one example's length moves a PackedSequence's batch sizes), kernels
# group the other examples differently and may round their values differently: only a change beyond this
# many units of rounding (relative to each row's magnitude) counts then.
_REGROUPED_ROUNDING = 256


def _unchanged_elsewhere(a: _Fingerprint, b: _Fingerprint | None, mask: torch.Tensor,
                         regrouped: bool = False) -> bool:
    """Whether changing the examples of ``mask`` left the other examples as they were: bit for bit, or,
    once the examples' grouping changed (``regrouped``), within rounding. A tensor without the batch on
    its example axis (a shared table, a mask) must not change at all."""
    if b is None or a.shape != b.shape or a.batched != b.batched:
        return False
    keep = ~mask.to(a.rows.device) if a.batched else torch.ones(a.rows.numel(), dtype=torch.bool,
                                                                 device=a.rows.device)
    if regrouped and a.magnitude is not None and b.magnitude is not None:
        bound = _REGROUPED_ROUNDING * a.eps * torch.maximum(a.magnitude, b.magnitude)
        return bool(((a.rows - b.rows).abs() <= bound)[keep].all())
    same = torch.equal(a.rows[keep], b.rows[keep])
    if a.checksums is not None and b.checksums is not None:
        same = same and torch.equal(a.checksums[keep], b.checksums[keep])
    return same


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
    gradients. A pair of examples (i, j) in which j's data reaches i is seen by a mask of the right kind
    holding j but not i."""

    perturbed: tuple[torch.Tensor, ...]
    zeroed: tuple[torch.Tensor, ...]

    @staticmethod
    def ends(n: int) -> Probes:
        """The first and the last example, each alone, for both kinds (deterministic: for direct calls and
        tests). Mixing that neither reaches nor leaves these two is not seen."""
        masks = tuple(_mask(n, [k]) for k in (0, n - 1))
        return Probes(masks, masks)


FORWARD, GRADIENT = "forward", "gradient"  # the two kinds of probe


# The kinds of probe of the run's first checks, in order, each on its own step: the first release is
# checked by a gradient probe (which sees backward mixing and most forward mixing), the second by a
# forward probe (which sees forward mixing before the first trainable unit or without gradients).
FIRST_KINDS = (GRADIENT, FORWARD)


class ProbeSchedule:
    """When a private run checks example independence, and how: drawn from the run's noise source
    (secret by default; in a seeded run keyed by the step, so that the run replays), so that a model
    cannot tell a checked step from another.

    A check is one probe, a forward probe or a gradient probe, on a random half of the batch: each
    example in it with probability ½, drawn again while it holds all examples or none. A pair of examples
    (i, j) in which j's data reaches i's activations (seen by forward probes) or output gradients (seen by
    gradient probes, which also see forward mixing after a trainable unit that gradients flow through) is
    caught by a probe of a kind that sees it when j is in its half and i is not: with probability ≥ 1/4.

    The run's first two steps are both checked, each before its release: the first with a gradient probe,
    the second with a forward probe (:data:`FIRST_KINDS`). Later, each step is checked with probability
    ``1/every``, independently, with a probe of a random kind (probability ½ each). So a pair is caught
    before the first release with probability ≥ 1/4 if gradient probes see it (else 0), before the second
    release with probability ≥ 1/4 (7/16 when both kinds see it), and at each later check with
    probability ≥ 1/4 · 1/2 = 1/8 (1/4 when both kinds see it), independently from check to check. Mixing
    present in T steps is missed by all of them with probability at most (1 − 1/(8·every))^T.
    """

    _KEY = 1 << 62  # keys of the run's randomness far beyond any step number the sampling uses

    def __init__(self, randomness: NoiseSource):
        self.randomness = randomness

    def due(self, step: int, every: int) -> bool:
        """Whether logical step ``step`` is checked (each step with probability ``1/every``)."""
        return every == 1 or bool(self._draw(step, 0, 1, 1 / every)[0])

    def probes(self, step: int, n: int, kind: str | None = None) -> Probes:
        """Step ``step``'s probe of a batch of ``n`` ≥ 2 examples: one random half, for ``kind``
        (:data:`FORWARD` or :data:`GRADIENT`; ``None``: a random one)."""
        if kind is None:
            kind = FORWARD if self._draw(step, 1, 1, 0.5)[0] else GRADIENT
        half = (self._half(step, 2, n),)
        return Probes(half, ()) if kind == FORWARD else Probes((), half)

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
                                seed: int = 0, examples: int | None = None, probes: Probes | None = None
                                ) -> None:
    """Raise PrivacyError unless example i's activations and output gradients at every trainable unit
    depend on example i alone. ``args``/``kwargs`` are one real batch's root-call inputs, examples in
    the dimension declared for the model's inputs (``engine.declared.root``, 0 by default; at least 2).
    Each unit's tensors are read where its calls' layout puts their examples. ``examples``: the batch's
    count by provenance (the private loader's); without it, that of the first input tensor. ``probes``:
    the examples changed and silenced, by default the first and the last, each alone (a private run
    draws one probe on a random half, see :class:`ProbeSchedule`). Costs, on the whole batch, one forward
    without gradients per changed mask (and one more if there is any), and one forward with gradients
    plus one backward per silenced mask."""
    kwargs = kwargs or {}
    root = engine.declared.root
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() > root]
    n = examples if examples is not None else next((t.shape[root] for t in tensors), 0)
    if n < 2:
        raise ValueError("verify_example_independence needs a batch of at least 2 examples in dimension "
                         f"{root} of the model's inputs")
    probes = probes or Probes.ends(n)
    units = [u for u in engine.units if any(p.requires_grad for p in u.direct.values())]
    with torch.random.fork_rng(devices=_rng_devices()), engine.no_capture():
        if probes.perturbed:
            _check_forward(model, units, args, kwargs, n, seed, root, probes.perturbed)
        if probes.zeroed:
            _check_gradients(model, units, args, kwargs, n, seed, root, probes.zeroed)


def _check_forward(model: nn.Module, units: list, args: tuple, kwargs: dict, n: int, seed: int, root: int,
                   masks: tuple[torch.Tensor, ...]) -> None:
    """Changing the examples of each mask must leave every other example's activations at every
    trainable unit unchanged. Forwards without gradients, each unit call compared as it happens."""
    with torch.no_grad():
        base: dict[str, list] = {}
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.dim() > root and t.shape[root] == n}
        _forward(model, units, args, kwargs, seed, _record_fingerprints(base, n, inputs))
        for mask in masks:
            _forward(model, units, *_perturbed(args, kwargs, n, mask, root), seed, _compare(base, n, mask))


def _check_gradients(model: nn.Module, units: list, args: tuple, kwargs: dict, n: int, seed: int, root: int,
                     masks: tuple[torch.Tensor, ...]) -> None:
    """For each mask, a backward of Σ w·output with the mask's examples weighted 0: every gradient of
    those examples at every trainable unit's tensors must be zero. Each unit's output goes on as
    ``output + 0·anchor`` (the same values) and the backward is taken with respect to ``anchor`` alone: it
    runs through every unit's output and what follows, and forms no parameter gradient and no activation
    gradient beyond those in flight (none is written to ``.grad``). Gradients are checked by hooks as the
    backward computes them and dropped; the hooks hold no activation."""
    probe = _Probe(n)
    handles: list = []
    anchor = torch.zeros((), requires_grad=True)
    seen_now: dict[int, tuple[str, _Seen]] = {}  # the unit call in progress: its tensors to hook

    def visit(unit, seen: list[_Seen]) -> None:
        seen_now.update({id(s.tensor): (unit.name, s) for s in seen if s.tensor.requires_grad
                         and s.axis is not None and s.axis.examples(s.tensor) == n})

    def touch(output: object) -> object:
        def anchored(t: torch.Tensor) -> torch.Tensor:
            if not t.requires_grad:
                return t
            out = t + 0 * anchor  # hooked here, its gradient is always computed (the path to anchor)
            if id(t) in seen_now:
                name, s = seen_now.pop(id(t))
                handles.append(out.register_hook(_zero_at(probe, s, name)))
            return out
        touched = tree_map_only(torch.Tensor, anchored, output)
        for name, s in seen_now.values():  # the call's inputs: downstream of earlier units' outputs
            handles.append(s.tensor.register_hook(_zero_at(probe, s, name)))
        seen_now.clear()
        return touched
    try:
        output = _forward(model, units, args, kwargs, seed, visit, touch)
        batched, dim = _batched_outputs(output, n, root)
        if not handles or not batched:
            return
        for i, mask in enumerate(masks):
            probe.mask = mask
            weights = [_loss_weights(t, dim, mask) for t in batched]  # the loss Σ w·output
            torch.autograd.grad(batched, [anchor], grad_outputs=weights,
                                retain_graph=i < len(masks) - 1)  # a scalar, dropped
    finally:
        for handle in handles:
            handle.remove()


def _loss_weights(t: torch.Tensor, dim: int, mask: torch.Tensor) -> torch.Tensor:
    """The gradient probe's loss weights on model output ``t`` (examples in dimension ``dim``): each
    example's values weighted by a fixed pattern times a factor of the example's own (so that one
    example's gradient, reaching two others, cancels between them only by coincidence), those of
    ``mask`` by 0."""
    rows = t.detach().movedim(dim, 0)
    factors = _pattern(rows.new_empty(rows.shape[0]), 2.0).masked_fill(mask.to(t.device), 0.0)
    return (factors.reshape(-1, *[1] * (rows.dim() - 1)) * _row_pattern(rows[0])).movedim(0, dim)


def _batched_outputs(output: object, n: int, root: int) -> tuple[list[torch.Tensor], int]:
    """The model's outputs that carry the examples, and where: in the dimension declared for its inputs,
    else in dimension 0 (a time-major model that pools over time). Weighting the wrong dimension makes
    the probe refuse, never pass."""
    for dim in dict.fromkeys((root, 0)):
        batched = [t for t in _floats(output) if t.dim() > dim and t.shape[dim] == n and t.requires_grad]
        if batched:
            return batched, dim
    return [], root


@dataclass
class _Probe:
    """The batch's examples, and which of them have zero loss weight in the current gradient probe."""

    examples: int
    mask: torch.Tensor | None = None


def _zero_at(probe: _Probe, seen: _Seen, name: str) -> Callable[[torch.Tensor], None]:
    """A gradient hook refusing any nonzero gradient at the silenced examples of unit ``name``'s tensor."""
    what, shape, axis = seen.what, tuple(seen.tensor.shape), seen.axis

    def check(grad: torch.Tensor) -> None:
        rows = axis.batch_first(grad)
        silenced = probe.mask.to(rows.device)
        if torch.count_nonzero(rows[silenced]) == 0:
            return
        k = int((rows.reshape(rows.shape[0], -1).abs().sum(1) != 0).logical_and(silenced).nonzero()[0])
        raise PrivacyError(f"module {name!r} mixes examples in its backward: example {k} has "
                           f"zero loss weight but nonzero gradients at its {what} (shape {shape}, read "
                           f"with its examples in {axis.describe()}). {_FIX}")
    return check
