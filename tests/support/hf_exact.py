"""Exactness harness for Hugging Face models: the engine's per-example norms and clipped sums against a
batch-size-1 autograd loop, with keyword inputs and a per-example loss function."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from support import pop_step
from support.brute_force import clipped_sum
from tunefree import verify_example_independence
from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.persample.engine import ClippingEngine

# loss_fn(model, batch) -> one loss per example, shape [n]
LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]


def per_example_grads(model: nn.Module, loss_fn: LossFn, batch: dict[str, torch.Tensor]):
    """Each example's own gradient, from autograd on that example alone (batch size 1)."""
    params = [p for p in model.parameters() if p.requires_grad]
    n = next(iter(batch.values())).shape[0]
    out = []
    for i in range(n):
        example = {key: value[i:i + 1] for key, value in batch.items()}
        grads = torch.autograd.grad(loss_fn(model, example).sum(), params, allow_unused=True)
        out.append({p: torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)})
    return out


def assert_exact(model: nn.Module, loss_fn: LossFn, batch: dict[str, torch.Tensor],
                 grouping: str = "all-layer", clip: str = "auto-s") -> ClippingEngine:
    """The engine's per-example group norms and clipped sums equal brute force (float64, 1e-6), the
    example-independence check passes, and no ordinary gradient is written. Returns the engine's sums."""
    model = model.double().train()
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    reference = copy.deepcopy(model)
    clip_fn = clip_function(clip)
    engine = ClippingEngine(model, make_groups(model, grouping, 1.0), clip_fn, loss_reduction="sum")
    loss_fn(model, batch).sum().backward()
    sums, examples, norms = pop_step(engine)
    verify_example_independence(model, engine, (), batch)
    engine.detach()

    n = next(iter(batch.values())).shape[0]
    assert examples == n
    ref_groups = make_groups(reference, grouping, 1.0)
    expected, expected_norms = clipped_sum(per_example_grads(reference, loss_fn, batch), ref_groups, clip_fn)
    for group, ref_group in zip(engine.groups, ref_groups, strict=True):
        if group.name in norms:
            torch.testing.assert_close(norms[group.name], expected_norms[ref_group.name],
                                       rtol=1e-6, atol=1e-9)
        else:  # a group no example's loss reached: its per-example gradients are all zero
            assert not expected_norms[ref_group.name].any(), group.name
        for p, ref_p, name in zip(group.params, ref_group.params, group.param_names, strict=True):
            got = sums.get(p, torch.zeros_like(p))
            torch.testing.assert_close(got, expected[ref_p], rtol=1e-6, atol=1e-9,
                                       msg=lambda m, name=name: f"{name}: {m}")
    assert all(p.grad is None for p in model.parameters()), "autograd must not write ordinary gradients"
    return sums
