"""``nn.Embedding``: repeated ids sum into one row; the ``padding_idx`` row gets no gradient.

No ``[B, T, V]`` one-hot tensor is ever built: norms come from a segment sum over (example, id) pairs.
"""

from __future__ import annotations

import torch
from torch import nn

from ..dtypes import accumulated, accumulation_dtype, as_norm_precision
from ..errors import ModelRefused
from .base import Capture, LayerRule, PerSampleGrad


class EmbeddingGrad(PerSampleGrad):
    def __init__(self, ids: torch.Tensor, grad: torch.Tensor, num_embeddings: int,
                 padding_idx: int | None):
        batch = ids.shape[0]
        self.ids = ids.reshape(batch, -1)
        self.grad = grad.reshape(batch, self.ids.shape[1], -1)
        if padding_idx is not None:
            self.grad = self.grad.masked_fill((self.ids == padding_idx)[..., None], 0)
        self.num_embeddings = num_embeddings
        self.padding_idx = padding_idx

    def _rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed gradient row of each distinct (example, id) pair, and that pair's example."""
        batch, positions = self.ids.shape
        example = torch.arange(batch, device=self.ids.device).repeat_interleave(positions)
        keys = example * self.num_embeddings + self.ids.reshape(-1)
        unique_keys, inverse = torch.unique(keys, return_inverse=True)
        grad = as_norm_precision(self.grad.reshape(batch * positions, -1))
        rows = grad.new_zeros(unique_keys.numel(), grad.shape[1]).index_add_(0, inverse, grad)
        return rows, unique_keys // self.num_embeddings

    def sq_norms(self) -> torch.Tensor:
        rows, example = self._rows()
        out = rows.new_zeros(self.ids.shape[0])
        return out.index_add_(0, example, (rows * rows).sum(1))

    def weights_dtype(self) -> torch.dtype:
        return accumulation_dtype(self.grad.dtype)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        # a 16-bit output gradient is scaled in float32 (the product converts it exactly)
        scaled = self.grad * weights.to(accumulation_dtype(self.grad.dtype))[:, None, None]
        padding = -1 if self.padding_idx is None else self.padding_idx
        return torch.ops.aten.embedding_dense_backward(
            scaled, self.ids, self.num_embeddings, padding, False
        )

    def materialize(self) -> torch.Tensor:
        batch, positions = self.ids.shape
        grad = accumulated(self.grad)
        out = grad.new_zeros(batch, self.num_embeddings, grad.shape[-1])
        example = torch.arange(batch, device=self.ids.device)[:, None].expand(batch, positions)
        return out.index_put_((example, self.ids), grad, accumulate=True)


class TableRule(LayerRule):
    """The rules of ``nn.Embedding`` and ``nn.EmbeddingBag``: a table, and the options of both that cannot
    train privately refused."""

    param_names = ("weight",)

    def check(self, module: nn.Module, name: str) -> None:
        check_table(module, name)


def check_table(module: nn.Embedding | nn.EmbeddingBag, name: str) -> None:
    """Refuse the options of ``nn.Embedding`` and ``nn.EmbeddingBag`` that cannot train privately:
    ``scale_grad_by_freq`` (each example's gradient scaled by id counts over the batch), ``sparse`` (private
    gradients are dense) and ``max_norm``, which rescales, in the forward, the table rows of the batch's ids
    in place: an update of the parameters that depends on the private batch and is never noised."""
    kind = "embedding bag" if isinstance(module, nn.EmbeddingBag) else "embedding"
    if module.scale_grad_by_freq:
        raise ModelRefused(
            f"{kind} '{name}' has scale_grad_by_freq=True, which scales each example's gradient by id "
            "counts over the whole batch (it mixes examples); set scale_grad_by_freq=False")
    if module.sparse:
        raise ModelRefused(f"{kind} '{name}' has sparse=True; private gradients are dense (noise touches "
                           "every row), so set sparse=False")
    if module.max_norm is not None:
        raise ModelRefused(
            f"{kind} '{name}' has max_norm={module.max_norm}: its forward rescales in place the rows of "
            "the ids in the batch, a change of the parameters that depends on the private batch and is "
            "not noised; set max_norm=None (bound the embeddings in the forward instead, e.g. with a "
            "LayerNorm after the embedding)")


class EmbeddingRule(TableRule):
    """Ids in any dimension declared for the layer (``batch_dim``), batch-first by default."""

    module_types = (nn.Embedding,)
    takes_declared_dim = True
    takes_16_bit_grads = True
    reads_parameters = False

    def per_sample_grads(
        self, module: nn.Module, capture: Capture, grad_outputs: list[torch.Tensor | None],
        params: dict[str, nn.Parameter],
    ) -> dict[str, PerSampleGrad]:
        ids = capture.args[0]
        if ids.dim() < 1:
            raise ValueError("nn.Embedding got ids without a batch dimension")
        return {"weight": EmbeddingGrad(ids, grad_outputs[0], module.num_embeddings,
                                        module.padding_idx)}
