"""Layer rules: per-sample gradients of the parameters a module owns, one file per layer family.

``rule_for(module)`` finds the rule by ``isinstance`` among the registered rules, the latest registered
first (so that a rule for a subclass, registered after its base's, wins); a module whose class overrides
the base class's ``forward``, or that owns parameters its rule does not know, gets ``None`` and goes to
the generic ``torch.func`` fallback (``generic.py``), so no trainable parameter is ever left out. Where each
call's tensors carry the examples is its layout (``layout.py``). :func:`register_rule` adds a rule
(``tunefree.extend`` is its public door); the built-in ones are registered below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
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

# The registered rules, the latest first.
RULES: list[LayerRule] = []

GradFunction = Callable[[nn.Module, Capture, list], dict[str, Any]]


class FunctionRule(LayerRule):
    """A rule given as one function ``fn(module, capture, grad_outputs)`` returning each parameter's
    per-sample gradients (``[batch, *shape]`` tensors, or :class:`PerSampleGrad` forms) by name."""

    def __init__(self, module_types: tuple[type[nn.Module], ...], function: GradFunction,
                 param_names: Sequence[str], reads_parameters: bool, takes_declared_dim: bool):
        self.module_types, self.function = module_types, function
        self.param_names = tuple(param_names)
        self.reads_parameters, self.takes_declared_dim = reads_parameters, takes_declared_dim

    def per_sample_grads(self, module: nn.Module, capture: Capture, grad_outputs: list[torch.Tensor | None],
                         params: dict[str, nn.Parameter]) -> dict[str, PerSampleGrad]:
        grads = self.function(module, capture, grad_outputs)
        missing = set(params) - set(grads)
        if missing:
            raise ValueError(f"the rule {self.function.__name__} for {type(module).__name__} gave no "
                             f"per-sample gradient for {sorted(missing)}")
        return {name: grad if isinstance(grad, PerSampleGrad) else Materialized(grad)
                for name, grad in grads.items() if name in params}


def register_rule(rule: Any, *more_types: type[nn.Module], param_names: Sequence[str] = ("weight", "bias"),
                  reads_parameters: bool = True, takes_declared_dim: bool = False) -> Any:
    """Register a layer rule; it serves the modules of its types from then on (for models made private
    afterwards).

    - ``@register_rule`` on a :class:`LayerRule` subclass (its flags are class attributes), or
      ``register_rule(rule_instance)``;
    - ``@register_rule(ModuleType, ..., param_names=..., reads_parameters=..., takes_declared_dim=...)``
      on a function ``fn(module, capture, grad_outputs)`` returning each parameter's per-sample gradients,
      ``[batch, *shape]``, by name (inputs and output gradients arrive batch-first).

    ``reads_parameters=False`` declares that the gradients come from the inputs and output gradients
    alone (FSDP2 may then hold the parameters sharded); ``takes_declared_dim=True`` that the layer's
    tensors carry the examples wherever the user's ``batch_dim`` says (as ``nn.Linear``), not in
    dimension 0. A type that already has a rule is refused."""
    if isinstance(rule, type) and issubclass(rule, LayerRule):
        _add(rule())
        return rule
    if isinstance(rule, LayerRule):
        _add(rule)
        return rule
    module_types = (rule, *more_types)
    if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in module_types):
        raise TypeError("register_rule takes a LayerRule (class or instance), or the nn.Module types a rule "
                        f"function serves; got {module_types!r}")

    def register(function: GradFunction) -> GradFunction:
        _add(FunctionRule(module_types, function, param_names, reads_parameters, takes_declared_dim))
        return function
    return register


def _add(rule: LayerRule) -> None:
    for existing in RULES:
        taken = set(existing.module_types) & set(rule.module_types)
        if taken:
            raise ValueError(f"{sorted(t.__name__ for t in taken)} already have a layer rule "
                             f"({type(existing).__name__})")
    RULES.insert(0, rule)


for _rule in (LinearRule(), ConvRule(), EmbeddingRule(), LayerNormRule(), GroupNormRule(), RMSNormRule(),
              InstanceNormRule(), RecurrentRule(), CellRule(), EmbeddingBagRule(), HFConv1DRule()):
    register_rule(_rule)


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
    "Capture", "FunctionRule", "LayerRule", "Materialized", "PerSampleGrad", "RULES", "register_rule",
    "rule_for", "fallback_per_sample_grads", "known_layout",
]
