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
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..errors import PrivacyError

_FIX = ("Keep the example dimension first (batch_first=True), use no batch statistics (e.g. h - h.mean(0), "
        "BatchNorm), and no custom autograd.Function or hook that mixes examples.")


def _floats(value: object) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _pattern(like: torch.Tensor) -> torch.Tensor:
    """A fixed, non-uniform tensor shaped like ``like``: the check's probe values (not noise)."""
    index = torch.arange(like.numel(), device=like.device, dtype=like.dtype)
    return torch.cos(index * 0.7 + 0.3).reshape(like.shape)


def _rows(args: tuple, kwargs: dict, n: int, rows: list[int]) -> tuple[tuple, dict]:
    """The batch cut down to examples ``rows`` (every tensor input with ``n`` in dimension 0)."""
    index = torch.tensor(rows)

    def cut(t: object) -> object:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n:
            return t
        return t[index.to(t.device)]
    return tuple(cut(a) for a in args), {key: cut(v) for key, v in kwargs.items()}


def _perturbed(args: tuple, kwargs: dict, n: int, k: int) -> tuple[tuple, dict]:
    """Change example ``k`` of every batched tensor input: floats get noise, integers another row."""
    def change(t: object) -> object:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n:
            return t
        t = t.detach().clone()
        if t.is_floating_point():
            t[k] += _pattern(t[k]) + 1.0
        else:
            t[k] = t[(k + 1) % n]
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


def _compare(base: dict[str, list], n: int, k: int, label: int) -> Visit:
    """A visit that checks each call against the same call of ``base`` as it happens: only example
    ``k`` may differ."""
    calls: dict[str, int] = {}

    def visit(name: str, tensors: list[torch.Tensor], dims: tuple[int, ...]) -> None:
        index = calls[name] = calls.get(name, -1) + 1
        same = index < len(base.get(name, [])) and len(tensors) == len(base[name][index]) and all(
            _unchanged_elsewhere(a, _fingerprint(t, d, n), k)
            for a, t, d in zip(base[name][index], tensors, dims))
        if not same:
            raise PrivacyError(f"module {name!r} mixes examples in its forward: changing example {label} "
                               f"changed another example's activations. {_FIX}")
    return visit


_CHUNK = 1 << 20  # elements multiplied at once by a fingerprint


@dataclass(frozen=True)
class _Fingerprint:
    """What the forward checks keep of one tensor instead of the tensor: its shape and a projection of
    each example's values (of the whole tensor if it has no example dimension) on a fixed pattern,
    accumulated in float64. A deterministic forward reproduces it bit for bit; a changed row changes its
    projection (a change cancelling exactly against the pattern is a measure-zero coincidence)."""

    shape: tuple[int, ...]
    batched: bool
    rows: torch.Tensor


