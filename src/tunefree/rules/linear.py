"""``nn.Linear`` on inputs of any rank ≥ 2: ``[B, *, d_in]``, every middle position a token (the examples in
the dimension declared for the layer, handed to the rule batch-first). The per-sample weight gradient is
``Σₜ bₜ aₜᵀ`` (output gradient times input): the factored form, ghost norm or materialised, whichever is
cheaper. A layer storing its weight transposed, ``[d_in, d_out]`` (Hugging Face's ``Conv1D``,
``hf_conv1d.py``), is the same rule with the two factors swapped (``transposed``)."""

from __future__ import annotations

import torch
from torch import nn

from ..dtypes import accumulated
from .base import Capture, LayerRule, Materialized, PerSampleGrad
from .factored import FactoredGrad


class LinearRule(LayerRule):
    module_types = (nn.Linear,)
    reads_parameters = False
    takes_declared_dim = True
    takes_16_bit_grads = True
    transposed = False  # the weight is stored as [d_in, d_out]: its gradient is Σₜ aₜ bₜᵀ

    def per_sample_grads(
        self, module: nn.Module, capture: Capture, grad_outputs: list[torch.Tensor | None],
        params: dict[str, nn.Parameter],
    ) -> dict[str, PerSampleGrad]:
        x, grad = capture.args[0], grad_outputs[0]
        if x.dim() < 2:
            raise ValueError(
                f"{type(module).__name__} got an input without a batch dimension; tunefree needs inputs "
                "shaped [batch, ..., features]"
            )
        batch = x.shape[0]
        a = x.reshape(batch, 1, -1, x.shape[-1])
        b = grad.reshape(batch, 1, -1, grad.shape[-1])
        out: dict[str, PerSampleGrad] = {}
        if "weight" in params:
            out["weight"] = FactoredGrad(*((b, a) if self.transposed else (a, b)), module.weight.shape)
        if "bias" in params:
            out["bias"] = Materialized(accumulated(b).sum((1, 2)))
        return out
