"""A parameter used more than once in a step (a tied input embedding and output head, a block called
twice): its per-sample gradient is the sum of its uses' gradients, ``gᵢ = Σᵤ gᵢᵘ``, kept as the uses'
own lazy forms.

The squared norm is ``‖gᵢ‖² = Σᵤ ‖gᵢᵘ‖² + 2 Σ_{u<v} ⟨gᵢᵘ, gᵢᵛ⟩``: each use's own norm by its own path, and
each cross term from the factors where the pair has a form for it — two factored gradients
(``Σₜ bₜaₜᵀ`` of the same layout: ``Σ_{t,s} (bₜ·b'ₛ)(aₜ·a'ₛ)``), a factored gradient and an embedding's
(an output head tied to the input embedding: ``Σ_{t,s} bₜ[idₛ] (aₜ·eₛ)``) — else from the two materialised
gradients. The weighted sum is the sum of the uses' weighted sums. So a tied GPT-2 head never holds its
``[B, vocabulary, d]`` per-sample gradients, only what each use holds anyway.

Precision: the cross terms are exact sums like the ghost norm's; where the uses nearly cancel, ``‖gᵢ‖²``
carries the rounding of the larger ``‖gᵢᵘ‖²`` (as a ghost norm carries that of its Gram products), in
float32 or wider.
"""

from __future__ import annotations

import torch

from ..dtypes import as_norm_precision
from .base import PerSampleGrad
from .embedding import EmbeddingGrad
from .factored import FactoredGrad, factored_per_sample


class SummedUses(PerSampleGrad):
    """``gᵢ = Σᵤ gᵢᵘ`` over the uses' forms (two or more), none of them materialised unless a pair has no
    other form for its cross term."""

    def __init__(self, uses: list[PerSampleGrad]):
        self.uses = uses

    @staticmethod
    def join(total: PerSampleGrad, use: PerSampleGrad) -> SummedUses:
        """The sum of ``total`` (one use, or already a sum) and one more use."""
        uses = total.uses if isinstance(total, SummedUses) else [total]
        return SummedUses([*uses, use])

    def sq_norms(self) -> torch.Tensor:
        total = sum(use.sq_norms() for use in self.uses)
        for i, u in enumerate(self.uses):
            for v in self.uses[i + 1:]:
                total = total + 2 * inner(u, v)
        return total.clamp_min(0)  # rounding of nearly cancelling uses cannot make it negative

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        return sum(use.weighted_sum(weights) for use in self.uses)

    def materialize(self) -> torch.Tensor:
        return sum(use.materialize() for use in self.uses)

    def compact(self) -> None:
        for use in self.uses:
            use.compact()


def inner(u: PerSampleGrad, v: PerSampleGrad) -> torch.Tensor:
    """``⟨gᵢᵘ, gᵢᵛ⟩`` for each example, shape ``[B]``, in float32 or wider."""
    if isinstance(v, FactoredGrad) and not isinstance(u, FactoredGrad):
        u, v = v, u
    if isinstance(u, FactoredGrad) and u.a is not None:
        if isinstance(v, FactoredGrad) and v.a is not None and _same_layout(u, v):
            return _factored_inner(u, v)
        if isinstance(v, EmbeddingGrad) and _is_head_of(u, v):
            return _head_embedding_inner(u, v)
    gu, gv = u.materialize(), v.materialize()
    if gu.dtype != gv.dtype:
        gu, gv = as_norm_precision(gu), as_norm_precision(gv)
    # ⟨x, y⟩ = (‖x + y‖² − ‖x − y‖²) / 4 would round worse; one fused product-sum instead
    return torch.einsum("bi,bi->b", as_norm_precision(gu.flatten(1)), as_norm_precision(gv.flatten(1)))


def _same_layout(u: FactoredGrad, v: FactoredGrad) -> bool:
    """Both ``Σₜ bₜaₜᵀ`` with the same channel groups and factor widths, reshaped to the same shape."""
    return (u.shape == v.shape and u.a.shape[1] == v.a.shape[1] and u.a.shape[-1] == v.a.shape[-1]
            and u.b.shape[-1] == v.b.shape[-1])


def _factored_inner(u: FactoredGrad, v: FactoredGrad) -> torch.Tensor:
    """``Σ_groups Σ_{t,s} (bₜ·b'ₛ)(aₜ·a'ₛ)`` by two cross Gram products — or from the per-sample
    gradients where those are smaller than the ``[T, T']`` Gram matrices."""
    positions, other, d_in, d_out = u.a.shape[2], v.a.shape[2], u.a.shape[-1], u.b.shape[-1]
    if positions * other * (d_in + d_out) > (positions + other) * d_in * d_out:
        gu = factored_per_sample(u.a, u.b, u.shape)
        gv = factored_per_sample(v.a, v.b, v.shape)
        return torch.einsum("bi,bi->b", as_norm_precision(gu.flatten(1)), as_norm_precision(gv.flatten(1)))
    a_u, b_u, a_v, b_v = (as_norm_precision(t) for t in (u.a, u.b, v.a, v.b))
    return ((a_u @ a_v.transpose(-1, -2)) * (b_u @ b_v.transpose(-1, -2))).sum((1, 2, 3))


def _is_head_of(head: FactoredGrad, embedding: EmbeddingGrad) -> bool:
    """``head`` is ``Σₜ bₜaₜᵀ`` with one row per embedding row (``b`` over the vocabulary, ``a`` over the
    embedding width): an output layer sharing the embedding's weight."""
    return (head.a.shape[1] == 1 and head.shape == (embedding.num_embeddings, head.a.shape[-1])
            and head.b.shape[-1] == embedding.num_embeddings and embedding.grad.shape[-1] == head.a.shape[-1])


def _head_embedding_inner(head: FactoredGrad, embedding: EmbeddingGrad) -> torch.Tensor:
    """``⟨Σₜ bₜaₜᵀ, Σₛ onehot(idₛ) eₛᵀ⟩ = Σ_{t,s} bₜ[idₛ] (aₜ·eₛ)``: the head's output gradient read at the
    example's own ids, against the products of its inputs with the embedding's output gradients (zero at
    padding ids). ``[B, T, S]`` numbers per example, never the vocabulary."""
    a, b = as_norm_precision(head.a[:, 0]), head.b[:, 0]  # [B, T, d], [B, T, V]
    ids, e = embedding.ids, as_norm_precision(embedding.grad)  # [B, S], [B, S, d]
    at_ids = torch.gather(b, 2, ids[:, None, :].expand(-1, b.shape[1], -1))  # [B, T, S]
    return (as_norm_precision(at_ids) * (a @ e.transpose(1, 2))).sum((1, 2))
