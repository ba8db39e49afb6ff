"""``nn.Conv1d/2d/3d`` with any stride, padding (numbers, ``"same"``, ``"valid"``, any padding mode),
dilation and groups.

Per-sample norms come from a ghost norm on unfolded input patches when the layer has few output
positions, otherwise from per-sample gradients computed by the native weight-gradient kernel. The
weighted sum uses the native kernel on the padded input, so a layer kept until the end of the backward
pass holds only its input and output gradient, as autograd would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Capture, LayerRule, Materialized, PerSampleGrad
from .factored import FactoredGrad, ghost_is_cheaper


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


def native_padding(module: nn.modules.conv._ConvNd) -> list[int] | None:
    """The padding to hand the native kernels directly (zero padding, the same on both sides), or
    ``None`` when the input must be padded explicitly first."""
    pads = explicit_padding(module)
    if module.padding_mode == "zeros" and all(left == right for left, right in pads):
        return [left for left, _ in pads]
    return None


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


def per_sample_weight_grads(module: nn.modules.conv._ConvNd, x: torch.Tensor, padding: list[int],
                            grad: torch.Tensor) -> torch.Tensor:
    """All per-sample weight gradients ``[B, *weight.shape]`` with the native weight-gradient kernel:
    the batch becomes channel groups (input ``[1, B·C_in, …]``, ``B·groups`` groups), so each
    example's gradient comes out as its own slice, with no unfolded copy of the input."""
    batch, dims = grad.shape[0], len(module.kernel_size)
    shape = module.weight.shape
    # The kernel reads only the weight's shape when no input gradient is asked for.
    stacked = grad.new_empty(batch * shape[0], *shape[1:])
    grads = torch.ops.aten.convolution_backward(
        grad.reshape(1, -1, *grad.shape[2:]), x.to(grad.dtype).reshape(1, -1, *x.shape[2:]),
        stacked, None, module.stride, padding, module.dilation, False, [0] * dims,
        batch * module.groups, [False, True, False])[1]
    return grads.reshape(batch, *shape)


class ConvWeightGrad(PerSampleGrad):
    """Conv weight gradients of one call. Norms by ghost norm on unfolded patches when that is cheaper
    (few output positions), otherwise from the materialised per-sample gradients; the weighted sum from
    those, or — when only (padded input, output gradient) were kept — with the native kernel."""

    def __init__(self, module: nn.modules.conv._ConvNd, x: torch.Tensor, grad: torch.Tensor):
        padding = native_padding(module)
        # the input as given with the padding for the native kernels, or padded explicitly
        self.x = x if padding is not None else pad_input(module, x)
        self.padding = padding if padding is not None else [0] * len(module.kernel_size)
        self.module, self.grad = module, grad
        self._grads: torch.Tensor | None = None

    def _ghost_is_cheaper(self) -> bool:
        groups = self.module.groups
        positions = self.grad[0, 0].numel()
        d_in = self.module.weight[0].numel()
        return ghost_is_cheaper(positions, d_in, self.grad.shape[1] // groups)

    def sq_norms(self) -> torch.Tensor:
        if self._ghost_is_cheaper():
            module, groups, batch = self.module, self.module.groups, self.grad.shape[0]
            patches = unfold(pad_input(module, self.x) if any(self.padding) else self.x,
                             module.kernel_size, module.stride, module.dilation)
            positions = patches.shape[1]
            a = patches.reshape(batch, positions, groups, -1).transpose(1, 2)
            b = self.grad.reshape(batch, groups, -1, positions).transpose(-1, -2)
            return FactoredGrad(a, b, module.weight.shape).sq_norms()
        return Materialized(self.materialize()).sq_norms()

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        if self._grads is not None:
            return torch.tensordot(weights.to(self._grads.dtype), self._grads, dims=1)
        module = self.module
        dims = len(module.kernel_size)
        scaled = self.grad * weights.to(self.grad.dtype).reshape(-1, *[1] * (dims + 1))
        weight = module.weight.detach().to(self.grad.dtype)
        return torch.ops.aten.convolution_backward(
            scaled, self.x.to(self.grad.dtype), weight, None, module.stride, self.padding,
            module.dilation, False, [0] * dims, module.groups, [False, True, False],
        )[1]

    def materialize(self) -> torch.Tensor:
        if self._grads is None:
            self._grads = per_sample_weight_grads(self.module, self.x, self.padding, self.grad)
        return self._grads

    def compact(self) -> None:
        if self._grads is not None and self._grads.numel() <= self.x.numel() + self.grad.numel():
            self.x = self.grad = None  # type: ignore[assignment]
        else:
            self._grads = None


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
            out["weight"] = ConvWeightGrad(module, x, grad)
        if "bias" in params:
            out["bias"] = Materialized(grad.sum(tuple(range(2, dims + 2))))
        return out
