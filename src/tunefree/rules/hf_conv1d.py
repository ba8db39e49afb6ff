"""Hugging Face ``Conv1D`` (GPT-2, GPT, …): a linear layer with its weight stored as ``[d_in, d_out]``,
``y = x W + b``; :class:`~.linear.LinearRule` with the two factors of its gradient swapped.

The rule serves the class only once ``transformers`` is imported (a model that holds a ``Conv1D`` has
imported it); tunefree never imports ``transformers`` itself.
"""

from __future__ import annotations

import sys

from torch import nn

from .linear import LinearRule


def _conv1d_class() -> type[nn.Module] | None:
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


class HFConv1DRule(LinearRule):
    transposed = True

    @property
    def module_types(self) -> tuple[type[nn.Module], ...]:  # type: ignore[override]
        conv1d = _conv1d_class()
        return () if conv1d is None else (conv1d,)
