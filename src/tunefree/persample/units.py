"""What the engine hooks, and what it knows of the current forward/backward pass.

A *unit* is a module that owns trainable parameters, with its layer rule (``rules/``) and the dimension its
tensors carry the examples in; a *use* is one call of a unit in the current forward pass, with its captured
inputs and the output gradients as they arrive; the *pass state* is all the engine's hooks share about the
current pass (``capture.py``, ``amp.py`` and ``booking.py`` are functions of it), made anew for every
forward pass that trains.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import ModelRefused
from ..rules import Capture, LayerRule, PerSampleGrad, rule_for
from ..rules.layout import CallLayout
from .layout import DeclaredDims, call_layout, example_dim
from .parametrized import check_parametrized

# Modules whose statistics mix the examples of a batch, with the replacement to suggest (add one with
# tunefree.extend.register_example_mixing).
SAMPLE_MIXING: dict[type[nn.Module], str] = {
    nn.modules.batchnorm._BatchNorm: "nn.GroupNorm (or nn.LayerNorm)",
}


@dataclass(eq=False)
class Unit:
    """A module the engine hooks, with the trainable parameters it answers for.

    ``rule`` units answer for their direct parameters. Fallback units (``rule is None``) answer for
    their direct parameters and for the parameters of descendant units that do not run during the call
    (e.g. ``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``).
    """

    name: str
    module: nn.Module
    rule: LayerRule | None
    direct: dict[str, nn.Parameter]
    descendants: list[Unit] = field(default_factory=list)
    declared_dim: int = 0  # the example dimension declared for it (batch_dim), for layers that take one
    example_dim: int | None = 0  # the one dimension all its tensors carry the examples in, if any

    _plain: dict[tuple[int, int], CallLayout] = field(default_factory=dict)  # layouts of plain calls

    def layout(self, args: tuple, kwargs: dict, num_outputs: int) -> CallLayout:
        """Where this call's inputs and floating-point outputs carry the examples (for a plain call of
        a layer with one example dimension, made once per number of inputs and outputs)."""
        plain = self.rule is not None and self.example_dim is not None and not kwargs \
            and all(isinstance(x, torch.Tensor) for x in args)
        key = (len(args), num_outputs)
        if not plain or key not in self._plain:
            layout = call_layout(self.module, self.rule, self.declared_dim, args, kwargs, num_outputs)
            if not plain:
                return layout
            self._plain[key] = layout
        return self._plain[key]

    def subtree_params(self) -> dict[nn.Parameter, None]:
        params = dict.fromkeys(self.direct.values())
        for unit in self.descendants:
            params.update(dict.fromkeys(unit.direct.values()))
        return params


@dataclass(eq=False)
class Use:
    """One call of a unit in the current forward pass."""

    unit: Unit
    capture: Capture
    layout: CallLayout
    params: dict[str, nn.Parameter]  # names as the rule (or torch.func) sees them
    versions: list[tuple[torch.Tensor, int]]
    n_outputs: int
    grads: list[torch.Tensor | None]
    anchor_node: Any = None  # the anchor's node in this call's graph (see capture.EnableGrad)
    autocast: tuple[str, torch.dtype] | None = None  # the call's autocast, replayed by the fallback
    received: int = 0
    done: bool = False
    superseded: bool = False  # a later forward pass replaced this one before any backward


@dataclass(eq=False)
class Frame:
    """A unit call in progress in the forward pass."""

    unit: Unit
    saved: list[tuple[nn.Parameter, bool]]  # requires_grad flags to restore after the call
    fired: set[Unit] = field(default_factory=set)  # units called inside it (for fallback units)
    reads: TorchFunctionMode | None = None  # parameters its own code reads (capture.ParameterReads)


@dataclass(eq=False)
class PassState:
    """Everything the engine knows about the current forward/backward pass."""

    uses: list[Use] = field(default_factory=list)
    pending: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # group → uses not yet done
    uses_of: dict[nn.Parameter, int] = field(default_factory=lambda: defaultdict(int))
    per_param: dict[nn.Parameter, PerSampleGrad] = field(default_factory=dict)
    sq_norms: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)
    clipped_groups: set[str] = field(default_factory=set)
    finite_checks: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)
    fallback_stack: list[Frame] = field(default_factory=list)
    batch: int | None = None  # examples of this pass, once checked
    call_examples: int | None = None  # examples of the model call (without a loader)
    batch_storages: set[int] = field(default_factory=set)  # storages of the model call's inputs
    model_storages: set[int] = field(default_factory=set)  # storages of parameters and buffers
    in_backward: bool = False
    in_hook: bool = False  # the engine's own forward hooks are running (not the model's code)
    loss_scale: float = 1.0  # the GradScaler factor of this backward pass's loss
    input_refusal: str | None = None  # why the model call's inputs must not train (InputProvenance)


def check_model(model: nn.Module) -> None:
    """Refuse compiled models and modules that mix examples, with the fix to use."""
    check_parametrized(model)  # a weight computed from other parameters: the true reason (issue 29.8)
    if any(type(module).__name__ == "OptimizedModule" for module in model.modules()):
        raise ModelRefused(
            "the model (or one of its modules) was compiled with torch.compile before make_private; "
            "compiled code bypasses the hooks that clip each example's gradient: call make_private "
            "on the plain model"
        )
    for name, module in model.named_modules():
        for kind, fix in SAMPLE_MIXING.items():
            if isinstance(module, kind):
                raise ModelRefused(
                    f"'{name or type(model).__name__}' is a {type(module).__name__}, which mixes "
                    f"the examples of a batch (its statistics, and so each example's gradient, depend "
                    f"on the other examples); replace it with {fix}"
                )


def attention_dropout(name: str, p: float) -> str:
    """Why an ``nn.MultiheadAttention`` with dropout is refused, and the fix."""
    return (f"'{name}' (MultiheadAttention) has dropout={p}: it draws random numbers inside its own forward "
            "(the attention weights' dropout), and tunefree computes its per-example gradients by re-running "
            "it one example at a time (torch.func.vmap), which cannot replay that draw: set its probability "
            f"to 0 after building the model, model.get_submodule('{name}').dropout = 0.0 (in "
            "nn.TransformerEncoderLayer or DecoderLayer, layer.self_attn.dropout = 0.0; the layer's other "
            "dropouts act outside the attention and stay)")


def build_units(model: nn.Module, declared: DeclaredDims | None = None) -> list[Unit]:
    """One unit per module that directly owns trainable parameters, each with the example dimension
    declared for it (``batch_dim``)."""
    check_model(model)
    declared = declared or DeclaredDims.of(model, 0)
    units: dict[nn.Module, Unit] = {}
    for name, module in model.named_modules():
        direct = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        if not direct:
            continue
        rule = rule_for(module, set(direct))
        if rule is not None:
            rule.check(module, name or "(root)")
        elif isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
            raise ModelRefused(attention_dropout(name or "(root)", module.dropout))
        elif module._forward_hooks or module._forward_pre_hooks:
            raise ModelRefused(
                f"module '{name or '(root)'}' ({type(module).__name__}) has forward hooks registered "
                "before make_private, and no layer rule: tunefree re-runs such a module one example at "
                "a time and cannot replay what a hook does to it; remove the hook, or register it on "
                "a module that has no trainable parameters of its own (a parent or a wrapper)"
            )
        declared.check_fixed(name, module, rule)
        dim = declared.of_module(name)
        units[module] = Unit(name=name or "(root)", module=module, rule=rule, direct=direct,
                             declared_dim=dim, example_dim=example_dim(module, rule, dim))
    for module, unit in units.items():
        if unit.rule is None:
            unit.descendants = [units[m] for m in module.modules() if m is not module and m in units]
    return list(units.values())
