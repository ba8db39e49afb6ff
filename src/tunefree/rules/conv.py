"""``nn.Conv1d/2d/3d`` with any stride, padding (numbers, ``"same"``, ``"valid"``, any padding mode),
dilation and groups.

Per-sample norms come from a ghost norm on unfolded input patches or from per-sample gradients computed by
the native weight-gradient kernel, whichever is faster for the layer (measured, or by formula: ghost with
few output positions). The weighted sum uses the native kernel on the padded input, so a layer kept until
the end of the backward pass holds only its input and output gradient, as autograd would; a layer whose
clip group is complete at once (per-layer clipping) forms norms and sum from the same per-sample
gradients, a slice of examples at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .base import Capture, ClippedSum, LayerRule, Materialized, PerSampleGrad, materialised_sq_norms
from .factored import FactoredGrad, chunked_clipped_sum, chunked_sq_norms, examples_per_chunk
from .paths import GHOST, MATERIALISE, factored_estimates


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
    if len(kernel) == 2:  # the native im2col kernel: one pass, no strided gather
        return F.unfold(x, kernel, dilation=dilation, stride=stride).transpose(1, 2)
    dims = len(kernel)
    for i, (k, s, d) in enumerate(zip(kernel, stride, dilation)):
        x = x.unfold(2 + i, d * (k - 1) + 1, s)[..., ::d]
    batch, channels = x.shape[:2]
    positions = x.shape[2:2 + dims]
    # [B, C, L1..LD, k1..kD] -> [B, L1..LD, C, k1..kD]
    order = [0, *range(2, 2 + dims), 1, *range(2 + dims, 2 + 2 * dims)]
    x = x.permute(order)
    return x.reshape(batch, math.prod(positions), -1)


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
    """Conv weight gradients of one call. Norms by ghost norm on unfolded patches or from the
    materialised per-sample gradients, whichever ``chooser`` measured faster (else the cost formula:
    ghost with few output positions); the weighted sum from the materialised gradients, or — when
    only (padded input, output gradient) were kept — with the native kernel. In :meth:`clipped_sum` the
    materialised path forms the sum slice by slice of examples, with no more memory than the layer's
    own input and output gradient."""

    def __init__(self, module: nn.modules.conv._ConvNd, x: torch.Tensor, grad: torch.Tensor):
        padding = native_padding(module)
        # the input as given with the padding for the native kernels, or padded explicitly
        self.x = x if padding is not None else pad_input(module, x)
        self.padding = padding if padding is not None else [0] * len(module.kernel_size)
        self.module, self.grad = module, grad
        self._grads: torch.Tensor | None = None

    def _estimates(self) -> dict[str, float]:
        groups = self.module.groups
        return factored_estimates(self.grad.shape[0] * groups, self.grad[0, 0].numel(),
                                  self.module.weight[0].numel(), self.grad.shape[1] // groups, unfolded=True)

    def _ghost_is_cheaper(self) -> bool:
        estimates = self._estimates()
        return estimates[GHOST] <= estimates[MATERIALISE]

    def _path(self, fused: bool) -> str:
        estimates = self._estimates()
        if self.chooser is None:
            return min(estimates, key=estimates.__getitem__)
        module, batch = self.module, self.grad.shape[0]
        key = ("conv", fused, tuple(module.weight.shape), module.stride, tuple(self.padding),
               module.dilation, module.groups, tuple(self.x.shape[1:]), self.x.dtype, self.grad.dtype,
               self.grad.device)
        zeros = self.grad.new_zeros(batch, dtype=torch.float64)
        ones = lambda sq: torch.ones_like(sq, dtype=torch.float64)  # noqa: E731 - timing only
        run = (lambda path: self._clipped_sum_by(path, zeros, ones)) if fused else self.sq_norms_by
        # time the ghost norm only where its unfolded patches and Gram matrices are no larger than the
        # layer's own tensors (or the estimate picks it anyway): calibrating never raises the peak memory
        positions = self.grad[0, 0].numel()
        ghost_elements = batch * positions * (module.weight[0].numel() * module.groups + 2 * positions)
        timeable = (ghost_elements <= self.x.numel() + self.grad.numel()
                    or min(estimates, key=estimates.get) == GHOST)
        return self.chooser.choose(key, estimates, run, self.grad.device, timeable)

    def sq_norms_by(self, path: str) -> torch.Tensor:
        """The per-sample squared norms by ``path`` (``"ghost"`` or ``"materialise"``), keeping nothing."""
        if path == MATERIALISE:
            return chunked_sq_norms(self._per_sample, self.grad.shape[0], self._chunk())
        module, groups, batch = self.module, self.module.groups, self.grad.shape[0]
        patches = unfold(pad_input(module, self.x) if any(self.padding) else self.x,
                         module.kernel_size, module.stride, module.dilation)
        positions = patches.shape[1]
        a = patches.reshape(batch, positions, groups, -1).transpose(1, 2)
        b = self.grad.reshape(batch, groups, -1, positions).transpose(-1, -2)
        return FactoredGrad(a, b, module.weight.shape).sq_norms_by(GHOST)

    def sq_norms(self) -> torch.Tensor:
        path = self._path(fused=False)
        if path == GHOST or self._chunk() < self.grad.shape[0]:  # the batch's gradients do not fit
            return self.sq_norms_by(path)
        return materialised_sq_norms(self.materialize())

    def clipped_sum(self, other_sq_norms: torch.Tensor,
                    weights_of: Callable[[torch.Tensor], torch.Tensor]) -> ClippedSum:
        if self._grads is not None:
            return super().clipped_sum(other_sq_norms, weights_of)
        return self._clipped_sum_by(self._path(fused=True), other_sq_norms, weights_of)

    def _clipped_sum_by(self, path: str, other_sq_norms: torch.Tensor,
                        weights_of: Callable[[torch.Tensor], torch.Tensor]) -> ClippedSum:
        if path == GHOST:
            sq_norms = self.sq_norms_by(GHOST)
            weights = weights_of(sq_norms + other_sq_norms)
            return ClippedSum(self._native_weighted_sum(weights), sq_norms, weights)
        return chunked_clipped_sum(self._per_sample, self.grad.shape[0], self._chunk(), other_sq_norms,
                                   weights_of)

    def _chunk(self) -> int:
        return examples_per_chunk(self.module.weight.numel(), self.x.numel() + self.grad.numel())

    def _per_sample(self, start: int, stop: int) -> torch.Tensor:
        return per_sample_weight_grads(self.module, self.x[start:stop], self.padding,
                                       self.grad[start:stop])

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        if self._grads is not None:
            return torch.tensordot(weights.to(self._grads.dtype), self._grads, dims=1)
        return self._native_weighted_sum(weights)

    def _native_weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """``Σᵢ wᵢ gᵢ`` as one native weight-gradient call on the re-weighted output gradient."""
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
            self._grads = self._per_sample(0, self.grad.shape[0])
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
