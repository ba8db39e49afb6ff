"""Parameter groups for clipping: each group's per-sample gradient is clipped to its own threshold.

The total sensitivity of one example's clipped gradient is ``S = √(Σₖ Rₖ²)``; a float ``max_grad_norm``
``R`` is split uniformly as ``Rₖ = R/√K`` so that ``S = R`` whatever the grouping.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

Layout = Callable[[nn.Module], dict[str, list[str]]]

# The registry: grouping name → ``layout(model)``, a dict from group name to parameter names. Add one
# with ``@register_grouping("name")``; ``make_groups`` checks that every trainable parameter is in one group.
GROUPINGS: dict[str, Layout] = {}


def register_grouping(name: str) -> Callable[[Layout], Layout]:
    """Decorator: make ``layout(model)`` usable as ``groups=name``."""
    def register(layout: Layout) -> Layout:
        if name in GROUPINGS:
            raise ValueError(f"grouping {name!r} is already registered")
        GROUPINGS[name] = layout
        return layout
    return register

GroupSpec = str | Sequence[Sequence[str]] | Mapping[str, Sequence[str]]


@dataclass(eq=False, frozen=True)
class ClipGroup:
    """Parameters clipped together under one threshold (the group's share of the sensitivity), as set
    up: a run's current thresholds are per-step state that its private step owns."""

    name: str
    param_names: list[str]
    params: list[nn.Parameter] = field(repr=False)
    threshold: float

    @property
    def size(self) -> int:
        return sum(p.numel() for p in self.params)


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters by their first qualified name (a shared parameter appears once)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def direct_owner(model: nn.Module) -> dict[nn.Parameter, str]:
    """The first module (in ``named_modules`` order) that owns each parameter directly."""
    owner: dict[nn.Parameter, str] = {}
    for module_name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(p, module_name or "(root)")
    return owner


@register_grouping("all-layer")
def _all_layer(model: nn.Module) -> dict[str, list[str]]:
    return {"all": list(trainable_parameters(model))}


@register_grouping("per-layer")
def _per_layer(model: nn.Module) -> dict[str, list[str]]:
    owner = direct_owner(model)
    layout: dict[str, list[str]] = {}
    for name, p in trainable_parameters(model).items():
        layout.setdefault(owner[p], []).append(name)
    return layout


@register_grouping("per-param")
def _per_param(model: nn.Module) -> dict[str, list[str]]:
    return {name: [name] for name in trainable_parameters(model)}


def _layout(model: nn.Module, spec: GroupSpec) -> dict[str, list[str]]:
    if isinstance(spec, str):
        if spec in GROUPINGS:
            return GROUPINGS[spec](model)
        raise ValueError(
            f"unknown groups {spec!r}: use one of {', '.join(GROUPINGS)}, a list of lists of "
            "parameter names, or a dict from group name to parameter names"
        )
    if isinstance(spec, Mapping):
        return {str(k): list(v) for k, v in spec.items()}
    return {f"group{i}": list(names) for i, names in enumerate(spec)}


def make_groups(
    model: nn.Module, spec: GroupSpec, max_grad_norm: float | Mapping[str, float]
) -> list[ClipGroup]:
    """Build the clip groups of ``model`` and check that every trainable parameter is in exactly one.

    ``max_grad_norm`` (validated as a run setting: positive) is the total sensitivity ``R`` (split as
    ``R/√K``), or, for explicit groups, a mapping from group name to that group's own threshold.
    """
    layout = _layout(model, spec)
    thresholds = _thresholds(list(layout), max_grad_norm)
    all_names = dict(model.named_parameters(remove_duplicate=False))
    trainable = trainable_parameters(model)
    seen: dict[nn.Parameter, str] = {}
    groups = []
    for group_name, names in layout.items():
        if not names:
            raise ValueError(f"clip group {group_name!r} has no parameters")
        params = []
        for name in names:
            if name not in all_names:
                raise ValueError(f"clip group {group_name!r} names {name!r}, which is not a "
                                 "parameter of the model (see model.named_parameters())")
            p = all_names[name]
            if not p.requires_grad:
                raise ValueError(f"clip group {group_name!r} names the frozen parameter {name!r}; "
                                 "remove it from the group")
            if p in seen:
                raise ValueError(f"parameter {name!r} is in clip groups {seen[p]!r} and "
                                 f"{group_name!r}; each parameter belongs to exactly one group")
            seen[p] = group_name
            params.append(p)
        groups.append(ClipGroup(group_name, list(names), params, thresholds[group_name]))
    missing = [name for name, p in trainable.items() if p not in seen]
    if missing:
        raise ValueError(
            f"trainable parameters {missing} are in no clip group; add them to a group or freeze "
            "them with requires_grad_(False)"
        )
    return groups


def _thresholds(names: list[str], max_grad_norm: float | Mapping[str, float]) -> dict[str, float]:
    """Each group's threshold: its own from a mapping (which must name exactly the groups), else the
    total ``R`` split as ``R/√K``."""
    if isinstance(max_grad_norm, Mapping):
        unknown, missing = set(max_grad_norm) - set(names), set(names) - set(max_grad_norm)
        if unknown or missing:
            raise ValueError(
                f"max_grad_norm per group must name exactly the groups {names}"
                f" (unknown: {sorted(unknown)}, missing: {sorted(missing)})"
            )
        return {name: float(max_grad_norm[name]) for name in names}
    return {name: float(max_grad_norm) / math.sqrt(len(names)) for name in names}


def sensitivity(groups: Sequence[ClipGroup]) -> float:
    """L2 sensitivity of one example's clipped gradient: ``√(Σₖ Rₖ²)``."""
    return math.sqrt(sum(g.threshold**2 for g in groups))
