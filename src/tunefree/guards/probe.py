"""Probe passes: the model run forward and backward on a batch, every trainable unit's tensors fingerprinted.

The example-independence check and the state check watch what the model *does*. Both run the model in
train mode with gradients on, the engine not capturing (``engine.no_capture()``), under a fixed seed, and
record a :class:`Tape`: for every call of every trainable unit, a fingerprint of each float input and
output (per example, where the call's layout puts the examples), of the model's outputs, and of the
gradient each per-example unit tensor receives in each backward pass taken from a fixed loss
``Σ w·output`` (weights: a pattern times a factor per example, :func:`loss_weights`). The backward is
taken with respect to an anchor alone: it runs through every unit's output and what follows, forms no
parameter gradient and writes no ``.grad``. Nothing is released.

Comparisons read the host once (:class:`Flags`; several at once, :func:`failures`): each compares tensors
on the device and adds one flag; only a failure is then located and described.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from ..errors import PrivacyError
from ..rules.layout import Axis, Dim, Structure


def floats(value: object) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


# ------------------------------------------------------------------------------------------- patterns
def pattern(like: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """A fixed, non-uniform tensor shaped like ``like``, cos(0.7·k + 0.3) + ``offset`` at flat index k: the
    probes' values (not noise)."""
    return _pattern_values(like.numel(), like.dtype, like.device, offset).reshape(like.shape)


