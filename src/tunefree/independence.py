"""Structural check that each example's captured activations and output gradients depend on it alone.

Per-sample clipping bounds one example's contribution only if nothing mixes examples: a batch statistic,
a time-major layout, a custom ``autograd.Function`` or hook whose backward mixes. The check releases
nothing: it runs inside ``engine.no_capture()``, writes no ``.grad`` and restores the RNG state.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .errors import PrivacyError

_FIX = ("Keep the example dimension first (batch_first=True), use no batch statistics (e.g. h - h.mean(0), "
        "BatchNorm), and no custom autograd.Function or hook that mixes examples.")


def _floats(value: object) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _perturbed(args: tuple, kwargs: dict, n: int) -> tuple[tuple, dict]:
    """Change example 0 of every batched tensor input: floats get noise, integers example 1's row."""
    def change(t: object) -> object:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n:
            return t
        t = t.detach().clone()
        if t.is_floating_point():
            t[0] += torch.randn_like(t[0]) + 1.0
        else:
            t[0] = t[1]
        return t
    return tuple(change(a) for a in args), {k: change(v) for k, v in kwargs.items()}


def _forward(model: nn.Module, units: list, args: tuple, kwargs: dict, seed: int) -> tuple[dict, object]:
    """One forward under a fixed seed; returns {unit name: (outputs, example dims)} and the model output."""
    records: dict[str, tuple[list[torch.Tensor], tuple[int, ...]]] = {}

    def hook_for(unit):
        def hook(module, inputs, output):
            outs = _floats(output)
            rule = unit.rule
            dims = rule.output_batch_dims(module, len(outs)) if rule is not None else (0,) * len(outs)
            records[unit.name] = (_floats(inputs) + outs, (0,) * len(_floats(inputs)) + tuple(dims))
        return hook

    handles = [u.module.register_forward_hook(hook_for(u)) for u in units]
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            output = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return records, output


def _others(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.movedim(dim, 0)[1:]


def verify_example_independence(model: nn.Module, engine, args: tuple, kwargs: dict | None = None,
                                seed: int = 0) -> None:
    """Raise PrivacyError unless example i's activations and output gradients at every trainable unit
    depend on example i alone. ``args``/``kwargs`` are one real batch's root-call inputs, examples in
    dimension 0 (at least 2). Costs two forwards and one backward."""
    kwargs = kwargs or {}
    n = next((t.shape[0] for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim()),
             0)
    if n < 2:
        raise ValueError("verify_example_independence needs a batch of at least 2 examples in dimension 0")
    units = [u for u in engine.units if any(p.requires_grad for p in u.direct.values())]
    with torch.random.fork_rng(devices=[]), engine.no_capture():  # leaves the caller's RNG state as it was
        with torch.no_grad():
            base, _ = _forward(model, units, args, kwargs, seed)
            changed, _ = _forward(model, units, *_perturbed(args, kwargs, n), seed)
        for name, (tensors, dims) in base.items():
            for a, b, d in zip(tensors, changed[name][0], dims, strict=True):
                if a.shape != b.shape or a.dim() <= d or a.shape[d] != n or not torch.equal(
                        _others(a, d), _others(b, d)):
                    raise PrivacyError(f"module {name!r} mixes examples in its forward: changing example 0 "
                                       f"changed another example's activations. {_FIX}")
        records, output = _forward(model, units, args, kwargs, seed)
        outs = [(t, d) for name in records for t, d in zip(*records[name], strict=True) if t.requires_grad]
        batched = [t for t in _floats(output) if t.dim() and t.shape[0] == n]
        loss = sum((t[1:] * torch.randn_like(t[1:])).sum() for t in batched)
        if outs and torch.is_tensor(loss) and loss.requires_grad:
            grads = torch.autograd.grad(loss, [t for t, _ in outs], allow_unused=True)
            for (t, d), g in zip(outs, grads, strict=True):
                if g is not None and g.movedim(d, 0)[0].abs().sum() != 0:
                    name = next(nm for nm in records if any(t is x for x in records[nm][0]))
                    raise PrivacyError(f"module {name!r} mixes examples in its backward: example 0 has zero "
                                       f"loss weight but nonzero output gradients. {_FIX}")
