"""Hugging Face ``Conv1D`` (GPT-2, GPT, …): a linear layer with its weight stored as ``[d_in, d_out]``.

``y = x W + b`` on inputs ``[B, *, d_in]``, every middle position a token. The per-sample weight gradient
is ``Σₜ aₜ bₜᵀ`` (input times output gradient), the transpose of ``nn.Linear``'s, so it is the factored
form with the roles of the two factors swapped: ghost norm or materialised, whichever is cheaper.

The rule serves the class only once ``transformers`` is imported (a model that holds a ``Conv1D`` has
imported it); tunefree never imports ``transformers`` itself.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..dtypes import accumulated
from .base import Capture, LayerRule, Materialized, PerSampleGrad
from .factored import FactoredGrad


def _conv1d_class() -> type[nn.Module] | None:
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


class HFConv1DRule(LayerRule):
    takes_declared_dim = True
    takes_16_bit_grads = True
    reads_parameters = False

    @property
    def module_types(self) -> tuple[type[nn.Module], ...]:  # type: ignore[override]
        conv1d = _conv1d_class()
        return () if conv1d is None else (conv1d,)

    def per_sample_grads(
        self, module: nn.Module, capture: Capture, grad_outputs: list[torch.Tensor | None],
        params: dict[str, nn.Parameter],
    ) -> dict[str, PerSampleGrad]:
        x, grad = capture.args[0], grad_outputs[0]
        if x.dim() < 2:
            raise ValueError(
                "Conv1D got an input without a batch dimension; tunefree needs inputs shaped "
                "[batch, ..., features]"
            )
        batch = x.shape[0]
        a = x.reshape(batch, 1, -1, x.shape[-1])
        b = grad.reshape(batch, 1, -1, grad.shape[-1])
        out: dict[str, PerSampleGrad] = {}
        if "weight" in params:  # Σₜ aₜ bₜᵀ: FactoredGrad's Σₜ bₜ aₜᵀ with the factors swapped
            out["weight"] = FactoredGrad(b, a, module.weight.shape)
        if "bias" in params:
            out["bias"] = Materialized(accumulated(b).sum((1, 2)))
        return out
