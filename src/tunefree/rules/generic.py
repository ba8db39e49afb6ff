"""The fallback for any module that owns trainable parameters no rule covers.

Per-sample gradients come from ``torch.func``: the module's own forward is re-run on each example (vmap)
with all trainable parameters of its sub-tree as the variables, and the vector-Jacobian product with that
example's output gradient is taken. Only inputs derived from the batch (``Capture.from_batch``) with one row
per example in dimension 0 are cut into examples; every other input (a shared positional table, a causal
mask) is passed whole to every example, whatever its number of rows. Each example's output must then have
the shape of its output gradient, or the call is refused. The forward must be deterministic (no dropout
inside).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import PrivacyError
from .base import Capture, Materialized, PerSampleGrad


def _per_example(value: Any, from_batch: bool, batch: int) -> bool:
    return from_batch and isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch


def fallback_per_sample_grads(
    module: nn.Module, capture: Capture, grad_outputs: list[torch.Tensor | None],
    params: dict[str, nn.Parameter],
) -> dict[str, PerSampleGrad]:
    """Per-sample gradients of ``params`` (qualified names inside ``module``) for one call."""
    batch = next(g.shape[0] for g in grad_outputs if g is not None)
    inputs = (capture.args, capture.kwargs)
    leaves, spec = tree_flatten(inputs)
    from_batch = capture.from_batch or (False,) * len(leaves)
    batched_mask = [_per_example(leaf, flag, batch) for leaf, flag in zip(leaves, from_batch)]
    batched = [leaf for leaf, is_b in zip(leaves, batched_mask) if is_b]
    buffers = dict(module.named_buffers())
    detached = {name: p.detach() for name, p in params.items()}

    def example_objective(variables, example_inputs, example_grads):
        it = iter(example_inputs)
        rebuilt = [next(it).unsqueeze(0) if is_b else leaf
                   for leaf, is_b in zip(leaves, batched_mask)]
        args, kwargs = tree_unflatten(rebuilt, spec)
        output = functional_call(module, (variables, buffers), args, kwargs)
        outs = [o for o in tree_flatten(output)[0]
                if isinstance(o, torch.Tensor) and o.is_floating_point()]
        used = [out for out, g in zip(outs, grad_outputs) if g is not None]
        for out, g in zip(used, example_grads):
            if out.shape != (1, *g.shape):
                raise PrivacyError(_shape_mismatch(module, leaves, batched_mask, out, g))
        return sum((out * g.unsqueeze(0)).sum() for out, g in zip(used, example_grads))

    grads_in = [g.detach() for g in grad_outputs if g is not None]
    try:
        per_sample = vmap(grad(example_objective), in_dims=(None, 0, 0), randomness="error")(
            detached, batched, grads_in
        )
    except PrivacyError:
        raise
    except RuntimeError as error:
        raise RuntimeError(
            f"tunefree's generic per-sample fallback could not differentiate "
            f"{type(module).__name__} one example at a time: {error}. The fallback needs a "
            "deterministic forward (no dropout inside the module) whose tensor inputs carry the batch "
            "in dimension 0; otherwise write a layer rule for this module."
        ) from error
    return {name: Materialized(g) for name, g in per_sample.items()}



def _shape_mismatch(module: nn.Module, leaves: list[Any], batched_mask: list[bool],
                    out: torch.Tensor, grad: torch.Tensor) -> str:
    whole = [tuple(leaf.shape) for leaf, is_b in zip(leaves, batched_mask)
             if isinstance(leaf, torch.Tensor) and not is_b]
    return (
        f"the per-example fallback for {type(module).__name__} computed an output of shape "
        f"{tuple(out.shape)} for one example, but its output gradient has shape {(1, *grad.shape)}: an "
        f"input of the call does not carry one row per example in dimension 0 (inputs passed whole to "
        f"every example, as not derived from the batch: {whole}). Pass the module batch-first tensors "
        "derived from the batch (computed from the model's inputs or earlier layers, not created anew), "
        "or write a layer rule for it"
    )
