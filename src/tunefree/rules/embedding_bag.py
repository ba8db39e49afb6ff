"""``nn.EmbeddingBag``: every bag is one example, in the 2-D form (one row of ids per bag) or the 1-D form
(ids cut into bags by ``offsets``, with or without ``include_last_offset``), in every mode.

A bag's gradient touches the rows of its ids: ``sum`` adds the output gradient (times each id's
``per_sample_weights``) to each id's row, ``mean`` adds it divided by the bag's number of ids, ``max`` adds
each feature's gradient to the row that won that feature (the indices the forward kernel picks: of tied
values, the first in the bag, as autograd's). Ids equal to ``padding_idx`` take no part. Each contribution
is an entry (example, row, column, value); norms come from summing the entries of each (example, row) pair,
and no ``[B, V, D]`` tensor is built except to materialise.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..dtypes import as_norm_precision
from ..errors import PrivacyError
from .base import Capture, PerSampleGrad
from .embedding import TableRule
from .layout import CallLayout, Dim, Segments, Structure

_MODES = {"sum": 0, "mean": 1, "max": 2}


class RowEntriesGrad(PerSampleGrad):
    """Per-sample gradients of a ``[V, D]`` table given as entries: example ``example[e]`` adds
    ``value[e]`` at ``(row[e], column[e])``."""

    def __init__(self, example: torch.Tensor, row: torch.Tensor, column: torch.Tensor, value: torch.Tensor,
                 batch: int, shape: torch.Size):
        self.example, self.row, self.column, self.value = example, row, column, value
        self.batch, self.shape = batch, shape

    def sq_norms(self) -> torch.Tensor:
        keys = self.example * self.shape[0] + self.row
        unique, inverse = torch.unique(keys, return_inverse=True)
        value = as_norm_precision(self.value)
        rows = value.new_zeros(unique.numel(), self.shape[1]).index_put_((inverse, self.column), value,
                                                                         accumulate=True)
        out = value.new_zeros(self.batch)
        return out.index_add_(0, unique // self.shape[0], (rows * rows).sum(1))

    def weights_dtype(self) -> torch.dtype:
        return self.value.dtype

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        scaled = self.value * weights.to(self.value.dtype)[self.example]
        return self.value.new_zeros(self.shape).index_put_((self.row, self.column), scaled, accumulate=True)

    def materialize(self) -> torch.Tensor:
        out = self.value.new_zeros(self.batch, *self.shape)
        return out.index_put_((self.example, self.row, self.column), self.value, accumulate=True)


def _call(module: nn.Module, args: tuple, kwargs: dict):
    bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    return bound["input"], bound.get("offsets"), bound.get("per_sample_weights")


def _bags(module: nn.EmbeddingBag, ids: torch.Tensor, offsets: torch.Tensor | None):
    """Flat ids, and where each bag starts and ends in them."""
    if ids.dim() == 2:
        batch, width = ids.shape
        starts = torch.arange(batch, device=ids.device) * width
        return ids.reshape(-1), starts, starts + width
    if ids.dim() != 1 or offsets is None:
        raise PrivacyError(f"nn.EmbeddingBag got ids of shape {tuple(ids.shape)} without offsets; pass a "
                           "batch of bags: ids [B, L], or 1-D ids with offsets [B]")
    if module.include_last_offset:
        return ids, offsets[:-1], offsets[1:]
    return ids, offsets, torch.cat([offsets[1:], offsets.new_tensor([ids.numel()])])


class EmbeddingBagRule(TableRule):
    module_types = (nn.EmbeddingBag,)

    def example_dim(self, module: nn.Module, declared: int) -> int | None:
        return None

    def layout(self, module: nn.Module, args: tuple, kwargs: dict, num_outputs: int,
               declared: int) -> CallLayout:
        ids, offsets, weights = _call(module, args, kwargs)
        if ids.dim() == 1 and offsets is not None:
            _, starts, ends = _bags(module, ids, offsets)
            per_id = Segments(starts, ends)
        else:
            per_id = Dim(0)
        names = list(inspect.signature(module.forward).parameters)
        axis_of = {"input": per_id, "offsets": Structure(), "per_sample_weights": per_id}
        values = [*zip(names, args), *kwargs.items()]
        return CallLayout(tuple(axis_of[n] if isinstance(v, torch.Tensor) else None for n, v in values),
                          (Dim(0),) * num_outputs)

    def per_sample_grads(
        self, module: nn.Module, capture: Capture, grad_outputs: list[torch.Tensor | None],
        params: dict[str, nn.Parameter],
    ) -> dict[str, PerSampleGrad]:
        ids, offsets, weights = _call(module, capture.args, capture.kwargs)
        grad = grad_outputs[0]
        flat, starts, ends = _bags(module, ids, offsets)
        batch, width = grad.shape
        if module.mode == "max":
            example, row, value = _max_entries(module, flat, ids, offsets, grad)
            column = torch.arange(width, device=grad.device).repeat(batch)
        else:
            example, row, scale = _sum_entries(module, flat, starts, ends, weights, grad.dtype)
            value = (scale[:, None] * grad[example]).reshape(-1)
            column = torch.arange(width, device=grad.device).repeat(example.numel())
            example, row = example.repeat_interleave(width), row.repeat_interleave(width)
        return {"weight": RowEntriesGrad(example, row, column, value, batch, module.weight.shape)}


def _sum_entries(module: nn.EmbeddingBag, flat: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                 weights: torch.Tensor | None, dtype: torch.dtype):
    """Each id that takes part: its bag, its row, and the factor (in ``dtype``) of its bag's output
    gradient."""
    position = torch.arange(flat.numel(), device=flat.device)
    example = torch.bucketize(position, starts, right=True) - 1
    keep = (example >= 0) & (position < ends[example.clamp(min=0)])
    if module.padding_idx is not None:
        keep &= flat != module.padding_idx
    example, row = example[keep], flat[keep]
    if module.mode == "sum":
        scale = torch.ones(row.shape, device=flat.device) if weights is None else weights.reshape(-1)[keep]
    else:
        counts = torch.bincount(example, minlength=starts.numel())
        scale = 1.0 / counts[example].to(dtype)
    return example, row, scale.to(dtype)


def _max_entries(module: nn.EmbeddingBag, flat: torch.Tensor, ids: torch.Tensor,
                 offsets: torch.Tensor | None, grad: torch.Tensor):
    """Each feature of each non-empty bag: its bag, the row that won it in the forward, its gradient."""
    if ids.dim() == 2:
        offsets = torch.arange(ids.shape[0], device=ids.device) * ids.shape[1]
    # the forward's own kernel, so that ties go where autograd sends them (the first of equal values);
    # padding_idx as the module holds it: None, not -1, which the kernel takes as the last row
    _, _, bag_size, max_rows = torch.embedding_bag(
        module.weight.detach(), flat, offsets, False, _MODES["max"], False, None,
        module.include_last_offset and ids.dim() == 1, module.padding_idx)
    batch, width = grad.shape
    example = torch.arange(batch, device=grad.device).repeat_interleave(width)
    value = grad.reshape(-1) * (bag_size > 0).repeat_interleave(width).to(grad.dtype)
    return example, max_rows.reshape(-1).clamp(min=0), value
