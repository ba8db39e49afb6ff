"""Where a layer call's tensors carry the examples of the batch (the call's *layout*).

Every per-example tensor of a call has an :class:`Axis`: the example dimension of a batch-first or
time-major tensor (:class:`Dim`), the rows of an attention mask that interleaves examples and heads
(:class:`Interleaved`), the packed data of a ``PackedSequence`` (:class:`Packed`) or the 1-D ids of an
``nn.EmbeddingBag`` cut into bags by offsets (:class:`Segments`). Offsets and batch sizes that say where the
examples are, but hold none of their values, are :class:`Structure`. Each axis turns a tensor into a
batch-first one (example ``i`` in row ``i``), which is what norms, clip weights, the example count and the
example-independence check read. Layouts come from the layer's type and configuration (``batch_first``,
torch's conventions) or from the user's declaration (``make_private(..., batch_dim=...)``), never from
shapes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence
from torch.utils._pytree import tree_flatten


class Axis(ABC):
    """Where one tensor of a layer call carries its examples."""

    @abstractmethod
    def examples(self, t: torch.Tensor) -> int | None:
        """How many examples ``t`` holds along this axis (``None``: ``t`` does not have the axis)."""

    @abstractmethod
    def batch_first(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with example ``i`` in row ``i`` of dimension 0 (a view where the layout allows)."""

    def one(self, row: torch.Tensor) -> torch.Tensor:
        """One example's row of :meth:`batch_first` in the layout the layer takes: a batch of one."""
        raise NotImplementedError(f"{self.describe()} has no batch-of-one form")

    @abstractmethod
    def describe(self) -> str:
        """Where the examples are, in words (for messages)."""


@dataclass(frozen=True)
class Dim(Axis):
    """Examples along dimension ``dim`` (0: batch-first; 1: time-major ``[T, B, …]``)."""

    dim: int

    def examples(self, t: torch.Tensor) -> int | None:
        return t.shape[self.dim] if t.dim() > self.dim else None

    def batch_first(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dim == 0 else t.movedim(self.dim, 0)

    def one(self, row: torch.Tensor) -> torch.Tensor:
        return row.unsqueeze(self.dim)

    def describe(self) -> str:
        return f"dimension {self.dim}"


@dataclass(frozen=True)
class Interleaved(Axis):
    """Examples along dimension ``dim`` in runs of ``group`` rows: rows ``b·group … b·group + group − 1``
    belong to example ``b`` (an attention mask ``[B·heads, T, S]``)."""

    dim: int
    group: int

    def examples(self, t: torch.Tensor) -> int | None:
        if t.dim() <= self.dim or t.shape[self.dim] % self.group:
            return None
        return t.shape[self.dim] // self.group

    def batch_first(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(self.dim, (-1, self.group)).movedim(self.dim, 0)

    def one(self, row: torch.Tensor) -> torch.Tensor:
        return row  # the example's `group` rows are already the batch of one

    def describe(self) -> str:
        return f"dimension {self.dim}, {self.group} rows per example"


@dataclass(frozen=True, eq=False)
class Packed(Axis):
    """The data of a ``PackedSequence``: time step after time step of the sequences still running,
    sorted by length; ``sequence`` holds its batch sizes and orders."""

    sequence: PackedSequence

    def examples(self, t: torch.Tensor) -> int | None:
        sizes = self.sequence.batch_sizes
        if t.dim() == 0 or t.shape[0] != int(sizes.sum()):
            return None
        return int(sizes[0]) if sizes.numel() else 0

    def batch_first(self, t: torch.Tensor) -> torch.Tensor:
        """Padded ``[B, T_max, …]`` in the batch's own order, zeros after each sequence's end."""
        s = self.sequence
        return pad_packed_sequence(PackedSequence(t, s.batch_sizes, s.sorted_indices, s.unsorted_indices),
                                   batch_first=True)[0]

    def describe(self) -> str:
        return "packed sequences"


@dataclass(frozen=True, eq=False)
class Segments(Axis):
    """A 1-D tensor cut into one segment per example: example ``b`` owns entries ``starts[b]`` up to
    ``ends[b]`` (the bags of ``nn.EmbeddingBag``'s 1-D ids and offsets)."""

    starts: torch.Tensor
    ends: torch.Tensor

    def examples(self, t: torch.Tensor) -> int | None:
        return self.starts.numel() if t.dim() >= 1 else None

    def batch_first(self, t: torch.Tensor) -> torch.Tensor:
        """Padded ``[B, longest, …]``, zeros after each segment's end."""
        lengths = (self.ends - self.starts).clamp(min=0)
        width = int(lengths.max()) if lengths.numel() else 0
        steps = torch.arange(width, device=t.device)
        valid = steps[None, :] < lengths[:, None]
        index = (self.starts[:, None] + steps[None, :]).clamp(max=max(t.shape[0] - 1, 0))
        rows = t[index] if t.shape[0] else t.new_zeros(*index.shape, *t.shape[1:])
        return rows * valid.reshape(*valid.shape, *([1] * (t.dim() - 1))).to(rows.dtype)

    def describe(self) -> str:
        return "bags of a 1-D input cut by offsets"


@dataclass(frozen=True)
class Structure(Axis):
    """A tensor that says where the examples are (offsets, batch sizes) but holds none of their values."""

    def examples(self, t: torch.Tensor) -> int | None:
        return None

    def batch_first(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a structure tensor has no rows of examples")

    def describe(self) -> str:
        return "the layout of the examples (offsets, batch sizes)"


@dataclass(frozen=True)
class CallLayout:
    """The layout of one layer call: an axis (or ``None``: not per example, passed whole) for each leaf
    of ``tree_flatten((args, kwargs))``, and one for each floating-point tensor output."""

    inputs: tuple[Axis | None, ...]
    outputs: tuple[Axis, ...]


_DIMS = tuple(Dim(d) for d in range(8))  # the common axes, made once


def uniform_layout(args: tuple, kwargs: dict, num_outputs: int, dim: int) -> CallLayout:
    """Every tensor input and every output carries the examples in dimension ``dim``."""
    axis = _DIMS[dim] if dim < len(_DIMS) else Dim(dim)
    if not kwargs and all(isinstance(x, torch.Tensor) for x in args):  # a plain layer call: no pytree
        return CallLayout((axis,) * len(args), (axis,) * num_outputs)
    leaves = tree_flatten((args, kwargs))[0]
    return CallLayout(tuple(axis if isinstance(x, torch.Tensor) else None for x in leaves),
                      (axis,) * num_outputs)
