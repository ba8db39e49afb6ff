"""``nn.Conv1d/2d/3d`` with any stride, padding (numbers, ``"same"``, ``"valid"``, any padding mode),
dilation and groups.

Everything is batched over the examples, a fixed number of calls per layer whatever the batch size. The
input patches are one strided view of the (padded) input, copied once into ``[B, G, C/G·∏k, T]`` (no
per-example im2col). Per-sample norms come by a ghost norm on them (two batched Gram products) or from
the per-sample gradients, whichever is faster for the layer (measured, or by formula). The per-sample
gradients are one batched matrix product of the patches with the output gradient — except on devices in
``NATIVE_PER_SAMPLE`` (the CPU), where the native weight-gradient kernel makes them in one grouped call
(the batch as channel groups; oneDNN runs it as one primitive, several times faster there than the
patches; CUDA's kernels would loop over the groups, one launch per example). The weighted sum uses the
native weight-gradient kernel once on the re-weighted output gradient, so a layer kept until the end of
the backward pass holds only its input and output gradient, as autograd would. A layer whose clip group
is complete at once (per-layer clipping) forms norms and sum from the same per-sample gradients.

The patches (and Gram matrices or per-sample gradients) of the whole batch are formed at once when they
fit in the layer's own captured tensors (at least ``factored.SLICE_LIMIT`` elements); otherwise in slices
of examples of that size — a number of slices set by the layer's shape, not by the batch size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..dtypes import accumulated, accumulation_dtype
from .base import Capture, LayerRule, Materialized, PerSampleGrad
from .factored import TwoPathGrad, chunked_sq_norms, factored_per_sample, ghost_sq_norms
from .paths import GHOST, MATERIALISE, factored_estimates

# Device types whose native grouped weight-gradient kernel computes all per-sample gradients in one call.
NATIVE_PER_SAMPLE = frozenset({"cpu"})


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


def patches(x: torch.Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...],
            groups: int = 1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The patches of a padded ``[B, C, *spatial]`` input as ``[B, G, T, C/G·∏k]`` (T output positions,
    each row channel-major like the weight): one strided view of ``x``, copied once (in ``dtype``) in
    the layout ``[B, G, C/G·∏k, T]`` — output positions innermost, so the copy reads the input in runs —
    and returned as its transposed view. Where the runs are short (:func:`gathers`) the copy is one
    gather of the same elements by their offsets in each example: the same values in the same layout."""
    batch, channels, *spatial = x.shape
    positions = [(size - d * (k - 1) - 1) // s + 1
                 for size, k, s, d in zip(spatial, kernel, stride, dilation)]
    per_group = channels // groups
    shape = (groups, per_group, *kernel, *positions)

    def window_strides(strides: tuple[int, ...]) -> tuple[int, ...]:
        """[G, C/G, k1..kD, L1..LD]: each output position's window, for an example of ``strides``."""
        return (strides[0] * per_group, strides[0], *[st * d for st, d in zip(strides[1:], dilation)],
                *[st * s for st, s in zip(strides[1:], stride)])

    if gathers(positions, stride, x.device):
        x = x.to(dtype or x.dtype)
        extent = 1 + sum((size - 1) * st for size, st in zip(x.shape[1:], x.stride()[1:]))
        offsets = torch.arange(extent, device=x.device).as_strided(shape, window_strides(x.stride()[1:]))
        examples = x.as_strided((batch, extent), (x.stride(0), 1), x.storage_offset())
        copy = examples.index_select(1, offsets.reshape(-1))
    else:
        view = x.as_strided((batch, *shape), (x.stride(0), *window_strides(x.stride()[1:])),
                            x.storage_offset())
        copy = torch.empty(view.shape, dtype=dtype or x.dtype, device=x.device).copy_(view)
    return copy.view(batch, groups, -1, math.prod(positions)).transpose(-1, -2)


def gathers(positions: list[int], stride: tuple[int, ...], device: torch.device) -> bool:
    """Whether the patches are copied by a gather: on the CPU, where the strided copy's innermost run of
    output positions is short — under 16, or under 32 read with a stride — and its per-run cost dominates
    (a gather is 3–5× faster there, the copy faster on longer runs; RESULTS §16a). Speed only: both
    copy the same elements."""
    return device.type == "cpu" and (positions[-1] < 16 or (stride[-1] > 1 and positions[-1] < 32))


def native_per_sample(module: nn.modules.conv._ConvNd, x: torch.Tensor, padding: list[int],
                      grad: torch.Tensor) -> torch.Tensor:
    """All per-sample weight gradients ``[B, *weight.shape]`` from one native weight-gradient call: the
    batch becomes channel groups (input ``[1, B·C_in, …]``, ``B·groups`` groups), so each example's
    gradient comes out as its own slice, with no copy of the patches."""
    batch, dims = grad.shape[0], len(module.kernel_size)
    shape = module.weight.shape
    # The kernel reads only the weight's shape when no input gradient is asked for.
    stacked = grad.new_empty(batch * shape[0], *shape[1:])
    grads = torch.ops.aten.convolution_backward(
        grad.reshape(1, -1, *grad.shape[2:]), x.to(grad.dtype).reshape(1, -1, *x.shape[2:]),
        stacked, None, module.stride, padding, module.dilation, False, [0] * dims,
        batch * module.groups, [False, True, False])[1]
    return grads.reshape(batch, *shape)


