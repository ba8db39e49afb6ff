"""The one public door for extending tunefree from your own code (docs/extending.md: how, with examples).

Layer rules (``register_rule``; every rule must be exact: check it against a batch-size-1 autograd loop),
modules that mix examples (:func:`register_example_mixing`: refused), clip functions
(``register_clip_function``: ``weigh`` runs one example at a time, and a function that breaks
``wᵢ·‖gᵢ‖ ≤ R`` on a grid of norms is refused), groupings (``register_grouping``) and step components
(:class:`StepComponent`: a value computed from private data leaves only through ``step.release``, noised
and recorded in the ledger; its releases are declared ahead by a :class:`Share`).
"""

from __future__ import annotations

from torch import nn

from .clipping.functions import ClipFunction, register_clip_function
from .clipping.groups import register_grouping
from .persample.units import SAMPLE_MIXING
from .privacy.plan import Share
from .rules import register_rule
from .rules.base import Capture, LayerRule, Materialized, PerSampleGrad
from .step.component import StepComponent, StepContext, StepReport, UpdateControl

__all__ = ["Capture", "ClipFunction", "LayerRule", "Materialized", "PerSampleGrad", "Share", "StepComponent",
           "StepContext", "StepReport", "UpdateControl", "register_clip_function", "register_example_mixing",
           "register_grouping", "register_rule"]


def register_example_mixing(module_type: type[nn.Module], replacement: str) -> None:
    """Refuse every ``module_type`` in a private model: its output for one example depends on the other
    examples of the batch, so no per-example gradient bounds an example's influence. ``replacement``
    is the fix the refusal suggests (e.g. ``"nn.GroupNorm"``)."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_example_mixing takes an nn.Module subclass, got {module_type!r}")
    SAMPLE_MIXING[module_type] = replacement
