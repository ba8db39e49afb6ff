"""Per-sample gradients that factor as an outer product summed over positions: ``gᵢ = Σₜ bᵢₜ aᵢₜᵀ``.

Linear layers (positions = tokens) and convolutions (positions = output pixels, ``a`` the unfolded input
patches) both have this form, per channel group. The squared norm is computed either by the ghost norm
``‖gᵢ‖² = ⟨aᵢaᵢᵀ, bᵢbᵢᵀ⟩`` (cost ~T²·(d_in+d_out)) or by materialising ``gᵢ`` (cost ~T·d_in·d_out),
whichever is cheaper for this layer and input.
"""

from __future__ import annotations

import torch

from ..dtypes import as_norm_precision
from .base import PerSampleGrad


def ghost_is_cheaper(positions: int, d_in: int, d_out: int) -> bool:
    """Ghost norm costs ~T²(d_in + d_out) per sample and group; materialising costs ~T·d_in·d_out."""
    return positions * (d_in + d_out) <= d_in * d_out


class FactoredGrad(PerSampleGrad):
    """``gᵢ`` per channel group from ``a: [B, G, T, d_in]`` and ``b: [B, G, T, d_out]``, reshaped
    from ``[G·d_out, d_in]`` to the parameter's shape."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, shape: torch.Size):
        self.a, self.b, self.shape = a, b, shape
        self._grads: torch.Tensor | None = None

    def sq_norms(self) -> torch.Tensor:
        _, _, positions, d_in = self.a.shape
        a, b = as_norm_precision(self.a), as_norm_precision(self.b)
        if ghost_is_cheaper(positions, d_in, b.shape[-1]):
            if positions == 1:  # ‖b aᵀ‖² = ‖a‖²‖b‖²
                return ((a * a).sum((2, 3)) * (b * b).sum((2, 3))).sum(1)
            gram_a = a @ a.transpose(-1, -2)
            gram_b = b @ b.transpose(-1, -2)
            return (gram_a * gram_b).sum((1, 2, 3))
        self._grads = self._per_sample(self.a, self.b)
        flat = as_norm_precision(self._grads.flatten(1))
        return (flat * flat).sum(1)

    def _per_sample(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        grads = b.transpose(-1, -2) @ a.to(b.dtype)  # [B, G, d_out, d_in]
        return grads.reshape(grads.shape[0], *self.shape)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        if self._grads is not None:
            grads = self._grads
            return (weights.to(grads.dtype) @ grads.reshape(grads.shape[0], -1)).reshape(self.shape)
        a, b = self.a.to(self.b.dtype), self.b
        groups, d_in, d_out = a.shape[1], a.shape[-1], b.shape[-1]
        w = weights.to(b.dtype).view(-1, 1, 1, 1)
        if d_in < d_out:  # scale the smaller factor by the clip weights
            a = a * w
        else:
            b = b * w
        # [G, d_out, B·T] @ [G, B·T, d_in]: one (batched) matrix product, as autograd's weight gradient
        total = (b.permute(1, 3, 0, 2).reshape(groups, d_out, -1)
                 @ a.permute(1, 0, 2, 3).reshape(groups, -1, d_in))
        return total.reshape(self.shape)

    def materialize(self) -> torch.Tensor:
        if self._grads is None:
            self._grads = self._per_sample(self.a, self.b)
        return self._grads

    def compact(self) -> None:
        if self._grads is None:
            return
        if self._grads.numel() <= self.a.numel() + self.b.numel():
            self.a = self.b = None  # type: ignore[assignment]
        else:
            self._grads = None