class ConvWeightGrad(TwoPathGrad):
    """Conv weight gradients of one call. Norms by ghost norm or from the materialised per-sample
    gradients (both from the batched patches); the weighted sum from the materialised gradients, or — when
    only (input, output gradient) were kept — with the native kernel."""

    def __init__(self, module: nn.modules.conv._ConvNd, x: torch.Tensor, grad: torch.Tensor):
        padding = native_padding(module)
        # the input as given with the padding for the native kernels, or padded explicitly
        self.x = x if padding is not None else pad_input(module, x)
        self.padding = padding if padding is not None else [0] * len(module.kernel_size)
        self.module, self.grad, self.batch = module, grad, grad.shape[0]
        self.dtype = accumulation_dtype(grad.dtype)  # the working dtype: a 16-bit gradient is kept as is

    def _sizes(self) -> tuple[int, int, int, int]:
        """(channel groups, output positions, d_in = C_in/G·∏k, d_out = C_out/G) of one example."""
        groups = self.module.groups
        return (groups, math.prod(self.grad.shape[2:]), math.prod(self.module.weight.shape[1:]),
                self.grad.shape[1] // groups)

    def _layer_elements(self) -> int:
        return self.x.numel() + self.grad.numel()

    def _estimates(self) -> dict[str, float]:
        groups, positions, d_in, d_out = self._sizes()
        estimates = factored_estimates(self.batch * groups, positions, d_in, d_out, unfolded=True)
        if self._native():  # no patches to copy for the native kernel
            native = factored_estimates(self.batch * groups, positions, d_in, d_out)
            estimates[MATERIALISE] = native[MATERIALISE]
        return estimates

    def _key(self, fused: bool) -> tuple:
        module = self.module
        return ("conv", fused, tuple(module.weight.shape), module.stride, tuple(self.padding),
                module.dilation, module.groups, tuple(self.x.shape[1:]), self.x.dtype, self.grad.dtype,
                self.grad.device)

    def _ghost_elements(self) -> int:
        return self.batch * self._per_example(GHOST)

    def _native(self) -> bool:
        return self.grad.device.type in NATIVE_PER_SAMPLE

    def _per_example(self, path: str) -> int:
        """Working elements per example of a path: the patches and the two Gram matrices (ghost), the
        per-sample gradient and (unless made natively) the patches (materialise)."""
        groups, positions, d_in, _ = self._sizes()
        patches = groups * positions * d_in
        if path == GHOST:
            return patches + 2 * groups * positions * positions
        return self.module.weight.numel() + (0 if self._native() else patches)

    def _factors(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``a``: the patches ``[n, G, T, d_in]`` and ``b``: the output gradient ``[n, G, T, d_out]`` of
        examples ``start:stop``."""
        module, grad = self.module, self.grad[start:stop].to(self.dtype)
        x = self.x[start:stop]
        if any(self.padding):
            x = pad_input(module, x)
        a = patches(x, module.kernel_size, module.stride, module.dilation, module.groups, self.dtype)
        b = grad.reshape(stop - start, module.groups, -1, a.shape[2]).transpose(-1, -2)
        return a, b

    def _per_sample(self, start: int, stop: int) -> torch.Tensor:
        if self._native():
            return native_per_sample(self.module, self.x[start:stop], self.padding,
                                     self.grad[start:stop].to(self.dtype))
        return factored_per_sample(*self._factors(start, stop), self.module.weight.shape)

    def _ghost_sq_norms(self) -> torch.Tensor:
        return chunked_sq_norms(lambda start, stop: ghost_sq_norms(*self._factors(start, stop)), self.batch,
                                self._chunk(GHOST))

    def _factored_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """``Σᵢ wᵢ gᵢ`` as one native weight-gradient call on the re-weighted output gradient."""
        module = self.module
        dims = len(module.kernel_size)
        scaled = self.grad * weights.to(self.dtype).reshape(-1, *[1] * (dims + 1))  # in the working dtype
        weight = module.weight.detach().to(self.dtype)
        return torch.ops.aten.convolution_backward(
            scaled, self.x.to(self.dtype), weight, None, module.stride, self.padding,
            module.dilation, False, [0] * dims, module.groups, [False, True, False],
        )[1]

    def _drop_factors(self) -> None:
        self.x = self.grad = None  # type: ignore[assignment]


class ConvRule(LayerRule):
    module_types = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    takes_16_bit_grads = True

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
            out["bias"] = Materialized(accumulated(grad).sum(tuple(range(2, dims + 2))))
        return out