def _fingerprint(t: torch.Tensor, dim: int, n: int) -> _Fingerprint:
    batched = t.dim() > dim and t.shape[dim] == n
    flat = t.detach().movedim(dim, 0).flatten(1) if batched else t.detach().reshape(1, -1)
    pattern = _pattern(flat[0]) + 2.0  # nowhere near zero
    rows = max(1, _CHUNK // max(1, flat.shape[1]))  # a few rows at a time: no copy of the whole tensor
    projection = torch.cat([(flat[i:i + rows] * pattern).sum(1, dtype=torch.float64)
                            for i in range(0, flat.shape[0], rows)])
    return _Fingerprint(tuple(t.shape), batched, projection)


def _unchanged_elsewhere(a: _Fingerprint, b: _Fingerprint, k: int) -> bool:
    """Whether changing example k left the other examples as they were. A tensor without the batch in
    its example dimension (a shared table, a mask) must not change at all."""
    if a.shape != b.shape or a.batched != b.batched:
        return False
    if not a.batched:
        return torch.equal(a.rows, b.rows)
    keep = torch.ones(a.rows.numel(), dtype=torch.bool, device=a.rows.device)
    keep[k] = False
    return torch.equal(a.rows[keep], b.rows[keep])


def _rng_devices() -> list[int]:
    """CUDA devices whose RNG state the check seeds and restores: all of them, once CUDA is initialised."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return list(range(torch.cuda.device_count()))


def verify_example_independence(model: nn.Module, engine, args: tuple, kwargs: dict | None = None,
                                seed: int = 0) -> None:
    """Raise PrivacyError unless example i's activations and output gradients at every trainable unit
    depend on example i alone. ``args``/``kwargs`` are one real batch's root-call inputs, examples in
    dimension 0 (at least 2). Costs three forwards without gradients, one with gradients and two
    backwards, all on four of the batch's examples (the first two and the last two)."""
    kwargs = kwargs or {}
    n = next((t.shape[0] for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim()),
             0)
    if n < 2:
        raise ValueError("verify_example_independence needs a batch of at least 2 examples in dimension 0")
    units = [u for u in engine.units if any(p.requires_grad for p in u.direct.values())]
    # The probes run on the first two and the last two examples: mixing by a batch statistic, a layout
    # that is not batch-first, a custom Function or a hook shows on any two, and a small batch costs
    # little time and memory. An input with n rows that is not batched (a shared [T, T] mask when T == n)
    # is cut too; if the model then fails, the probes run on the whole batch.
    rows = sorted({0, 1, n - 2, n - 1})
    with torch.random.fork_rng(devices=_rng_devices()), engine.no_capture():
        try:
            _check(model, units, *_rows(args, kwargs, n, rows), rows, seed)
        except PrivacyError:
            raise
        except Exception:  # noqa: BLE001 - any failure of the cut batch: probe the whole batch instead
            _check(model, units, args, kwargs, list(range(n)), seed)


def _check(model: nn.Module, units: list, args: tuple, kwargs: dict, rows: list[int], seed: int) -> None:
    """Both probes on a batch whose examples are ``rows`` of the whole batch (for the messages)."""
    _check_forward(model, units, args, kwargs, rows, seed)
    _check_gradients(model, units, args, kwargs, rows, seed)


def _check_forward(model: nn.Module, units: list, args: tuple, kwargs: dict, rows: list[int],
                   seed: int) -> None:
    """Changing the first (then the last) example must leave every other example's activations at every
    trainable unit unchanged."""
    n = len(rows)
    with torch.no_grad():
        base: dict[str, list] = {}
        _forward(model, units, args, kwargs, seed, _record_fingerprints(base, n))
        for k in (0, n - 1):
            _forward(model, units, *_perturbed(args, kwargs, n, k), seed, _compare(base, n, k, rows[k]))


def _check_gradients(model: nn.Module, units: list, args: tuple, kwargs: dict, rows: list[int],
                     seed: int) -> None:
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
        batched = [t for t in _floats(output) if t.dim() and t.shape[0] == n and t.requires_grad]
        params = [p for u in units for p in u.direct.values() if p.requires_grad]
        if not handles or not batched:
            return
        for k in probes:
            weights = [_pattern(t) for t in batched]  # the loss Σ w·output, example k weighted 0
            for w in weights:
                w[k] = 0
            probe.example = k
            torch.autograd.grad(batched, params, grad_outputs=weights, allow_unused=True,
                                retain_graph=k != probes[-1])  # returned, dropped: never in .grad
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class _Probe:
    """The example whose loss weight is zero in the current gradient probe, and the places in the whole
    batch of the examples probed."""

    rows: list[int]
    example: int = 0


def _hook_gradients(probe: _Probe, handles: list) -> Visit:
    """A visit that hooks every unit tensor on the gradient path with a check of its gradient."""
    def visit(name: str, tensors: list[torch.Tensor], dims: tuple[int, ...]) -> None:
        handles.extend(t.register_hook(_zero_at(probe, d, name)) for t, d in zip(tensors, dims)
                       if t.requires_grad)
    return visit


def _zero_at(probe: _Probe, dim: int, name: str) -> Callable[[torch.Tensor], None]:
    """A gradient hook refusing any nonzero gradient at the probed example of unit ``name``'s tensor."""
    def check(grad: torch.Tensor) -> None:
        k = probe.example
        if grad.movedim(dim, 0)[k].abs().sum() != 0:
            raise PrivacyError(f"module {name!r} mixes examples in its backward: example {probe.rows[k]} has "
                               f"zero loss weight but nonzero output gradients. {_FIX}")
    return check
