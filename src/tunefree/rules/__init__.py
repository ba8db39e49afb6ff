"""Layer rules: per-sample gradients of the parameters a module owns, one file per layer family.

``rule_for(module)`` finds the rule by ``isinstance``; a module whose class overrides the base class's
``forward``, or that owns parameters its rule does not know, gets ``None`` and goes to the generic
``torch.func`` fallback (``generic.py``), so no trainable parameter is ever left out. Where each call's
tensors carry the examples is its layout (``layout.py``).
"""

from __future__ import annotations

from torch import nn

from .base import Capture, LayerRule, Materialized, PerSampleGrad
from .cells import CellRule
from .conv import ConvRule
from .embedding import EmbeddingRule
from .embedding_bag import EmbeddingBagRule
from .generic import fallback_per_sample_grads, known_layout
from .hf_conv1d import HFConv1DRule
from .linear import LinearRule
from .norms import GroupNormRule, InstanceNormRule, LayerNormRule, RMSNormRule
from .recurrent import RecurrentRule

RULES: tuple[LayerRule, ...] = (
    LinearRule(), ConvRule(), EmbeddingRule(), LayerNormRule(), GroupNormRule(), RMSNormRule(),
    InstanceNormRule(), RecurrentRule(), CellRule(), EmbeddingBagRule(), HFConv1DRule(),
)


def rule_for(module: nn.Module, trainable_names: set[str]) -> LayerRule | None:
    """The rule for ``module``, given the names of its direct trainable parameters, or ``None``."""
    for rule in RULES:
        for base in rule.module_types:
            if isinstance(module, base):
                same_forward = type(module).forward is base.forward
                known = trainable_names <= set(rule.param_names)
                return rule if same_forward and known else None
    return None


__all__ = [
    "Capture", "LayerRule", "Materialized", "PerSampleGrad", "RULES", "rule_for",
    "fallback_per_sample_grads", "known_layout",
]
