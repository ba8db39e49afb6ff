"""Affine parameters of normalisation layers that normalise each example on its own:
``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm`` and ``nn.InstanceNorm*``.

Each layer computes ``y = x̂·γ + β`` with ``x̂`` depending on one example only, so
``∂L/∂γ = Σ (∂L/∂y)·x̂`` over the positions of that example. The per-sample gradients are small (one value
per channel) and are materialised. BatchNorm mixes examples and is refused elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..dtypes import as_norm_precision
from ..errors import ModelRefused
from .base import Capture, LayerRule, Materialized, PerSampleGrad


def _affine_grads(
    normalized: torch.Tensor, grad: torch.Tensor, reduce_dims: tuple[int, ...],
    params: dict[str, nn.Parameter],
) -> dict[str, PerSampleGrad]:
    grad = as_norm_precision(grad)
    out: dict[str, PerSampleGrad] = {}
    if "weight" in params:
        out["weight"] = Materialized((grad * normalized).sum(reduce_dims) if reduce_dims
                                     else grad * normalized)
    if "bias" in params:
        out["bias"] = Materialized(grad.sum(reduce_dims) if reduce_dims else grad)
    return out


class NormRule(LayerRule):
    """Norm layers convert their output gradient to float32 first (``_affine_grads``)."""

    takes_16_bit_grads = True


class LayerNormRule(NormRule):
    """Each token normalised over its last dimensions (``normalize``: ``F.layer_norm``)."""

    module_types: tuple[type[nn.Module], ...] = (nn.LayerNorm,)
    reads_parameters = False
    takes_declared_dim = True
    normalize = staticmethod(F.layer_norm)

    def per_sample_grads(self, module, capture: Capture, grad_outputs, params):
        x = as_norm_precision(capture.args[0])
        normalized = self.normalize(x, module.normalized_shape, eps=module.eps)
        reduce_dims = tuple(range(1, x.dim() - len(module.normalized_shape)))
        return _affine_grads(normalized, grad_outputs[0], reduce_dims, params)


class RMSNormRule(LayerNormRule):
    """The same over ``F.rms_norm``; a weight and no bias."""

    module_types = (nn.RMSNorm,)
    param_names = ("weight",)
    normalize = staticmethod(F.rms_norm)


class GroupNormRule(NormRule):
    module_types = (nn.GroupNorm,)
    reads_parameters = False

    def per_sample_grads(self, module, capture: Capture, grad_outputs, params):
        x = as_norm_precision(capture.args[0])
        normalized = F.group_norm(x, module.num_groups, eps=module.eps)
        return _affine_grads(normalized, grad_outputs[0], tuple(range(2, x.dim())), params)


class InstanceNormRule(NormRule):
    module_types = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
    reads_parameters = False

    def check(self, module: nn.Module, name: str) -> None:
        if module.track_running_stats:
            raise ModelRefused(
                f"'{name}' ({type(module).__name__}) has track_running_stats=True: its running "
                "statistics average over examples and would leak them unaccounted; set "
                "track_running_stats=False"
            )

    def per_sample_grads(self, module, capture: Capture, grad_outputs, params):
        x = as_norm_precision(capture.args[0])
        if x.dim() != module._get_no_batch_dim() + 1:
            raise ValueError(f"{type(module).__name__} got an input without a batch dimension")
        normalized = F.instance_norm(x, eps=module.eps)
        return _affine_grads(normalized, grad_outputs[0], tuple(range(2, x.dim())), params)


