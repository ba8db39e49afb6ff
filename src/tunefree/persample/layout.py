"""Where each layer call carries its examples: the user's ``batch_dim`` declaration, resolved per module,
and the layout of each call (``rules/layout.py``) that follows from it.

The examples of a batch are known by provenance (the private loader's count), and so is where they sit in a
layer's tensors: by the layer's type and configuration (recurrent layers and ``nn.MultiheadAttention`` by
their ``batch_first``, convolutions and GroupNorm/InstanceNorm in dimension 0 by torch's convention), or,
for layers whose tensors may carry them anywhere (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``,
``nn.RMSNorm``, HF ``Conv1D``, modules of the generic fallback), by the user's declaration: dimension 0 unless
``batch_dim`` says otherwise. Nothing is inferred from shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..rules import LayerRule, known_layout
from ..rules.layout import CallLayout, uniform_layout

BatchDim = int | Mapping[str, int]


def _dim_value(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"batch_dim[{key!r}] must be a dimension (an int ≥ 0), got {value!r}")
    return value


@dataclass(frozen=True)
class DeclaredDims:
    """``batch_dim`` resolved: the dimension of the model's own inputs, and the entries by module name
    (``""``: the model itself, and every module not under a longer entry)."""

    entries: dict[str, int]

    @classmethod
    def of(cls, model: nn.Module, batch_dim: BatchDim) -> DeclaredDims:
        if not isinstance(batch_dim, Mapping):
            return cls({"": _dim_value("", batch_dim)})
        names = {name for name, _ in model.named_modules()}
        entries = {"": 0}
        for key, value in batch_dim.items():
            if not isinstance(key, str) or key not in names:
                raise ValueError(f"batch_dim names {key!r}, which is not a module of the model (its names "
                                 "are those of model.named_modules(); '' is the model itself)")
            entries[key] = _dim_value(key, value)
        return cls(entries)

    @property
    def root(self) -> int:
        """The dimension in which the model's own inputs carry the examples."""
        return self.entries[""]

    def of_module(self, name: str) -> int:
        """The dimension declared for module ``name``: its closest named ancestor's (or its own)."""
        while name not in self.entries:
            name = name.rpartition(".")[0]
        return self.entries[name]

    def check_fixed(self, name: str, module: nn.Module, rule: LayerRule | None) -> None:
        """Refuse an entry naming a layer whose type fixes where its tensors carry the examples
        elsewhere than the entry says."""
        if name not in self.entries or name == "":
            return
        value = self.entries[name]
        fixed = example_dim(module, rule, value)
        if fixed != value:
            where = "in different dimensions for different tensors" if fixed is None else \
                f"in dimension {fixed}"
            raise ValueError(
                f"batch_dim declares dimension {value} for '{name}' ({type(module).__name__}), whose "
                f"tensors carry the examples {where} by its type and configuration (batch_first for "
                "recurrent layers and attention, dimension 0 for convolutions and GroupNorm); drop the "
                "entry (declare batch_dim for layers such as nn.Linear, nn.Embedding, nn.LayerNorm)")


def example_dim(module: nn.Module, rule: LayerRule | None, declared: int) -> int | None:
    """The one dimension in which all of a unit's tensors carry the examples, or ``None`` (attention,
    recurrent layers, bags: their layout places them per tensor)."""
    if rule is not None:
        return rule.example_dim(module, declared)
    return None if isinstance(module, nn.MultiheadAttention) else declared


def call_layout(module: nn.Module, rule: LayerRule | None, declared: int, args: tuple, kwargs: dict,
                num_outputs: int) -> CallLayout:
    """The layout of one call: the rule's, the fallback's known one (attention), or every tensor input
    and output in the declared dimension."""
    if rule is not None:
        return rule.layout(module, args, kwargs, num_outputs, declared)
    known = known_layout(module, args, kwargs, num_outputs)
    if known is not None:
        return known
    return uniform_layout(args, kwargs, num_outputs, declared)


def only_from_batch(layout: CallLayout, leaves: list, from_batch: tuple[bool, ...],
                    examples: int | None) -> CallLayout:
    """A generic fallback call's layout, keeping as per example only the inputs derived from the batch
    that show its examples: every other input (a shared table, a mask) is passed whole."""
    def keep(axis, leaf, derived):
        return axis if derived and isinstance(leaf, torch.Tensor) and axis.examples(leaf) == examples \
            else None
    return CallLayout(tuple(None if axis is None else keep(axis, leaf, derived)
                            for axis, leaf, derived in zip(layout.inputs, leaves, from_batch)),
                      layout.outputs)


def layout_hint(name: str, module: nn.Module, rule: LayerRule | None, dim: int, found: int) -> str:
    """The fix for layer ``name``, read with its examples in dimension ``dim``, whose examples appear to sit
    in dimension ``found``: a declaration for layers that take one, the layer's own setting otherwise."""
    if rule is None or rule.takes_declared_dim:
        key = "" if name == "(root)" else name
        return (f"if this layer's tensors carry the examples in dimension {found} (a time-major layout), "
                f"declare it: make_private(..., batch_dim={{{key!r}: {found}}}) (dimension {dim} is the one "
                "declared for it now; an entry for a parent module covers every layer under it, and "
                f"batch_dim={found} the whole model and its inputs)")
    if hasattr(module, "batch_first"):
        return (f"its batch_first={module.batch_first} puts the examples in dimension {dim}, but they "
                f"appear in dimension {found}: set batch_first={not module.batch_first}, or pass it tensors "
                "in the layout its batch_first says")
    return (f"{type(module).__name__} takes its examples in dimension {dim} (torch's convention), but they "
            f"appear in dimension {found}: move them to dimension {dim} before the call")


def expand_rows(x: torch.Tensor, dim: int, examples: int) -> torch.Tensor:
    """A tensor with one row in dimension ``dim``, expanded (a view) to ``examples`` rows there."""
    shape = list(x.shape)
    shape[dim] = examples
    return x.expand(*shape)


def has_one_row(x: torch.Tensor, dim: int) -> bool:
    return x.dim() > dim and x.shape[dim] == 1

