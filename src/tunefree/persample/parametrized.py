"""Layers whose weight torch computes from other parameters: refused at ``make_private``, with the reason.

``torch.nn.utils.parametrizations`` (``orthogonal``, ``weight_norm``, ``spectral_norm``, or any
``parametrize.register_parametrization``) replaces a layer's weight by a module that computes it from the
trainable tensors it holds (``parametrizations.weight.original``); the older ``torch.nn.utils.weight_norm``
and ``spectral_norm`` do the same with a forward pre-hook (``weight_g``, ``weight_v``; ``weight_orig``).
The layer's rule differentiates the weight it is given, and the weight is computed from the parameters
alone, with no example's data: each example's gradient would have to be carried back through the
parametrization, which the engine does not do. Without this check such a layer was refused at its first
backward as "a layer called on part of the batch", which is not the cause (issue 29).

The fix is to compute the weight inside a module's own forward from a raw parameter (the generic
fallback then differentiates the module one example at a time, exactly), or to drop the parametrization
and impose the constraint on the released weights after each step, inside ``engine.public_writes()``.
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ..errors import ModelRefused


def check_parametrized(model: nn.Module) -> None:
    """Refuse a module of ``model`` whose trainable weight is computed from other parameters by a torch
    parametrization or a weight-norm/spectral-norm hook."""
    for name, module in model.named_modules():
        for tensor, how in _reparametrized(module):
            raise ModelRefused(
                f"'{name or type(model).__name__}' ({type(module).__name__}) computes its {tensor!r} from "
                f"other trainable parameters through {how}: tunefree differentiates each example's loss "
                "with respect to the weight a layer is given, while this weight is computed from the "
                "parameters alone, with no example's data, and carrying each example's gradient back "
                "through that computation is not supported yet. Compute the weight inside a forward of "
                "your own from a raw parameter (e.g. W = torch.linalg.matrix_exp(A.triu(1) - A.triu(1).T) "
                "for an orthogonal weight, W = g * V / V.norm(dim=1, keepdim=True) for weight norm, then "
                "F.linear(x, W, self.bias)): tunefree's generic fallback then differentiates that module "
                "one example at a time, exactly. Or remove it before make_private "
                f"(torch.nn.utils.parametrize.remove_parametrizations(module, {tensor!r}), or "
                "torch.nn.utils.remove_weight_norm / remove_spectral_norm) and impose the constraint on "
                "the released weights after each optimizer.step() inside `with engine.public_writes():` "
                "(a projection of public weights costs no privacy)")


def _reparametrized(module: nn.Module) -> list[tuple[str, str]]:
    """The module's tensors computed from trainable parameters: (tensor name, how)."""
    found = []
    if parametrize.is_parametrized(module):
        for tensor, chain in module.parametrizations.items():  # type: ignore[union-attr]
            if any(p.requires_grad for p in chain.parameters()):
                kinds = ", ".join(type(step).__name__.lstrip("_") for step in chain)
                found.append((tensor, f"a parametrization ({kinds}; torch.nn.utils.parametrizations)"))
    own = dict(module.named_parameters(recurse=False))
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, (WeightNorm, SpectralNorm)) and any(
                p.requires_grad for n, p in own.items() if n.startswith(hook.name)):
            function = "weight_norm" if isinstance(hook, WeightNorm) else "spectral_norm"
            found.append((hook.name, f"a {type(hook).__name__} hook (torch.nn.utils.{function})"))
    return found
