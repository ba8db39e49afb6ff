"""The fallback for any module that owns trainable parameters no rule covers.

Per-sample gradients come from ``torch.func``: the module's own forward is re-run on each example (vmap)
with all trainable parameters of its sub-tree as the variables, and the vector-Jacobian product with that
example's output gradient is taken. Which inputs carry the examples, and where, is the call's layout: for
``nn.MultiheadAttention`` its contract (query, key and value in dimension 0 or 1 by ``batch_first``, a key
padding mask ``[B, S]``, a 3-D attention mask ``[B·heads, T, S]``, a 2-D one shared), for any other module
the inputs derived from the batch, in the dimension declared for the module (0 by default); every other
input (a shared positional table, a causal mask) is passed whole to every example, whatever its number of
rows. Each example's output must then have the shape of its output gradient, or the call is refused. Where
vmap cannot batch the forward (the fused kernels of ``nn.RNN``/``GRU``/``LSTM`` called inside the module), the
same objective is differentiated one example at a time. The forward must be deterministic (no dropout
inside). Any failure is refused with the layer's name.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import PrivacyError
from .base import Capture, Materialized, PerSampleGrad
from .layout import Axis, CallLayout, Dim, Interleaved


def attention_layout(module: nn.MultiheadAttention, args: tuple, kwargs: dict,
                     num_outputs: int) -> CallLayout | None:
    """``nn.MultiheadAttention``'s layout by its contract; ``None`` for an unbatched call."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    query = bound["query"]
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        return None
    sequence = Dim(0 if module.batch_first else 1)
    attn_mask = bound.get("attn_mask")
    mask_axis = Interleaved(0, module.num_heads) if isinstance(attn_mask, torch.Tensor) \
        and attn_mask.dim() == 3 else None
    by_name = {"query": sequence, "key": sequence, "value": sequence, "key_padding_mask": Dim(0),
               "attn_mask": mask_axis}

    def axis(name: str, value: Any) -> Axis | None:
        return by_name.get(name) if isinstance(value, torch.Tensor) else None
    names = list(inspect.signature(module.forward).parameters)
    tree = (tuple(axis(names[i], a) for i, a in enumerate(args)),
            {key: axis(key, value) for key, value in kwargs.items()})
    inputs = tuple(tree_flatten(tree)[0])
    return CallLayout(inputs, (sequence,) + (Dim(0),) * (num_outputs - 1))  # attention weights: [B, …]


def known_layout(module: nn.Module, args: tuple, kwargs: dict, num_outputs: int) -> CallLayout | None:
    """The layout a module's type fixes, for the modules the fallback knows; ``None`` otherwise."""
    if isinstance(module, nn.MultiheadAttention) and type(module).forward is nn.MultiheadAttention.forward:
        return attention_layout(module, args, kwargs, num_outputs)
    return None


def fallback_per_sample_grads(
    module: nn.Module, name: str, capture: Capture, layout: CallLayout,
    grad_outputs: list[torch.Tensor | None], params: dict[str, nn.Parameter],
) -> dict[str, PerSampleGrad]:
    """Per-sample gradients of ``params`` (qualified names inside ``module``) for one call of layer
    ``name``: the inputs with an axis in ``layout`` are cut per example, the others passed whole;
    output gradients arrive batch-first."""
    leaves, spec = tree_flatten((capture.args, capture.kwargs))
    axes = layout.inputs
    batched = [axis.batch_first(leaf) for leaf, axis in zip(leaves, axes) if axis is not None]
    buffers = dict(module.named_buffers())
    detached = {n: p.detach() for n, p in params.items()}
    used_axes = [axis for axis, g in zip(layout.outputs, grad_outputs) if g is not None]

    def example_objective(variables, example_inputs, example_grads):
        it = iter(example_inputs)
        rebuilt = [leaf if axis is None else axis.one(next(it)) for leaf, axis in zip(leaves, axes)]
        args, kwargs = tree_unflatten(rebuilt, spec)
        output = functional_call(module, (variables, buffers), args, kwargs)
        outs = [o for o in tree_flatten(output)[0]
                if isinstance(o, torch.Tensor) and o.is_floating_point()]
        used = [out for out, g in zip(outs, grad_outputs) if g is not None]
        total = 0
        for out, axis, g in zip(used, used_axes, example_grads):
            out = axis.batch_first(out)
            if out.shape != (1, *g.shape):
                raise PrivacyError(_shape_mismatch(name, module, leaves, axes, out, g))
            total = total + (out * g.unsqueeze(0)).sum()
        return total

    grads_in = [g.detach() for g in grad_outputs if g is not None]
    # The re-run differentiates only ``params``: the other parameters of the sub-tree (of layers that ran
    # in the call, which their rules answer for) are constants in it, as the fused kernels of some layers
    # (nn.LSTM) cannot batch their weight gradients under vmap.
    variables = set(params.values())
    constants = [p for p in module.parameters() if p.requires_grad and p not in variables]
    try:
        for p in constants:
            p.requires_grad_(False)
        try:
            per_sample = vmap(grad(example_objective), in_dims=(None, 0, 0), randomness="error")(
                detached, batched, grads_in)
        except PrivacyError:
            raise
        except Exception as error:  # noqa: BLE001 - e.g. a fused kernel without a batching rule
            if "random" in str(error):
                raise
            per_sample = _one_at_a_time(example_objective, detached, batched, grads_in)
    except PrivacyError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure of the re-run is refused, with its cause kept
        raise PrivacyError(_failure(name, module, leaves, axes, error)) from error
    finally:
        for p in constants:
            p.requires_grad_(True)
    return {n: Materialized(g) for n, g in per_sample.items()}


