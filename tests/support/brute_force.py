"""The reference every per-sample quantity is checked against: a batch-size-1 autograd loop."""

from __future__ import annotations

import torch
from torch import nn

from tunefree.clipping.functions import ClipFunction
from tunefree.clipping.groups import ClipGroup


def per_example_grads(model: nn.Module, loss_fn, inputs, targets) -> list[dict[nn.Parameter, torch.Tensor]]:
    """Each example's own gradient, from a plain autograd loop over examples one at a time."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(len(targets)):
        x_i = inputs[i:i + 1] if isinstance(inputs, torch.Tensor) else [t[i:i + 1] for t in inputs]
        x_i = (x_i,) if isinstance(x_i, torch.Tensor) else tuple(x_i)
        loss = loss_fn(model(*x_i), targets[i:i + 1])
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        out.append({p: (torch.zeros_like(p) if g is None else g) for p, g in zip(params, grads)})
    return out


def clipped_sum(per_example, groups: list[ClipGroup], clip: ClipFunction):
    """Σᵢ wᵢ gᵢ per parameter, with each group's weights from the norm of that group's gradient."""
    total = {p: torch.zeros_like(p) for g in groups for p in g.params}
    norms = {g.name: [] for g in groups}
    for grads in per_example:
        for g in groups:
            norm = torch.sqrt(sum((grads[p].double() ** 2).sum() for p in g.params))
            norms[g.name].append(norm)
            w = clip.weights(norm.reshape(1), g.threshold)[0]
            for p in g.params:
                total[p] += w * grads[p]
    return total, {k: torch.stack(v) for k, v in norms.items()}
