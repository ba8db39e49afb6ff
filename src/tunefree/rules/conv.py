"""``nn.Conv1d/2d/3d`` with any stride, padding (numbers, ``"same"``, ``"valid"``, any padding mode),
dilation and groups.

Per-sample norms come from the unfolded input patches (ghost or materialised per channel group); the
weighted sum uses the native convolution weight-gradient kernel on the padded input, so a layer kept until
the end of the backward pass holds only its input and output gradient, as autograd would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Capture, LayerRule, Materialized, PerSampleGrad
from .factored import FactoredGrad


def explicit_padding(module: nn.modules.conv._ConvNd) -> list[tuple[int, int]]:
    """(left, right) padding per spatial dimension, resolving ``"same"`` and ``"valid"``."""
    dims = len(module.kernel_size)
    if module.padding == "valid":
        return [(0, 0)] * dims
    if module.padding == "same":
        pads = []
        for k, d in zip(module.kernel_size, module.dilation):
            total = d * (k - 1)
            pads.append((total // 2, total - total // 2))
        return pads
    return [(p, p) for p in module.padding]


def pad_input(module: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    """The input as the convolution sees it after padding (any padding mode)."""
    pads = explicit_padding(module)
    flat = [p for pair in reversed(pads) for p in pair]  # F.pad wants the last dimension first
    if not any(flat):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, flat, mode=mode)


def unfold(x: torch.Tensor, kernel: tuple[int, ...], stride: tuple[int, ...],
           dilation: tuple[int, ...]) -> torch.Tensor:
    """Patches of a padded ``[B, C, *spatial]`` input: ``[B, L, C·∏k]``, channel-major like the weight."""
    dims = len(kernel)
    for i, (k, s, d) in enumerate(zip(kernel, stride, dilation)):
        x = x.unfold(2 + i, d * (k - 1) + 1, s)[..., ::d]
    batch, channels = x.shape[:2]
    positions = x.shape[2:2 + dims]
    # [B, C, L1..LD, k1..kD] -> [B, L1..LD, C, k1..kD]
    order = [0, *range(2, 2 + dims), 1, *range(2 + dims, 2 + 2 * dims)]
    x = x.permute(order)
    return x.reshape(batch, int(torch.tensor(positions).prod()), -1)


class ConvWeightGrad(FactoredGrad):
    """Conv weight gradients; kept for later as (padded input, output gradient) only."""

    def __init__(self, module: nn.modules.conv._ConvNd, padded: torch.Tensor, grad: torch.Tensor):
        groups = module.groups
        batch = grad.shape[0]
        patches = unfold(padded, module.kernel_size, module.stride, module.dilation)
        positions = patches.shape[1]
        a = patches.reshape(batch, positions, groups, -1).transpose(1, 2)
        b = grad.reshape(batch, groups, grad.shape[1] // groups, positions).transpose(-1, -2)
        super().__init__(a, b, module.weight.shape)
        self.module, self.padded, self.grad = module, padded, grad

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        if self._grads is not None:
            return super().weighted_sum(weights)
        module = self.module
        dims = len(module.kernel_size)
        scaled = self.grad * weights.to(self.grad.dtype).reshape(-1, *[1] * (dims + 1))
        weight = module.weight.detach().to(self.grad.dtype)
        return torch.ops.aten.convolution_backward(
            scaled, self.padded.to(self.grad.dtype), weight, None, module.stride, [0] * dims,
            module.dilation, False, [0] * dims, module.groups, [False, True, False],
        )[1]

    def compact(self) -> None:
        if self._grads is not None and self._grads.numel() <= self.padded.numel() + self.grad.numel():
            self.padded = self.grad = None  # type: ignore[assignment]
        else:
            self._grads = None
        self.a = self.b = None  # type: ignore[assignment]


class ConvRule(LayerRule):
    module_types = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

    def per_sample_grads(
        self, module: nn.Module, capture: Capture, grad_outputs: list[torch.Tensor | None],
        params: dict[str, nn.Parameter],
    ) -> dict[str, PerSampleGrad]:
        x, grad = capture.args[0], grad_outputs[0]
        dims = len(module.kernel_size)
        if x.dim() != dims + 2:
            raise ValueError(
                f"{type(module).__name__} got an input of rank {x.dim()}; tunefree needs a batch "
                f"dimension: [batch, channels, {dims} spatial dims]"
            )
        out: dict[str, PerSampleGrad] = {}
        if "weight" in params:
            out["weight"] = ConvWeightGrad(module, pad_input(module, x), grad)
        if "bias" in params:
            out["bias"] = Materialized(grad.sum(tuple(range(2, dims + 2))))
        return out
