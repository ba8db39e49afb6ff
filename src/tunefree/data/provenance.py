"""Provenance of the examples: which batch of the Poisson loader each tensor of the training loop comes from.

Every tensor of a batch the Poisson loader hands out is a :class:`BatchTensor`, and so is every tensor
computed from one (``x.to(device)``, ``x.float() / 255``, a crop, ``x[perm]``): it carries the serial
number of its physical batch and which of the batch's tensors it was computed from. Functions whose
result does not depend on the values (``zeros_like``, ``randn_like``, ``new_ones``…) drop them. The model
call takes them off (the model computes on plain tensors) and learns from them whether it was given the
batch the loader handed out last (``guards/inputs.py``).

On the steps the run checks (``StepSchedule.checking``), each float tensor is handed out as a copy of a
leaf that requires gradients, so that the model call can differentiate its inputs with respect to the
loader's rows; the leaf's gradient is dropped as it arrives, and integer tensors are kept for a check by
value. A tensor computed from the batch without gradients (``torch.no_grad()``, ``.detach()``, NumPy)
keeps its provenance but loses that link.
"""

from __future__ import annotations

import itertools
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import get_default_nowrap_functions, resolve_name
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only

# The index of a tensor that the library hands to the model on the loader's behalf: a pipeline stage's
# input, the previous stage's activations of the batch (checked there).
HANDED_ON = -1
# The index that marks a tensor whose gradient the training loop asked for (``requires_grad_``,
# ``requires_grad = …``, ``retain_grad``), and every tensor computed from it.
WANTS_GRADIENT = -2
_ASKS_FOR_GRADIENT = frozenset({torch.Tensor.requires_grad_, torch.Tensor.requires_grad.__set__,
                                torch.Tensor.retain_grad})

# Functions whose result depends on their input's shape, dtype and device only.
_NOT_DERIVED = frozenset({
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_zeros", "new_ones", "new_empty", "new_full", "as_subclass",
})


class BatchTensor(torch.Tensor):
    """A tensor of a batch handed out by the Poisson loader, or computed from one. ``sources``: the pairs
    (batch serial, index of the batch's tensor) it was computed from."""

    sources: frozenset[tuple[int, int]] = frozenset()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if func in _ASKS_FOR_GRADIENT and isinstance(args[0], BatchTensor):
            args[0].sources = args[0].sources | {(serial, WANTS_GRADIENT) for serial, _ in args[0].sources}
        if func in get_default_nowrap_functions() or not _holds_tensors(result):
            return result
        if _name(func) in _NOT_DERIVED:
            return tree_map_only(BatchTensor, plain, result)
        sources = frozenset().union(*(t.sources for t in tree_flatten((args, kwargs))[0]
                                      if isinstance(t, BatchTensor)))
        return tree_map_only(torch.Tensor, lambda t: tagged(t, sources), result)


def _holds_tensors(result: Any) -> bool:
    if isinstance(result, torch.Tensor):
        return True
    return isinstance(result, (tuple, list)) and not isinstance(result, torch.Size) and any(
        isinstance(t, torch.Tensor) for t in tree_flatten(result)[0])


def _name(func: Any) -> str:
    return (resolve_name(func) or getattr(func, "__name__", "")).rsplit(".", 1)[-1]


def tagged(t: torch.Tensor, sources: frozenset[tuple[int, int]]) -> torch.Tensor:
    """``t`` marked as computed from ``sources`` (a tensor computed in place keeps its own too)."""
    if not sources:
        return t
    if isinstance(t, BatchTensor):
        t.sources = t.sources | sources
        return t
    with torch._C.DisableTorchFunctionSubclass():
        marked = t.as_subclass(BatchTensor)
    marked.sources = sources
    return marked


def plain(t: torch.Tensor) -> torch.Tensor:
    """The same tensor (same memory, same autograd history) without provenance."""
    if not isinstance(t, BatchTensor):
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


def sources_of(t: Any) -> frozenset[tuple[int, int]]:
    return t.sources if isinstance(t, BatchTensor) else frozenset()


@dataclass
class HandedOut:
    """What the loader handed out as physical batch ``serial`` (``examples`` rows). On a checked step:
    ``leaves[i]``, the leaf requiring gradients that float tensor i was copied from, and ``values[i]``,
    a copy of integer tensor i (``None`` elsewhere)."""

    serial: int
    examples: int
    checking: bool
    leaves: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]


def hand_out(batch: Any, serial: int, examples: int, checking: bool) -> tuple[Any, HandedOut]:
    """The batch as the training loop gets it (each tensor a :class:`BatchTensor` of this batch), and
    the record of what was handed out."""
    record = HandedOut(serial, examples, checking, {}, {})
    count = itertools.count()

    def mark(t: torch.Tensor) -> torch.Tensor:
        index = next(count)
        if checking and t.is_floating_point():
            leaf = record.leaves[index] = t.detach().requires_grad_(True)
            leaf.register_post_accumulate_grad_hook(_drop_grad)
            t = leaf.clone()
        elif checking:
            record.values[index] = t.detach().clone()
        return tagged(t, frozenset({(serial, index)}))
    return _map_tensors(batch, mark), record


def handed_on(t: torch.Tensor, serial: int) -> torch.Tensor:
    """``t`` as the library hands it to a model on behalf of the loader's batch ``serial`` (a pipeline
    stage's input, the previous stage's activations): of that batch, its rows not checked here."""
    return tagged(plain(t), frozenset({(serial, HANDED_ON)}))


def _drop_grad(leaf: torch.Tensor) -> None:
    """A backward through the training loop's own computation reached a loader leaf: nothing is kept."""
    leaf.grad = None


def _map_tensors(batch: Any, fn) -> Any:
    """``fn`` applied to every tensor of the batch (nested lists, tuples, dicts and mappings such as a
    tokenizer's ``BatchEncoding``, changed in place)."""
    if isinstance(batch, MutableMapping) and not isinstance(batch, dict):
        for key in list(batch):
            batch[key] = _map_tensors(batch[key], fn)
        return batch
    return tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else
                    _map_tensors(x, fn) if isinstance(x, MutableMapping) and not isinstance(x, dict) else x,
                    batch)
