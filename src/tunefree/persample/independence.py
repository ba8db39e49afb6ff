"""Structural check that each example's captured activations and output gradients depend on it alone.

Per-sample clipping bounds one example's contribution only if nothing mixes examples: a batch statistic,
a time-major layout, a custom ``autograd.Function`` or hook whose backward mixes. The check releases
nothing: it runs inside ``engine.no_capture()``, writes no ``.grad`` and restores the RNG state (CPU and
CUDA).

It runs on the first two and the last two examples of the batch and probes the first and the last, so
mixing that flows only into one end of the batch is seen. Mixing confined to examples in the middle of
the batch (by their position, not by a batch statistic) is not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..errors import PrivacyError
from ..rules.layout import Axis, Dim, Structure
from .layout import layout_hint

_FIX = ("Keep the example dimension first (batch_first=True), use no batch statistics (e.g. h - h.mean(0), "
        "BatchNorm), and no custom autograd.Function or hook that mixes examples.")


def _floats(value: object) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _pattern(like: torch.Tensor) -> torch.Tensor:
    """A fixed, non-uniform tensor shaped like ``like``: the check's probe values (not noise)."""
    index = torch.arange(like.numel(), device=like.device, dtype=like.dtype)
    return torch.cos(index * 0.7 + 0.3).reshape(like.shape)


def _rows(args: tuple, kwargs: dict, n: int, rows: list[int], dim: int = 0) -> tuple[tuple, dict]:
    """The batch cut down to examples ``rows`` (every tensor input with ``n`` in dimension ``dim``, the
    model inputs' example dimension)."""
    index = torch.tensor(rows)

    def cut(t: object) -> object:
        if not isinstance(t, torch.Tensor) or t.dim() <= dim or t.shape[dim] != n:
            return t
        return t.index_select(dim, index.to(t.device))
    return tuple(cut(a) for a in args), {key: cut(v) for key, v in kwargs.items()}


def _perturbed(args: tuple, kwargs: dict, n: int, k: int, dim: int = 0) -> tuple[tuple, dict]:
    """Change example ``k`` of every batched tensor input (``n`` in dimension ``dim``): floats get noise,
    integers another example's values."""
    def change(t: object) -> object:
        if not isinstance(t, torch.Tensor) or t.dim() <= dim or t.shape[dim] != n:
            return t
        t = t.detach().clone()
        rows = t.movedim(dim, 0)  # a view: writing its rows writes t
        if t.is_floating_point():
            rows[k] += _pattern(rows[k]) + 1.0
        else:  # a neighbouring example's values: keeps any order the batch's rows are in (sorted lengths)
            rows[k] = rows[k + 1 if k + 1 < n else k - 1]
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


def _forward(model: nn.Module, units: list, args: tuple, kwargs: dict, seed: int, visit: Visit) -> object:
    """One forward under a fixed seed; ``visit(unit, seen)`` sees each call of a trainable unit (its float
    inputs and outputs) as it happens. Returns the model output."""
    def hook_for(unit):
        def hook(module, args, kwargs, output):
            visit(unit, _seen(unit, args, kwargs, output))
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


def _compare(base: dict[str, list], n: int, k: int, label: int) -> Visit:
    """A visit that checks each call against the same call of ``base`` as it happens: only example
    ``k`` may differ."""
    calls: dict[str, int] = {}
    regrouped = [False]  # whether a call's structure (hence the kernels' grouping of examples) changed

    def visit(unit, seen: list[_Seen]) -> None:
        index = calls[unit.name] = calls.get(unit.name, -1) + 1
        before = base.get(unit.name, [])
        structure, seen = _structure(seen), _values(seen)
        if index >= len(before) or len(seen) != len(before[index].fingerprints):
            raise PrivacyError(f"module {unit.name!r} mixes examples in its forward: changing example "
                               f"{label} changed which tensors it is called with. {_FIX}")
        call = before[index]
        regrouped[0] |= len(structure) != len(call.structure) or not all(
            torch.equal(x, y) for x, y in zip(structure, call.structure))
        for a, s in zip(call.fingerprints, seen):
            b = _fingerprint(s.tensor, s.axis, n, magnitude=regrouped[0])
            if not _unchanged_elsewhere(a, b, k, regrouped[0]):
                raise PrivacyError(_forward_mixing(unit, s, a, b, k, label))
    return visit


