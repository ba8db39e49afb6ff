"""The model trains on the Poisson loader's examples, each input row derived from its own example alone.

The guarantee is a proof for training on the Poisson sample the loader draws at each step, with each
example's gradient a function of that example. Between the loader and the model runs the user's code; the
engine sees the model's root call, and the loader's tensors say where they came from
(``data/provenance.py``). At every training call of the model (the engine's root forward pre-hook):

- **Every step**: some input must be computed from the physical batch the loader handed out last, and
  none from an earlier one. A loop over another loader, or over a batch kept from an earlier step, is
  refused at its backward pass.
- **Checked steps** (the run's independence checks, ``StepSchedule.checking``): every input computed
  from the batch must have one row per example, and row i may depend on example i alone. Float inputs
  are differentiated with respect to the loader's rows: one vector–Jacobian product per bit of a code
  that gives every row a distinct set of ⌊m/2⌋ of m bits (m the least with C(m, ⌊m/2⌋) ≥ n: 5 products
  for 8 rows, 11 for 256), with cotangents on the rows holding the bit. Any row i whose input depends
  (with a nonzero derivative) on another example's row j is caught with certainty: some bit is i's and
  not j's. The loader's float tensor itself, never written, needs no product. A float
  input computed without gradients must equal the loader's values. Integer inputs are compared by
  value with the loader's integer tensors: a row that holds another example's values at at least half
  of the positions where the two examples differ is refused.

What this cannot see is in docs/refusals.md: mixing through a path without gradients inside a float
input that also carries its own row, integer mixing below half of a row or at shifted positions,
inputs computed from integer data in other shapes, and the Dataset and collate_fn (each example is
read alone; a collate_fn sees the whole batch and is trusted).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from ..data.poisson import StepSchedule
from ..data.provenance import HANDED_ON, WANTS_GRADIENT, HandedOut, plain, sources_of
from ..persample.part_of_batch import part_of_the_batch
from .probe import row_codes

_ROW_FIX = ("transform each example on its own: random crops and flips, casts, normalisation by constants "
            "and padding, per example, are fine (docs/refusals.md shows them)")


class InputProvenance:
    """Checks each training call of the model against what ``schedule``'s Poisson loader handed out."""

    def __init__(self, schedule: StepSchedule):
        self.schedule = schedule

    def model_call(self, args: tuple, kwargs: dict, training: bool, root: int = 0
                   ) -> tuple[tuple, dict, str | None, tuple[bool, ...]]:
        """The call's inputs without their provenance; for a training call, why its backward must not book
        it (``None``: it may); and for each input leaf, whether it was computed from the loader's batch.
        ``root``: the dimension of the model's inputs that carries the examples (``batch_dim``); the
        loader's tensors carry them in that dimension or in dimension 0."""
        with_paths, spec = tree_flatten_with_path((args, kwargs))
        leaves = [leaf for _, leaf in with_paths]
        inputs = [plain(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        sources = [sources_of(leaf) if isinstance(leaf, torch.Tensor) else frozenset() for leaf in leaves]
        refusal = None
        if training:
            named = [(_input_name(path), x, found)
                     for (path, _), x, found in zip(with_paths, inputs, sources)]
            refusal = self._refusal([n for n in named if n[2]], root)
            inputs = [self._unlinked(x, found) for x, found in zip(inputs, sources)]
        args, kwargs = tree_unflatten(inputs, spec)
        return args, kwargs, refusal, tuple(bool(found) for found in sources)

    def _unlinked(self, x: Any, sources: frozenset) -> Any:
        """``x`` without the gradient link to the loader's rows that a checked step's check needed, so
        that the model's backward does not differentiate its inputs; kept when the loop asked for a
        gradient through ``x`` (``requires_grad_``) or ``x`` depends on a tensor of its own that requires
        gradients (the model's output is then the same function of them)."""
        record = self.schedule.handed_out
        if (not isinstance(x, torch.Tensor) or not x.requires_grad or record is None or not record.leaves
                or any(index == WANTS_GRADIENT for _, index in sources)):
            return x
        loader = {id(leaf) for leaf in record.leaves.values()}
        reached = _leaves_reached(x)
        return x.detach() if reached is not None and reached <= loader else x

    def _refusal(self, derived: list[tuple[str, torch.Tensor, frozenset]], root: int) -> str | None:
        record = self.schedule.handed_out
        serials = {serial for _, _, sources in derived for serial, _ in sources}
        if record is None or not derived:
            return _NOT_FROM_THE_LOADER
        if serials != {record.serial}:
            return (f"the model was called for training with inputs computed from batch {min(serials)} of "
                    f"engine.data_loader, but the loader has since handed out batch {record.serial}: each "
                    "step trains on the batch the loader hands out for it. Compute the model's inputs "
                    "from the batch of the current iteration (keep no tensor of an earlier batch)")
        if not record.checking or record.examples < 2:
            return None
        return next(filter(None, (_row_refusal(name, x, sources, record, root)
                                   for name, x, sources in derived)), None)


_NOT_FROM_THE_LOADER = (
    "the model was called for training with inputs that do not come from engine.data_loader: the guarantee "
    "is a proof for training on the Poisson sample that loader draws at every step, and a batch of another "
    "loader (or a tensor made outside the loop) is not that sample. Iterate over engine.data_loader and "
    "compute the model's inputs from its batches; to train on your own loader as it is, pass "
    "poisson_sampling=False to make_private (its guarantee then says it is the Poisson approximation)")


def _input_name(path: tuple) -> str:
    """``args[0]`` → "argument 0", ``kwargs['input_ids']`` → "'input_ids'" (nested parts appended)."""
    where, *rest = path
    head = f"argument {path[1].idx}" if where.idx == 0 else repr(path[1].key)
    return head + keystr(tuple(rest[1:]))


def _row_refusal(name: str, x: Any, sources: frozenset, record: HandedOut, root: int) -> str | None:
    """Why input ``x`` does not have one row per example in dimension ``root``, each derived from its own
    example (``None``: it does, as far as gradients and values show)."""
    indices = {index for _, index in sources}
    if HANDED_ON in indices or not isinstance(x, torch.Tensor):
        return None  # a pipeline stage's input: the previous stage's activations, checked there
    n = record.examples
    part = part_of_the_batch(name, x, record, indices, root)  # manual micro-batching (issue 29.8)
    if part is not None:
        return part
    if x.dim() <= root or x.shape[root] != n:
        if n in x.shape:
            return None  # the examples in another dimension: the engine's layout checks refuse it, or pass
        return (f"model input {name} (shape {tuple(x.shape)}) is computed from the loader's batch but has no "
                f"row per example (the batch holds {n}): it carries several examples' data into each one (a "
                "statistic over the batch, a flattened batch). Give the model one row per example, computed "
                "from that example alone")
    floats = [record.leaves[i] for i in sorted(indices) if i in record.leaves]
    if _as_handed_out(x, floats):
        return None  # the loader's own rows, as it handed them out
    x = x.movedim(root, 0)
    leaves = [(leaf, dim) for leaf in floats if (dim := _example_dim(leaf, n, root)) is not None]
    if x.is_floating_point() and leaves:
        refusal = _float_refusal(name, x, leaves)
        if refusal is not None:
            return refusal
    for index in sorted(indices & set(record.values)):
        values, dim = record.values[index], _example_dim(record.values[index], n, root)
        pair = None if dim is None else _row_taking_values(x, values.movedim(dim, 0))
        if pair is not None:
            return (f"integer model input {name} takes another example's values: its row {pair[0]} holds "
                    f"the values of row {pair[1]} of the loader's batch at at least half of the positions "
                    f"where the two examples differ (rows moved between examples, a cutmix of tokens). "
                    f"Each example's input must come from that example alone: {_ROW_FIX}")
    return None


def _example_dim(t: torch.Tensor, n: int, root: int) -> int | None:
    """Where a tensor the loader handed out carries the examples: in dimension ``root`` when it has the
    batch's size there (a collate_fn that makes the model's layout), else in dimension 0
    (default_collate); ``None`` when neither holds the batch (the tensor's rows are not compared)."""
    return next((dim for dim in dict.fromkeys((root, 0)) if t.dim() > dim and t.shape[dim] == n), None)


def _float_refusal(name: str, x: torch.Tensor, leaves: list[tuple[torch.Tensor, int]]) -> str | None:
    """``x`` (examples first) against the loader's float leaves (each with its example dimension)."""
    mixed = _mixed_row(x, leaves) if x.requires_grad else None
    if mixed is not None and mixed >= 0:
        return (f"model input {name} mixes examples before the model: row {mixed} of the loader's batch "
                "reaches another example's row (mixup, cutmix, a statistic over the batch such as "
                "x - x.mean(0), rows moved between examples). Each example's gradient must depend on that "
                f"example alone: {_ROW_FIX}")
    if mixed is None and not any(_same_values(x, leaf.movedim(dim, 0)) for leaf, dim in leaves):
        return (f"model input {name} was computed from the loader's batch without gradients (under "
                "torch.no_grad(), or through .detach(), .data or NumPy) and differs from it, so tunefree "
                "cannot check that each of its rows comes from its own example alone. Compute it with "
                "gradients enabled (no gradient reaches a parameter through it: tunefree drops them), or "
                "transform each example in the Dataset or the collate_fn; an adversarial input made "
                "without gradients keeps the link as x_adv = x + (x_adv - x).detach()")
    return None


def _as_handed_out(x: torch.Tensor, leaves: list[torch.Tensor]) -> bool:
    """Whether ``x`` is one of the loader's float tensors as the loader handed it out: its copy of the
    leaf (seen through aliases: provenance tags and untags it) and never written since, so each row is
    its own example's and there is nothing to differentiate."""
    node = x.grad_fn
    while node is not None and type(node).__name__ == "AliasBackward0":
        node = node.next_functions[0][0]
    if node is None or type(node).__name__ != "CloneBackward0" or x._version != 0:
        return False
    copied = node.next_functions[0][0]  # the AccumulateGrad node of the leaf copied
    return any(getattr(copied, "variable", None) is leaf and leaf.shape == x.shape for leaf in leaves)


def _mixed_row(x: torch.Tensor, leaves: list[tuple[torch.Tensor, int]]) -> int | None:
    """A loader row that reaches another row of ``x`` (examples first) through gradients (-1: none does;
    ``None``: no gradient links ``x`` to the loader's rows). One vector–Jacobian product per code bit."""
    n = x.shape[0]
    codes = row_codes(n).to(x.device)
    pattern = torch.cos(torch.arange(x[0].numel(), device=x.device, dtype=x.dtype) * 0.7 + 0.3) + 2.0
    linked = False
    for bit in range(codes.shape[1]):
        rows = codes[:, bit]
        cotangent = pattern.reshape(x.shape[1:]) * rows.reshape(-1, *[1] * (x.dim() - 1)).to(x.dtype)
        grads = torch.autograd.grad([x], [leaf for leaf, _ in leaves], [cotangent], retain_graph=True,
                                    allow_unused=True)
        for grad, (_, dim) in zip(grads, leaves):
            if grad is None:
                continue
            linked = True
            reached = grad.movedim(dim, 0).reshape(n, -1).ne(0).any(1) & ~rows.to(grad.device)
            if reached.any():
                return int(reached.nonzero()[0])
    return -1 if linked else None


def _leaves_reached(x: torch.Tensor, limit: int = 10_000) -> set[int] | None:
    """The ids of the leaves that ``x``'s autograd graph reaches (``None``: more than ``limit`` nodes)."""
    seen, stack, leaves = set(), [x.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if len(seen) >= limit:
            return None
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _same_values(x: torch.Tensor, leaf: torch.Tensor) -> bool:
    return x.shape == leaf.shape and torch.equal(x.detach(), leaf.detach().to(x.device, x.dtype))


_COMPARED = 1 << 22  # elements compared at once by the integer check


def _row_taking_values(x: torch.Tensor, values: torch.Tensor) -> tuple[int, int] | None:
    """A pair (i, j), i ≠ j, such that row i of ``x`` holds row j's values (not its own) at at least half
    of the positions where rows i and j of ``values`` differ, compared over their common leading extent
    (``None``: no such pair, or shapes that cannot be compared position by position)."""
    if x.dim() != values.dim():
        return None
    extent = tuple(slice(0, min(a, b)) for a, b in zip(x.shape[1:], values.shape[1:]))
    mine = x.detach()[(slice(None), *extent)].reshape(x.shape[0], -1)
    theirs = values[(slice(None), *extent)].to(mine.device).reshape(x.shape[0], -1)
    if mine.shape[1] == 0 or torch.equal(mine, theirs.to(mine.dtype)):
        return None
    n, width = theirs.shape
    chunk = max(1, _COMPARED // max(1, n * width))
    for start in range(0, n, chunk):
        own = theirs[start:start + chunk, None]
        differ = own != theirs[None]
        taken = ((mine[start:start + chunk, None] == theirs[None]) & differ).sum(-1)
        found = (2 * taken >= differ.sum(-1)) & differ.any(-1)
        if found.any():
            i, j = found.nonzero()[0].tolist()
            return start + i, j
    return None

