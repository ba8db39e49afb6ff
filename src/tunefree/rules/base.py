"""What a layer rule hands to the engine: one per-sample gradient per parameter, in a lazy form.

A :class:`PerSampleGrad` stands for the B per-sample gradients of one parameter in one call of a module.
The engine asks it for the per-sample squared norms first (to compute clip weights), then for the weighted
sum ``Σᵢ wᵢ gᵢ`` (book-keeping), or — when a parameter is used more than once in a step — for the
materialised per-sample gradients, which it sums over the uses before taking norms. When a clip group is
complete the moment a parameter arrives (per-layer groups), the engine asks for both at once
(:meth:`PerSampleGrad.clipped_sum`), so that a form can apply the clip weights in the same pass that
forms the sum.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from ..dtypes import norm_dtype
from .layout import CallLayout, uniform_layout
from .paths import PathChooser


def materialised_sq_norms(grads: torch.Tensor) -> torch.Tensor:
    """``‖gᵢ‖²`` of per-sample gradients ``[B, *shape]`` in float32 or wider, in one reduction pass
    (no squared copy of the gradients)."""
    if grads.numel() == 0:
        return grads.new_zeros(grads.shape[0], dtype=norm_dtype(grads.dtype))
    return torch.linalg.vector_norm(grads.flatten(1), dim=1, dtype=norm_dtype(grads.dtype)).square()


class ClippedSum(NamedTuple):
    """A parameter's clipped sum ``Σᵢ wᵢ gᵢ``, its per-sample squared norms ``‖gᵢ‖²`` and the clip
    weights ``wᵢ`` that were applied (the group's other parameters must get the same ones)."""

    total: torch.Tensor
    sq_norms: torch.Tensor
    weights: torch.Tensor


class PerSampleGrad(ABC):
    """The per-sample gradients ``g₁ … g_B`` of one parameter in one module call.

    ``chooser`` (set by the engine) picks, for forms with two exact norm paths, the faster one by
    measurement; without it they follow their cost formula.
    """

    chooser: PathChooser | None = None

    @abstractmethod
    def sq_norms(self) -> torch.Tensor:
        """``‖gᵢ‖²`` for each example, shape ``[B]``, in float32 or wider."""

    @abstractmethod
    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """``Σᵢ wᵢ gᵢ`` with the parameter's shape."""

    @abstractmethod
    def materialize(self) -> torch.Tensor:
        """All per-sample gradients, shape ``[B, *param.shape]``."""

    def weights_dtype(self) -> torch.dtype | None:
        """The dtype :meth:`weighted_sum` converts the (float64) clip weights to, if any: the engine hands
        them over in it, converted once per clip group and dtype rather than once per parameter."""
        return None

    def clipped_sum(self, other_sq_norms: torch.Tensor,
                    weights_of: Callable[[torch.Tensor], torch.Tensor]) -> ClippedSum:
        """``Σᵢ wᵢ gᵢ`` with ``wᵢ = weights_of(‖gᵢ‖² + other_sq_normsᵢ)``: the clip weight of each
        example from its squared norm over the whole clip group (``other_sq_norms``: the group's other
        parameters). ``weights_of`` acts on each example's entry alone, so a form may apply it to
        slices of examples."""
        sq_norms = self.sq_norms()
        weights = weights_of(sq_norms + other_sq_norms)
        return ClippedSum(self.weighted_sum(weights), sq_norms, weights)

    def compact(self) -> None:  # noqa: B027 - optional hook, most forms have nothing to drop
        """Drop whatever is not needed for :meth:`weighted_sum` (called before the object is kept
        until the end of the backward pass)."""


class Materialized(PerSampleGrad):
    """Per-sample gradients held explicitly as a ``[B, *shape]`` tensor."""

    def __init__(self, grads: torch.Tensor):
        self.grads = grads

    def sq_norms(self) -> torch.Tensor:
        return materialised_sq_norms(self.grads)

    def weights_dtype(self) -> torch.dtype:
        return self.grads.dtype

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        grads = self.grads
        return (weights.to(grads.dtype)[None] @ grads.reshape(grads.shape[0], -1)).view(grads.shape[1:])

    def materialize(self) -> torch.Tensor:
        return self.grads


@dataclass
class Capture:
    """What a module call left behind in the forward pass for its rule: positional and keyword
    inputs as the module received them."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class LayerRule(ABC):
    """Per-sample gradients of the parameters a module owns directly, from its inputs and the
    gradient of its output.

    A rule serves modules of ``module_types`` (``isinstance``) that keep the base class's ``forward``;
    ``param_names`` lists the parameters it knows how to handle. A module with other trainable
    parameters, or an overridden ``forward``, goes to the generic fallback instead.

    Where a call's tensors carry the examples (its :class:`~.layout.CallLayout`): layers whose tensors
    may carry them in any dimension (``takes_declared_dim``: ``nn.Linear``, ``nn.Embedding``, the
    token-wise norms) use the dimension the user declared for them (``batch_dim``, 0 by default), and
    receive their inputs and output gradients batch-first; other layers fix it by their type and
    configuration: dimension 0 by default (torch's convention: convolutions, GroupNorm), or their own
    :meth:`layout` (recurrent layers, ``nn.EmbeddingBag``). Their output gradients always arrive
    batch-first; only rules with one example dimension (:meth:`example_dim`) get their inputs so.

    Capability flags, read by the engine and the parallel paths (never a list of rules kept elsewhere):
    ``takes_declared_dim`` (above) and ``reads_parameters``: the per-sample gradients need the
    parameters' values (False: the inputs and output gradients alone, so FSDP2 may hold the parameters
    sharded while they are computed).
    """

    module_types: tuple[type[nn.Module], ...] = ()
    param_names: tuple[str, ...] = ("weight", "bias")
    takes_declared_dim: bool = False
    # The rule takes 16-bit output gradients as they arrive and converts them to float32 itself wherever
    # it computes (``dtypes.working_dtype``: the same values as converting them first), so that the engine
    # keeps them in half the memory. Otherwise the engine converts them on arrival.
    takes_16_bit_grads: bool = False
    reads_parameters: bool = True

    def example_dim(self, module: nn.Module, declared: int) -> int | None:
        """The dimension in which every tensor of this layer's calls carries the examples, given the
        one declared for it; ``None`` when they carry them in different places (see :meth:`layout`).
        The engine expands an input shared by all examples (one row there, no example data) only
        along it."""
        return declared if self.takes_declared_dim else 0

    def layout(self, module: nn.Module, args: tuple, kwargs: dict, num_outputs: int,
               declared: int) -> CallLayout:
        """Where this call's inputs (each leaf of ``tree_flatten((args, kwargs))``) and its
        floating-point tensor outputs carry the examples."""
        dim = self.example_dim(module, declared)
        if dim is None:
            raise NotImplementedError(f"{type(self).__name__} has no single example dimension: it must "
                                      "define layout()")
        return uniform_layout(args, kwargs, num_outputs, dim)

    def check(self, module: nn.Module, name: str) -> None:  # noqa: B027 - most rules accept all
        """Raise a clear error when this module's configuration mixes examples."""

    @abstractmethod
    def per_sample_grads(
        self, module: nn.Module, capture: Capture, grad_outputs: list[torch.Tensor | None],
        params: dict[str, nn.Parameter],
    ) -> dict[str, PerSampleGrad]:
        """Per-sample gradients of ``params`` (name → parameter, direct attributes of ``module``)
        given the captured inputs and the gradient of each tensor output (``None`` when unused),
        output gradients batch-first (in float32 or wider unless ``takes_16_bit_grads``)."""