def _forward_mixing(unit, seen: _Seen, a: _Fingerprint, b: _Fingerprint, k: int, label: int) -> str:
    where = "as a whole (not per example)" if not a.batched else \
        f"with its examples in {seen.axis.describe()}"
    found = next((dim for dim in a.other_dims if _unchanged_elsewhere(a.other_dims[dim],
                                                                      b.other_dims.get(dim), k)), None)
    hint = _FIX if found is None or not isinstance(seen.axis, Dim) else \
        f"Changing example {label} changed only row {label} of dimension {found} of this tensor: " + \
        layout_hint(unit.name, unit.module, unit.rule, seen.axis.dim, found) + "."
    return (f"module {unit.name!r} mixes examples in its forward: changing example {label} changed another "
            f"example's activations in its {seen.what} (shape {tuple(seen.tensor.shape)}, read {where}). "
            f"{hint}")


_CHUNK = 1 << 20  # elements multiplied at once by a fingerprint


@dataclass(frozen=True)
class _Fingerprint:
    """What the forward checks keep of one tensor instead of the tensor: its shape and a projection of
    each example's values (of the whole tensor if it has no example axis) on a fixed pattern,
    accumulated in float64. A deterministic forward reproduces it bit for bit; a changed row changes its
    projection (a change cancelling exactly against the pattern is a measure-zero coincidence).
    ``other_dims``: for a tensor with its examples along a dimension, the fingerprints along its other
    dimensions of the batch's size, which say where a change went when it is not where the layout says."""

    shape: tuple[int, ...]
    batched: bool
    rows: torch.Tensor
    magnitude: torch.Tensor | None  # each row's |values| on |pattern|: the scale of its rounding (if kept)
    eps: float  # the tensor's machine epsilon
    other_dims: dict[int, _Fingerprint] = field(default_factory=dict)


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
    scale = _projection(flat, absolute=True) if magnitude else None
    return _Fingerprint(shape, batched, _projection(flat), scale, eps, other_dims)


def _projection(flat: torch.Tensor, absolute: bool = False) -> torch.Tensor:
    """Each row of ``flat`` projected on a fixed pattern (``absolute``: |row| on |pattern|), in float64."""
    pattern = _pattern(flat[0]) + 2.0  # nowhere near zero, and positive
    rows = max(1, _CHUNK // max(1, flat.shape[1]))  # a few rows at a time: no copy of the whole tensor
    return torch.cat([((flat[i:i + rows].abs() if absolute else flat[i:i + rows]) * pattern)
                      .sum(1, dtype=torch.float64) for i in range(0, flat.shape[0], rows)])


# When a call's structure changes (one example's length moves a PackedSequence's batch sizes), kernels
# group the other examples differently and may round their values differently: only a change beyond this
# many units of rounding (relative to each row's magnitude) counts then.
_REGROUPED_ROUNDING = 256


def _unchanged_elsewhere(a: _Fingerprint, b: _Fingerprint | None, k: int, regrouped: bool = False) -> bool:
    """Whether changing example k left the other examples as they were: bit for bit, or, once the
    examples' grouping changed (``regrouped``), within rounding. A tensor without the batch on its example
    axis (a shared table, a mask) must not change at all."""
    if b is None or a.shape != b.shape or a.batched != b.batched:
        return False
    keep = torch.ones(a.rows.numel(), dtype=torch.bool, device=a.rows.device)
    if a.batched:
        keep[k] = False
    if not regrouped or a.magnitude is None or b.magnitude is None:
        return torch.equal(a.rows[keep], b.rows[keep])
    bound = _REGROUPED_ROUNDING * a.eps * torch.maximum(a.magnitude, b.magnitude)
    return bool(((a.rows - b.rows).abs() <= bound)[keep].all())


def _rng_devices() -> list[int]:
    """CUDA devices whose RNG state the check seeds and restores: all of them, once CUDA is initialised."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return list(range(torch.cuda.device_count()))


def verify_example_independence(model: nn.Module, engine, args: tuple, kwargs: dict | None = None,
                                seed: int = 0, examples: int | None = None) -> None:
    """Raise PrivacyError unless example i's activations and output gradients at every trainable unit
    depend on example i alone. ``args``/``kwargs`` are one real batch's root-call inputs, examples in
    the dimension declared for the model's inputs (``engine.declared.root``, 0 by default; at least 2).
    Each unit's tensors are read where its calls' layout puts their examples. Costs three forwards without
    gradients, one with gradients and two backwards, all on four of the batch's examples (the first two
    and the last two). ``examples``: the batch's count by provenance (the private loader's); without
    it, that of the first input tensor."""
    kwargs = kwargs or {}
    root = engine.declared.root
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() > root]
    n = examples if examples is not None else next((t.shape[root] for t in tensors), 0)
    if n < 2:
        raise ValueError("verify_example_independence needs a batch of at least 2 examples in dimension "
                         f"{root} of the model's inputs")
    units = [u for u in engine.units if any(p.requires_grad for p in u.direct.values())]
    # The probes run on the first two and the last two examples: mixing by a batch statistic, a layout
    # that is not batch-first, a custom Function or a hook shows on any two, and a small batch costs
    # little time and memory. An input with n rows that is not batched (a shared [T, T] mask when T == n)
    # is cut too; if the model then fails, the probes run on the whole batch.
    rows = sorted({0, 1, n - 2, n - 1})
    with torch.random.fork_rng(devices=_rng_devices()), engine.no_capture():
        try:
            _check(model, units, *_rows(args, kwargs, n, rows, root), rows, seed, root)
        except PrivacyError:
            raise
        except Exception:  # noqa: BLE001 - any failure of the cut batch: probe the whole batch instead
            _check(model, units, args, kwargs, list(range(n)), seed, root)


def _check(model: nn.Module, units: list, args: tuple, kwargs: dict, rows: list[int], seed: int,
           root: int = 0) -> None:
    """Both probes on a batch whose examples are ``rows`` of the whole batch (for the messages), in
    dimension ``root`` of the model's inputs and outputs."""
    _check_forward(model, units, args, kwargs, rows, seed, root)
    _check_gradients(model, units, args, kwargs, rows, seed, root)