def row_pattern(row: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """``pattern(row, offset)`` for one example's row of a model's tensor, read only: kept for the next
    checks (a model's rows keep their sizes) up to ``_KEPT_PATTERN`` elements."""
    if row.numel() > _KEPT_PATTERN:
        return pattern(row, offset)
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


# --------------------------------------------------------------------------------------- fingerprints
_CHUNK = 1 << 20  # elements converted or multiplied at once by a fingerprint
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # an integer type of each float's size


@dataclass(frozen=True)
class Fingerprint:
    """What a probe keeps of one tensor instead of the tensor: its shape and, for each example (for the
    whole tensor if it has no example axis), a projection of its values on a fixed pattern and the
    wrapping integer sum of their bit patterns. A deterministic pass reproduces both bit for bit; a
    changed value always changes the checksum (several changes could cancel modulo 2^32, 2^64 for
    float64, and within the projection's rounding at once: a coincidence, not a pattern of code). The
    projection of a tensor multiplied by a power of two is the projection multiplied by it, exactly.
    With ``magnitude`` (kept after a call with example structure, where rounding may be tolerated) the
    projection is accumulated in float64, with each row's |values| on |pattern|, and no checksum.
    ``other_dims``: for a tensor with its examples along a dimension, the fingerprints along its other
    dimensions of the batch's size, which say where a change went when it is not where the layout says."""

    shape: tuple[int, ...]
    batched: bool
    rows: torch.Tensor
    magnitude: torch.Tensor | None  # each row's |values| on |pattern|: the scale of its rounding (if kept)
    eps: float  # the tensor's machine epsilon
    other_dims: dict[int, Fingerprint] = field(default_factory=dict)
    checksums: torch.Tensor | None = None


def fingerprint(t: torch.Tensor, axis: Axis | None, n: int, others: bool = True,
                magnitude: bool = False) -> Fingerprint:
    t = t.detach()
    batched = axis is not None and axis.examples(t) == n
    rows = axis.batch_first(t) if batched else t.reshape(1, -1)
    other_dims = {}
    if others and isinstance(axis, Dim):
        other_dims = {dim: fingerprint(t, Dim(dim), n, others=False)
                      for dim in range(t.dim()) if dim != axis.dim and t.shape[dim] == n}
    # Packed sequences and bags are padded to the longest example, which a changed example may change.
    shape = (n,) if batched and not isinstance(axis, Dim) else tuple(t.shape)
    flat = rows.reshape(rows.shape[0], -1)
    eps = torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0
    if magnitude:
        return Fingerprint(shape, batched, _projection(flat), _projection(flat, absolute=True), eps,
                           other_dims)
    return Fingerprint(shape, batched, _fast_projection(flat), None, eps, other_dims, _checksums(flat))


def _projection(flat: torch.Tensor, absolute: bool = False) -> torch.Tensor:
    """Each row of ``flat`` projected on a fixed pattern (``absolute``: |row| on |pattern|), in float64."""
    weights = row_pattern(flat[0], 2.0)  # nowhere near zero, and positive
    rows = max(1, _CHUNK // max(1, flat.shape[1]))  # a few rows at a time: no copy of the whole tensor
    return torch.cat([((flat[i:i + rows].abs() if absolute else flat[i:i + rows]) * weights)
                      .sum(1, dtype=torch.float64) for i in range(0, flat.shape[0], rows)])


def _fast_projection(flat: torch.Tensor) -> torch.Tensor:
    """Each row of ``flat`` projected on the pattern: one matrix-vector product, in float32 (float64 for
    float64 tensors)."""
    dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
    weights = row_pattern(flat[0].to(dtype), 2.0)
    if flat.dtype == dtype:
        return flat @ weights
    rows = max(1, _CHUNK // max(1, flat.shape[1]))  # a few rows converted at a time
    return torch.cat([flat[i:i + rows].to(dtype) @ weights for i in range(0, flat.shape[0], rows)])


def _checksums(flat: torch.Tensor) -> torch.Tensor:
    """Each row's wrapping sum of its values' bit patterns (integer addition: the same in any order)."""
    bits = flat.contiguous().view(_BITS[flat.element_size()])
    return bits.sum(1, dtype=torch.int64 if bits.dtype == torch.int64 else torch.int32)


# When a call's structure changes (one example's length moves a PackedSequence's batch sizes), kernels
# group the other examples differently and may round their values differently: only a change beyond this
# many units of rounding (relative to each row's magnitude) counts then.
REGROUPED_ROUNDING = 256


def changed_rows(a: Fingerprint, b: Fingerprint, regrouped: bool = False) -> torch.Tensor | None:
    """On the device, which rows of ``b`` differ from ``a`` (bit for bit; within rounding once the
    examples' grouping changed, ``regrouped``); ``None`` when the two cannot be compared row by row (other
    shapes, or one is per example and the other not): everything changed."""
    if a.shape != b.shape or a.batched != b.batched:
        return None
    if regrouped and a.magnitude is not None and b.magnitude is not None:
        bound = REGROUPED_ROUNDING * a.eps * torch.maximum(a.magnitude, b.magnitude)
        return (a.rows - b.rows).abs() > bound
    changed = a.rows != b.rows
    if a.checksums is not None and b.checksums is not None:
        changed |= a.checksums != b.checksums
    return changed


def unchanged_elsewhere(a: Fingerprint, b: Fingerprint | None, mask: torch.Tensor,
                        regrouped: bool = False) -> bool:
    """Whether only the examples of ``mask`` changed from ``a`` to ``b`` (reads the host: for messages)."""
    changed = None if b is None else changed_rows(a, b, regrouped)
    return changed is not None and not bool(outside(changed, a, mask).any())


def outside(changed: torch.Tensor, a: Fingerprint, mask: torch.Tensor | None) -> torch.Tensor:
    """``changed`` where the rows are outside ``mask``, False inside it (all of them: a tensor without the
    batch on its example axis must not change at all); on the device, no read."""
    if mask is None or not a.batched:
        return changed
    return changed & ~mask.to(changed.device, non_blocking=True)


def code_bits(n: int) -> int:
    """The least m with C(m, ⌊m/2⌋) ≥ n: the masks of a code of n rows."""
    return next(m for m in itertools.count(2) if math.comb(m, m // 2) >= n)


def row_codes(n: int, bits: int | None = None) -> torch.Tensor:
    """[n, m] flags: row i's code, a distinct set of ⌊m/2⌋ of m bits, m = ``bits`` (at least
    :func:`code_bits`). Two distinct codes of one size are never nested, so for any rows i ≠ j some bit is
    i's and not j's: the m masks (columns) hold, for every ordered pair (j, i), one with j and without i.
    A new tensor on the host each time (the codes are kept as numbers)."""
    return torch.tensor(_code_rows(n, bits), dtype=torch.bool)


@functools.lru_cache(maxsize=64)
def _code_rows(n: int, bits: int | None) -> tuple[tuple[bool, ...], ...]:
    m = max(code_bits(n), bits or 0)
    return tuple(tuple(bit in chosen for bit in range(m))
                 for chosen in itertools.islice(itertools.combinations(range(m), m // 2), n))


@functools.lru_cache(maxsize=256)
def partitions(passes: int, blocks: int) -> int:
    """S(passes, blocks): the partitions of ``passes`` passes into ``blocks`` non-empty blocks."""
    if blocks == 0:
        return int(passes == 0)
    if passes == 0 or blocks > passes:
        return 0
    return blocks * partitions(passes - 1, blocks) + partitions(passes - 1, blocks - 1)


def level_design(n: int, passes: int | None = None) -> tuple[int, int]:
    """(k, m) for :func:`row_levels`: the fewest passes k (at least ``passes``), then the fewest levels m
    (at least 2), with S(k, m) ≥ n partitions of the k passes into m blocks."""
    for k in itertools.count(max(2, passes or 0)):
        m = next((m for m in range(2, k + 1) if partitions(k, m) >= n), None)
        if m is not None:
            return k, m


def row_levels(n: int, passes: int | None = None) -> torch.Tensor:
    """[n, k] levels: row i's input in each of k passes (0: as it is, in pass 0 always; v > 0: changed in
    the v-th way), (k, m) from :func:`level_design`. Row i's levels are a distinct partition of the passes
    into m blocks (its restricted growth string). Partitions into one number of blocks never refine each
    other, so for any rows i ≠ j two passes give i one level and j two: comparing row i's outputs between
    passes where its input is the same sees every example j that reaches it. A new tensor on the host each
    time (the levels are kept as numbers)."""
    return torch.tensor(_level_rows(n, passes), dtype=torch.int64)


@functools.lru_cache(maxsize=64)
def _level_rows(n: int, passes: int | None) -> tuple[tuple[int, ...], ...]:
    k, m = level_design(n, passes)
    rows: list[list[int]] = []

    def grow(prefix: list[int], used: int) -> None:
        if len(rows) == n:
            return
        if len(prefix) == k:
            if used == m:
                rows.append(list(prefix))
            return
        for level in range(min(used + 1, m)):
            if m - max(used, level + 1) <= k - len(prefix) - 1:  # enough passes left to use every level
                grow(prefix + [level], max(used, level + 1))
    grow([0], 1)
    return tuple(map(tuple, rows))


def autocast_regions() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast regions active now (device type, dtype): a pass run later replays them."""
    return tuple((device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                 if torch.is_autocast_enabled(device))


@contextmanager
def in_regions(regions: Sequence[tuple[str, torch.dtype]]) -> Iterator[None]:
    """Exactly ``regions`` active (and no other autocast) inside the block."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            dtype = dict(regions).get(device)
            if dtype is not None:
                stack.enter_context(torch.autocast(device_type=device, dtype=dtype))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device_type=device, enabled=False))
        yield


# ------------------------------------------------------------------------------------------ the tape
@dataclass(frozen=True)
class Slot:
    """One float tensor of a unit call, as the checks read it: which input or output it is, its shape and
    its axis (where the call's layout puts its examples; ``None``: not per example, it must not change)."""

    what: str
    shape: tuple[int, ...]
    axis: Axis | None


@dataclass
class Call:
    """What a pass keeps of one unit call: its tensors' fingerprints, its structure tensors (a bag's
    offsets, a PackedSequence's batch sizes: a few integers each), and, for each per-example tensor that
    a gradient reaches, the fingerprint of its gradient in each backward pass, in order."""

    unit: object
    slots: list[Slot]
    values: list[Fingerprint]
    structure: list[torch.Tensor]
    grads: dict[int, list[Fingerprint]] = field(default_factory=dict)


@dataclass
class Tape:
    """A probe pass: each unit's calls in order, the model's float outputs, the batch's examples."""

    calls: dict[str, list[Call]]
    outputs: list[Fingerprint]
    examples: int
    backwards: int = 0

    def all_calls(self) -> list[tuple[str, int, Call]]:
        return [(name, i, call) for name, calls in self.calls.items() for i, call in enumerate(calls)]


def _seen(unit, args: tuple, kwargs: dict, output: object) -> list[tuple[Slot, torch.Tensor]]:
    """A unit call's float inputs and outputs, each with its axis from the call's layout, and its inputs
    that say where the examples are (offsets, batch sizes: axis :class:`Structure`, any dtype)."""
    outs = floats(output)
    layout = unit.layout(args, kwargs, len(outs))
    leaves = tree_flatten((args, kwargs))[0]
    inputs = [(Slot(f"input {i}", tuple(x.shape), a), x)
              for i, (x, a) in enumerate(zip(leaves, layout.inputs))
              if isinstance(x, torch.Tensor) and (x.is_floating_point() or isinstance(a, Structure))]
    return inputs + [(Slot(f"output {i}", tuple(t.shape), a), t)
                     for i, (t, a) in enumerate(zip(outs, layout.outputs))]


def storage(x: torch.Tensor) -> int:
    return x.untyped_storage().data_ptr() if x.layout == torch.strided else id(x)


def _refuse_structure_from_inputs(unit, seen: list[tuple[Slot, torch.Tensor]], model_inputs: set[int]
                                  ) -> None:
    """A tensor saying where the examples are (a bag's offsets, a PackedSequence's batch sizes), taken
    straight from the model's inputs: changing one example's row of the inputs would move the others."""
    for slot, t in seen:
        if isinstance(slot.axis, Structure) and storage(t) in model_inputs:
            raise PrivacyError(
                f"module {unit.name!r} ({type(unit.module).__name__}) takes its {slot.what} (shape "
                f"{slot.shape}), which says where each example's values are ({slot.axis.describe()}), "
                "straight from the model's inputs: tunefree checks example independence by changing one "
                "example's rows of the model's inputs, and cannot tell which of the other inputs' values "
                "belong to that example. Give the model each example's values as one row, padded, with "
                "their lengths (e.g. ids [B, L] and lengths [B]), and build the offsets or the packed "
                "sequence inside forward (nn.EmbeddingBag also takes the padded ids [B, L] directly, "
                "with padding_idx marking the padding)")


def seed_generators(seed: int) -> None:
    """Seed every global generator a model may draw from: torch's CPU generator and, if CUDA is in use,
    every CUDA generator (unlike ``torch.manual_seed``, no seed is queued for a CUDA that the caller has
    not initialised), NumPy's and Python's."""
    torch.default_generator.manual_seed(seed)
    if rng_devices():
        torch.cuda.manual_seed_all(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def rng_devices() -> list[int]:
    """CUDA devices whose RNG state the probes seed and restore: all of them, once CUDA is initialised."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return list(range(torch.cuda.device_count()))


@contextmanager
def preserved_randomness() -> Iterator[None]:
    """The global generators (:func:`seed_generators`) as they were before the block: probe passes seed
    them, and the training loop's draws are the same as if no probe had run."""
    state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=rng_devices()):
            yield
    finally:
        np.random.set_state(state[0])
        random.setstate(state[1])


# How PyTorch's warnings name a kernel that is not deterministic in warn-only mode: the text before these.
_NOT_DETERMINISTIC = (" does not have a deterministic implementation", " defaults to a non-deterministic",
                      "Deterministic behavior was enabled")


def cuda_in_use() -> bool:
    """Whether this process runs CUDA kernels (CUDA initialised)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@contextmanager
def deterministic_kernels(alerts: list[str]) -> Iterator[None]:
    """Probe passes are compared with each other bit for bit, so they run the kernels each device makes
    deterministic: PyTorch's deterministic algorithms (e.g. a sorted ``index_add`` instead of atomic adds on
    a GPU) and cuDNN's deterministic convolutions, neither filling new memory; on CUDA, attention
    (``F.scaled_dot_product_attention``) in its math form, whose backward is deterministic where the
    flash, memory-efficient and cuDNN kernels' are not (unless the caller's setting is strict, which makes
    theirs deterministic). A kernel that has no deterministic implementation (adaptive pooling's backward
    on a GPU, ...) runs as it is (strict mode would raise there): PyTorch's warning about it is not shown
    but kept in ``alerts`` (its name, once) for a refusal to name it as a possible cause
    (:func:`nondeterminism`). Other warnings are shown as Python shows them (once per place: the warnings
    machinery's filters and registries are left alone). The caller's settings return after the block."""
    settings = (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cudnn.deterministic,
                torch.backends.cudnn.benchmark)
    strict = settings[0] and not settings[1]
    attention = contextlib.nullcontext() if strict or not cuda_in_use() else \
        torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH])
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        marker = next((m for m in _NOT_DETERMINISTIC if m in text), None)
        if marker is None:
            return shown(message, category, filename, lineno, file, line)
        kernel = text.split(marker)[0].strip().rstrip(".") or "cuBLAS without CUBLAS_WORKSPACE_CONFIG"
        if kernel not in alerts:
            alerts.append(kernel)
        return None

    with attention:
        try:
            warnings.showwarning = show
            torch.use_deterministic_algorithms(True, warn_only=not strict)
            torch.utils.deterministic.fill_uninitialized_memory = False
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
            yield
        finally:
            warnings.showwarning = shown
            torch.use_deterministic_algorithms(settings[0], warn_only=settings[1])
            (torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark) = settings[2:]


@contextmanager
def probing(engine, alerts: list[str]) -> Iterator[None]:
    """Where probe passes run: the engine not capturing, the global generators as they were before the
    block (:func:`preserved_randomness`), deterministic kernels (:func:`deterministic_kernels`)."""
    with preserved_randomness(), engine.no_capture(), deterministic_kernels(alerts):
        yield


def nondeterminism(alerts: Sequence[str]) -> str:
    """What a refusal adds when the probe passes ran kernels with no deterministic implementation."""
    if not alerts:
        return ""
    return (f". The probe passes ran kernels that have no deterministic implementation on this device "
            f"({', '.join(alerts)}): two passes on the same inputs may then differ in their last bits, "
            "which looks like this. If that is the cause, run the training with "
            "torch.use_deterministic_algorithms(True) (on CUDA with CUBLAS_WORKSPACE_CONFIG=:4096:8 set "
            "before the program starts), which makes SDPA's attention backward deterministic, or replace "
            "the layer that runs such a kernel")


def loss_weights(t: torch.Tensor, dim: int, factors: torch.Tensor) -> torch.Tensor:
    """The probe loss's weights on model output ``t`` (examples in dimension ``dim``): one example's
    pattern times each example's ``factor`` (distinct, so that one example's gradient reaching two others
    cancels between them only by coincidence)."""
    rows = t.detach().movedim(dim, 0)
    scale = factors.to(device=t.device, dtype=rows.dtype, non_blocking=True)
    scale = scale.reshape(-1, *[1] * (rows.dim() - 1))
    return (scale * row_pattern(rows[0])).movedim(0, dim)


def example_factors(n: int) -> torch.Tensor:
    """The probe loss's factor of each example (in [1, 3], distinct; float64 so that multiplying by a
    power of two is exact)."""
    return pattern(torch.empty(n, dtype=torch.float64), 2.0)


def batched_outputs(output: object, n: int, root: int) -> tuple[list[torch.Tensor], int]:
    """The model's outputs that carry the examples, and where: in the dimension declared for its inputs,
    else in dimension 0 (a time-major model that pools over time). Weighting the wrong dimension makes
    the probe refuse, never pass."""
    for dim in dict.fromkeys((root, 0)):
        batched = [t for t in floats(output) if t.dim() > dim and t.shape[dim] == n and t.requires_grad]
        if batched:
            return batched, dim
    return [], root


class Anchors:
    """The leaves a probe's backward is taken to: one zero scalar per device, tied to each unit output (a
    gradient then always reaches the output), on the output's own device, so that no gradient crosses to
    another device (on CUDA, a copy to a CPU anchor would wait for the GPU at every unit)."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def tie(self, t: torch.Tensor) -> torch.Tensor:
        anchor = self._by_device.get(t.device)
        if anchor is None:
            anchor = self._by_device[t.device] = torch.zeros((), device=t.device, requires_grad=True)
        return t + 0 * anchor

    def leaves(self) -> list[torch.Tensor]:
        return list(self._by_device.values())


def record(model: nn.Module, units: Sequence, args: tuple, kwargs: dict, *, examples: int, root: int,
           seed: int, factors: Sequence[torch.Tensor] = (), like: Tape | None = None,
           model_inputs: set[int] | None = None) -> Tape:
    """One pass of ``model`` on ``(args, kwargs)`` (``examples`` in dimension ``root``): a forward under
    ``seed``, then one backward per entry of ``factors`` (each example's loss factor; all from the same
    forward). ``like``: a tape to be compared with this one (each tensor is fingerprinted as there: with
    magnitudes where that one kept them). ``model_inputs``: the storages of the model's per-example
    inputs, from which no structure tensor may be taken (checked once, on the first pass of a check)."""
    n = examples
    tape = Tape({}, [], n)
    anchors = Anchors()
    forward_hooks: list = []
    gradient_hooks: list = []
    structured = [False]  # a call with structure seen: from there on, keep the rows' magnitudes too

    def keep_gradient(call: Call, index: int) -> Callable[[torch.Tensor], None]:
        axis = call.slots[index].axis

        def keep(grad: torch.Tensor) -> None:
            call.grads.setdefault(index, []).append(fingerprint(grad, axis, n, others=False))
        return keep

    def hook_for(unit):
        def hook(module, args, kwargs, output):
            seen = _seen(unit, args, kwargs, output)
            if model_inputs is not None:
                _refuse_structure_from_inputs(unit, seen, model_inputs)
            calls = tape.calls.setdefault(unit.name, [])
            before = like.calls.get(unit.name, []) if like is not None else []
            values = [(s, t) for s, t in seen if not isinstance(s.axis, Structure)]
            structure = [t.detach().clone() for s, t in seen if isinstance(s.axis, Structure)]
            structured[0] |= bool(structure)
            kept = before[len(calls)].values if len(calls) < len(before) else []
            magnitudes = [m.magnitude is not None for m in kept] if len(kept) == len(values) else \
                [structured[0]] * len(values)
            call = Call(unit, [s for s, _ in values],
                        [fingerprint(t, s.axis, n, magnitude=m) for (s, t), m in zip(values, magnitudes)],
                        structure)
            calls.append(call)
            if not factors:
                return None
            pending = {id(t): index for index, (s, t) in enumerate(values)
                       if t.requires_grad and s.axis is not None and s.axis.examples(t) == n}

            def anchored(t: torch.Tensor) -> torch.Tensor:
                if not t.requires_grad:
                    return t
                out = anchors.tie(t)  # hooked here, its gradient is always computed (the path to anchor)
                if id(t) in pending:
                    gradient_hooks.append(out.register_hook(keep_gradient(call, pending.pop(id(t)))))
                return out
            touched = tree_map_only(torch.Tensor, anchored, output)
            for index in pending.values():  # the call's inputs: downstream of earlier units' outputs
                gradient_hooks.append(values[index][1].register_hook(keep_gradient(call, index)))
            return touched
        return hook

    for u in units:
        forward_hooks.append(u.module.register_forward_hook(hook_for(u), with_kwargs=True))
    try:
        seed_generators(seed)
        output = model(*args, **kwargs)
        batched, dim = batched_outputs(output, n, root)
        tape.outputs = [fingerprint(t, Dim(dim), n, others=False) for t in floats(output)]
        if not factors or not batched or not gradient_hooks or not anchors.leaves():
            return tape  # (no output tied to an anchor: no backward reaches a unit)
        for i, factor in enumerate(factors):
            weights = [loss_weights(t, dim, factor) for t in batched]  # the loss Σ w·output
            torch.autograd.grad(batched, anchors.leaves(), grad_outputs=weights, allow_unused=True,
                                retain_graph=i < len(factors) - 1)  # scalars, dropped
            tape.backwards += 1
        return tape
    finally:
        for handle in forward_hooks + gradient_hooks:
            handle.remove()


# ----------------------------------------------------------------------------------- one host read
@dataclass
class Flags:
    """Device-side failure flags of one comparison, each with what it means; read once."""

    flags: list[torch.Tensor] = field(default_factory=list)
    meanings: list[object] = field(default_factory=list)
    certain: object | None = None  # a failure known on the host (a call that is missing or reshaped)

    def add(self, flag: torch.Tensor, meaning: object) -> None:
        self.flags.append(flag.any().reshape(1))
        self.meanings.append(meaning)

    def first(self) -> object | None:
        """The meaning of the first failure (one host read for all flags), or ``None``."""
        return failures([self])[0]


def failures(comparisons: Sequence[Flags]) -> list[object | None]:
    """The first failure of each comparison (its ``certain`` one, else its first failed flag), ``None``
    where none failed: the flags of all of them read at once (one transfer per device)."""
    read = [(k, i, flag) for k, c in enumerate(comparisons) if c.certain is None
            for i, flag in enumerate(c.flags)]
    by_device: dict[torch.device, list[tuple[int, int, torch.Tensor]]] = {}
    for item in read:
        by_device.setdefault(item[2].device, []).append(item)
    failed: dict[int, int] = {}  # comparison: its first failed flag
    for items in by_device.values():
        values = torch.cat([flag for _, _, flag in items]).cpu().tolist()
        for (k, i, _), value in zip(items, values):
            if value:
                failed[k] = min(failed.get(k, i), i)
    return [c.certain if c.certain is not None else c.meanings[failed[k]] if k in failed else None
            for k, c in enumerate(comparisons)]
