"""Per-sample gradients that factor as an outer product summed over positions: ``gᵢ = Σₜ bᵢₜ aᵢₜᵀ``.

Linear layers (positions = tokens) and convolutions (positions = output pixels, ``a`` the unfolded input
patches) both have this form, per channel group. The squared norm is computed either by the ghost norm
``‖gᵢ‖² = ⟨aᵢaᵢᵀ, bᵢbᵢᵀ⟩`` (cost ~T²·(d_in+d_out)) or by materialising ``gᵢ`` (cost ~T·d_in·d_out),
whichever is faster for this layer and input (measured once per shape by ``paths.PathChooser``,
else by the formula).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable

import torch

from ..dtypes import as_norm_precision, working_dtype
from .base import ClippedSum, Materialized, PerSampleGrad, materialised_sq_norms
from .paths import GHOST, MATERIALISE, factored_estimates


def ghost_is_cheaper(positions: int, d_in: int, d_out: int) -> bool:
    """Ghost norm costs ~T²(d_in + d_out) per sample and group; materialising costs ~T·d_in·d_out."""
    estimates = factored_estimates(1, positions, d_in, d_out)
    return estimates[GHOST] <= estimates[MATERIALISE]


def example_slices(batch: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive slices of at most ``chunk`` examples covering the batch."""
    return [(start, min(start + chunk, batch)) for start in range(0, batch, chunk)]


def chunked_clipped_sum(per_sample: Callable[[int, int], torch.Tensor], batch: int, chunk: int,
                        other_sq_norms: torch.Tensor,
                        weights_of: Callable[[torch.Tensor], torch.Tensor]) -> ClippedSum:
    """``Σᵢ wᵢ gᵢ`` from per-sample gradients materialised ``chunk`` examples at a time
    (``per_sample(start, stop)``): each slice gives its examples' norms, their clip weights and its
    share of the sum, then is dropped, so memory holds one slice and the norm and the summand of an
    example come from the same tensor."""
    total, sq_parts, weight_parts = None, [], []
    for start, stop in example_slices(batch, chunk):
        grads = per_sample(start, stop)
        sq_norms = materialised_sq_norms(grads)
        weights = weights_of(sq_norms + other_sq_norms[start:stop])
        part = weights.to(grads.dtype)[None] @ grads.reshape(stop - start, -1)
        total = part if total is None else total.add_(part)
        sq_parts.append(sq_norms)
        weight_parts.append(weights)
    return ClippedSum(total.reshape(grads.shape[1:]), _joined(sq_parts), _joined(weight_parts))


def chunked_sq_norms(sq_norms_of: Callable[[int, int], torch.Tensor], batch: int,
                     chunk: int) -> torch.Tensor:
    """``‖gᵢ‖²`` of the batch from ``sq_norms_of(start, stop)``, ``chunk`` examples at a time."""
    return _joined([sq_norms_of(start, stop) for start, stop in example_slices(batch, chunk)])


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# The working memory (elements) a slice of examples may always use, whatever the layer's own size
# (16 MiB in float32).
SLICE_LIMIT = 2**22