def _check_forward(model: nn.Module, units: list, args: tuple, kwargs: dict, rows: list[int],
                   seed: int, root: int = 0) -> None:
    """Changing the first (then the last) example must leave every other example's activations at every
    trainable unit unchanged."""
    n = len(rows)
    with torch.no_grad():
        base: dict[str, list] = {}
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.dim() > root and t.shape[root] == n}
        _forward(model, units, args, kwargs, seed, _record_fingerprints(base, n, inputs))
        for k in (0, n - 1):
            _forward(model, units, *_perturbed(args, kwargs, n, k, root), seed,
                     _compare(base, n, k, rows[k]))


def _check_gradients(model: nn.Module, units: list, args: tuple, kwargs: dict, rows: list[int],
                     seed: int, root: int = 0) -> None:
    """With the loss weight of the first (then the last) example at zero, every output gradient of that
    example at every trainable unit must be zero. ``rows`` are the examples' places in the whole batch
    (for the message). Gradients are checked by hooks as the backward computes them and dropped; the
    hooks hold no activation."""
    n = len(rows)
    probes = (0, n - 1)
    probe = _Probe(rows=rows)
    handles: list = []
    try:
        output = _forward(model, units, args, kwargs, seed, _hook_gradients(probe, handles))
        batched, dim = _batched_outputs(output, n, root)
        params = [p for u in units for p in u.direct.values() if p.requires_grad]
        if not handles or not batched:
            return
        for k in probes:
            weights = [_pattern(t) for t in batched]  # the loss Σ w·output, example k weighted 0
            for w in weights:
                w.movedim(dim, 0)[k] = 0
            probe.example = k
            torch.autograd.grad(batched, params, grad_outputs=weights, allow_unused=True,
                                retain_graph=k != probes[-1])  # returned, dropped: never in .grad
    finally:
        for handle in handles:
            handle.remove()


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
    """The example whose loss weight is zero in the current gradient probe, and the places in the whole
    batch of the examples probed."""

    rows: list[int]
    example: int = 0


def _hook_gradients(probe: _Probe, handles: list) -> Visit:
    """A visit that hooks every per-example unit tensor on the gradient path with a check of its
    gradient."""
    def visit(unit, seen: list[_Seen]) -> None:
        handles.extend(s.tensor.register_hook(_zero_at(probe, s, unit.name)) for s in seen
                       if s.tensor.requires_grad and s.axis is not None
                       and s.axis.examples(s.tensor) == len(probe.rows))
    return visit


def _zero_at(probe: _Probe, seen: _Seen, name: str) -> Callable[[torch.Tensor], None]:
    """A gradient hook refusing any nonzero gradient at the probed example of unit ``name``'s tensor."""
    what, shape, axis = seen.what, tuple(seen.tensor.shape), seen.axis

    def check(grad: torch.Tensor) -> None:
        k = probe.example
        if axis.batch_first(grad)[k].abs().sum() != 0:
            raise PrivacyError(f"module {name!r} mixes examples in its backward: example {probe.rows[k]} has "
                               f"zero loss weight but nonzero gradients at its {what} (shape {shape}, read "
                               f"with its examples in {axis.describe()}). {_FIX}")
    return check