class _NoRandomness(TorchDispatchMode):
    """Refuses any operation that draws random numbers (dropout): a re-run would draw other ones."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise RuntimeError(f"the forward calls {func}, which draws random numbers")
        return func(*args, **(kwargs or {}))


def _one_at_a_time(objective, variables: dict[str, torch.Tensor], batched: list[torch.Tensor],
                   grads: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-example gradients by a plain autograd loop, one example at a time, where vmap cannot
    batch the forward (the fused kernels of nn.RNN/GRU/LSTM): the same objective, the same values."""
    rows: list[dict[str, torch.Tensor]] = []
    examples = grads[0].shape[0]
    with _NoRandomness():
        for b in range(examples):
            leaves = {n: v.clone().requires_grad_(True) for n, v in variables.items()}
            total = objective(leaves, [x[b] for x in batched], [g[b] for g in grads])
            found = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
            rows.append({n: torch.zeros_like(v) if g is None else g
                         for (n, v), g in zip(leaves.items(), found)})
    return {n: torch.stack([row[n] for row in rows]) for n in variables}


def _inputs_described(leaves: list[Any], axes: tuple[Axis | None, ...]) -> str:
    cut = [f"{tuple(x.shape)} along {a.describe()}" for x, a in zip(leaves, axes) if a is not None]
    whole = [str(tuple(x.shape)) for x, a in zip(leaves, axes) if a is None and isinstance(x, torch.Tensor)]
    return (f"inputs cut per example: {', '.join(cut) or 'none'}; inputs passed whole to every example: "
            f"{', '.join(whole) or 'none'}")


def _failure(name: str, module: nn.Module, leaves: list[Any], axes: tuple[Axis | None, ...],
             error: Exception) -> str:
    if "random" in str(error):
        cause = ("its forward draws random numbers (dropout inside the module), which cannot be replayed "
                 "one example at a time: move the dropout out of this module (into a module without "
                 "parameters of its own) or set its probability to 0")
    else:
        cause = ("its forward must run on a batch of one example: a tensor it expects to have one row per "
                 "example must be computed from the model's inputs (not created anew, e.g. by torch.ones "
                 "or from a shape) and carry the examples in the dimension declared for this module (0 by "
                 "default; make_private(..., batch_dim={...}) declares another), or the module's "
                 "parameters must sit in layers tunefree has rules for (nn.Linear, nn.Embedding, …)")
    return (f"layer '{name}' ({type(module).__name__}) has no layer rule, and tunefree's generic fallback "
            f"could not compute its per-example gradients by re-running it one example at a time "
            f"(torch.func.vmap): {type(error).__name__}: {error}. {_inputs_described(leaves, axes)}. "
            f"Probable cause and fix: {cause}")


def _shape_mismatch(name: str, module: nn.Module, leaves: list[Any], axes: tuple[Axis | None, ...],
                    out: torch.Tensor, grad: torch.Tensor) -> str:
    return (
        f"the per-example fallback for layer '{name}' of type {type(module).__name__} computed an output of "
        f"shape {tuple(out.shape)} for one example, but its output gradient has shape {(1, *grad.shape)}: "
        f"an input of the call does not carry one row per example ({_inputs_described(leaves, axes)}). "
        "Pass the module tensors derived from the batch (computed from the model's inputs or earlier "
        "layers, not created anew), with the examples in the dimension declared for it (0 by default; "
        "make_private(..., batch_dim={...}) declares another), or write a layer rule for it"
    )