def examples_per_chunk(per_example: int, layer_elements: int) -> int:
    """How many examples one slice of per-example work takes (``per_example`` elements each): as many
    as fit in the layer's own captured tensors (``layer_elements``, which grow with the batch) or in
    ``SLICE_LIMIT``, whichever is larger, and at least one. The whole batch is one slice whenever its
    work fits; otherwise the number of slices is about ``per_example`` over the layer's captured
    elements per example — set by the layer's shape, not by the batch size."""
    return max(1, max(layer_elements, SLICE_LIMIT) // max(1, per_example))


def ghost_sq_norms(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``‖gᵢ‖² = Σ_groups ⟨aᵢaᵢᵀ, bᵢbᵢᵀ⟩`` for ``a: [B, G, T, d_in]``, ``b: [B, G, T, d_out]``: two batched
    Gram products in float32 or wider."""
    a, b = as_norm_precision(a), as_norm_precision(b)
    if a.shape[2] == 1:  # ‖b aᵀ‖² = ‖a‖²‖b‖²
        return ((a * a).sum((2, 3)) * (b * b).sum((2, 3))).sum(1)
    gram_a = a @ a.transpose(-1, -2)
    gram_b = b @ b.transpose(-1, -2)
    return (gram_a * gram_b).sum((1, 2, 3))


def factored_per_sample(a: torch.Tensor, b: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``gᵢ = Σₜ bᵢₜ aᵢₜᵀ`` per group, ``[B, *shape]``: one batched matrix product in the factors'
    working dtype (float32 for 16-bit factors)."""
    dtype = working_dtype(a, b)
    grads = b.to(dtype).transpose(-1, -2) @ a.to(dtype)  # [B, G, d_out, d_in]
    return grads.reshape(grads.shape[0], *shape)


class TwoPathGrad(PerSampleGrad):
    """Per-sample gradients with two exact norm paths: the ghost norm from the layer's factors, or the
    materialised per-sample gradients, whichever ``chooser`` measured faster for the layer's shape (else the
    cost formula). The materialised path works slice by slice of examples (``examples_per_chunk``: no more
    memory than the layer's own captured tensors) unless the whole batch fits, which is then kept for the
    weighted sum; in :meth:`clipped_sum` each slice gives its norms, clip weights and share of the sum.

    A form gives the abstract methods: the sizes and costs of its paths, the per-sample gradients of a slice
    of examples, the ghost norms and the weighted sum from its factors."""

    batch: int
    dtype: torch.dtype  # the working dtype :meth:`_factored_sum` applies the clip weights in
    _grads: torch.Tensor | None = None

    @abstractmethod
    def _layer_elements(self) -> int:
        """The elements of the layer's own captured tensors (the memory a path may use at once)."""

    @abstractmethod
    def _estimates(self) -> dict[str, float]:
        """The cost formula of each path."""

    @abstractmethod
    def _key(self, fused: bool) -> tuple:
        """What the paths' timing depends on (the chooser measures once per key), with its device last."""

    @abstractmethod
    def _ghost_elements(self) -> int:
        """The working elements of the ghost path over the whole batch (beyond the captured tensors)."""

    @abstractmethod
    def _per_example(self, path: str) -> int:
        """The working elements per example of ``path``."""

    @abstractmethod
    def _per_sample(self, start: int, stop: int) -> torch.Tensor:
        """The per-sample gradients of examples ``start:stop``, ``[n, *shape]``."""

    @abstractmethod
    def _ghost_sq_norms(self) -> torch.Tensor:
        """The per-sample squared norms by the ghost norm."""

    @abstractmethod
    def _factored_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """``Σᵢ wᵢ gᵢ`` from the factors, without the per-sample gradients."""

    @abstractmethod
    def _drop_factors(self) -> None:
        """Drop the factors once the per-sample gradients are kept."""

    def _path(self, fused: bool) -> str:
        estimates = self._estimates()
        if self.chooser is None:
            return min(estimates, key=estimates.__getitem__)
        key = self._key(fused)
        run = self._timed_clipped_sum if fused else self.sq_norms_by
        # time the ghost norm only where its working tensors are no larger than the layer's own (or the
        # estimate picks it anyway), so that calibrating never raises the peak memory
        timeable = (self._ghost_elements() <= self._layer_elements()
                    or min(estimates, key=estimates.get) == GHOST)
        return self.chooser.choose(key, estimates, run, key[-1], timeable)

    def _timed_clipped_sum(self, path: str) -> ClippedSum:
        """The clipped sum by ``path`` as the chooser times it (unit weights, no other parameter's norms);
        its tensors are made only when a timing runs."""
        zeros = torch.zeros(self.batch, dtype=torch.float64, device=self._key(True)[-1])
        return self._clipped_sum_by(path, zeros, lambda sq: torch.ones_like(sq, dtype=torch.float64))

    def _chunk(self, path: str) -> int:
        return examples_per_chunk(self._per_example(path), self._layer_elements())

    def sq_norms_by(self, path: str) -> torch.Tensor:
        """The per-sample squared norms by ``path`` (``"ghost"`` or ``"materialise"``), keeping nothing."""
        if path == MATERIALISE:
            return chunked_sq_norms(lambda start, stop: materialised_sq_norms(self._per_sample(start, stop)),
                                    self.batch, self._chunk(MATERIALISE))
        return self._ghost_sq_norms()

    def sq_norms(self) -> torch.Tensor:
        path = self._path(fused=False)
        if path == GHOST or self._chunk(path) < self.batch:  # the batch's gradients do not fit
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
            return ClippedSum(self._factored_sum(weights), sq_norms, weights)
        return chunked_clipped_sum(self._per_sample, self.batch, self._chunk(MATERIALISE), other_sq_norms,
                                   weights_of)

    def weights_dtype(self) -> torch.dtype:
        return self._grads.dtype if self._grads is not None else self.dtype  # _factored_sum's

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        if self._grads is not None:
            return Materialized(self._grads).weighted_sum(weights)
        return self._factored_sum(weights)

    def materialize(self) -> torch.Tensor:
        if self._grads is None:
            self._grads = self._per_sample(0, self.batch)
        return self._grads

    def compact(self) -> None:
        if self._grads is None:
            return
        if self._grads.numel() <= self._layer_elements():
            self._drop_factors()
        else:
            self._grads = None


class FactoredGrad(TwoPathGrad):
    """``gᵢ`` per channel group from ``a: [B, G, T, d_in]`` and ``b: [B, G, T, d_out]``, reshaped
    from ``[G·d_out, d_in]`` to the parameter's shape. The factors are kept as given (a 16-bit output
    gradient in 16 bits); every product runs in their working dtype, float32 or wider."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, shape: torch.Size):
        self.a, self.b, self.shape = a, b, shape
        self.batch = a.shape[0]

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        """The products' working dtype (float32 or wider)."""
        return working_dtype(self.a, self.b)

    def _layer_elements(self) -> int:
        return self.a.numel() + self.b.numel()

    def _estimates(self) -> dict[str, float]:
        batch, groups, positions, d_in = self.a.shape
        return factored_estimates(batch * groups, positions, d_in, self.b.shape[-1])

    def _key(self, fused: bool) -> tuple:
        return ("factored", fused, tuple(self.a.shape[1:]), self.b.shape[-1], self.a.dtype, self.b.dtype,
                self.a.device)

    def _ghost_elements(self) -> int:
        batch, groups, positions, _ = self.a.shape
        return 2 * batch * groups * positions * positions  # the two Gram matrices

    def _per_example(self, path: str) -> int:
        return math.prod(self.shape)

    def _per_sample(self, start: int, stop: int) -> torch.Tensor:
        return factored_per_sample(self.a[start:stop], self.b[start:stop], self.shape)

    def _ghost_sq_norms(self) -> torch.Tensor:
        return ghost_sq_norms(self.a, self.b)

    def _factored_sum(self, weights: torch.Tensor) -> torch.Tensor:
        a, b = self.a, self.b
        dtype = working_dtype(a, b)
        groups, d_in, d_out = a.shape[1], a.shape[-1], b.shape[-1]
        w = weights.to(dtype).view(-1, 1, 1, 1)
        if d_in < d_out:  # scale the smaller factor by the clip weights (in the working dtype)
            a, b = a * w, b.to(dtype)
        else:
            a, b = a.to(dtype), b * w
        # [G, d_out, B·T] @ [G, B·T, d_in]: one (batched) matrix product, as autograd's weight gradient
        total = (b.permute(1, 3, 0, 2).reshape(groups, d_out, -1)
                 @ a.permute(1, 0, 2, 3).reshape(groups, -1, d_in))
        return total.reshape(self.shape)

    def _drop_factors(self) -> None:
        self.a = self.b = None  # type: ignore[assignment]
