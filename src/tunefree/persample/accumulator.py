"""``StepAccumulator``: what one logical step has booked so far.

The engine writes into it during and after each backward pass (each parameter's clipped sum ``Σᵢ wᵢ gᵢ``
the moment its clip group is clipped, the number of examples and each clip group's per-sample norms); the
optimizer pops it once per logical step and releases the sums through the gradient mechanism. Where the
sums go is the accumulator's *sink*, given by the run's parallelism: :class:`LocalSums` (one process,
DDP) or FSDP2's reduce-scatter (``parallel/fsdp.py``), which keeps only this rank's shard of each sum. It
also enforces that each physical batch is booked by one backward pass only, so that no example adds
more than one clipped gradient per step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..dtypes import accumulation_dtype


@dataclass
class StepResult:
    """A logical step's bookings: clipped sums per parameter, examples booked (a private number) and
    each clip group's per-sample norms."""

    sums: dict[nn.Parameter, torch.Tensor]
    examples: int
    group_norms: dict[str, torch.Tensor]


class Sink(Protocol):
    """Where the clipped sums of a step go."""

    def add(self, p: nn.Parameter, contribution: torch.Tensor | None) -> None:
        """``p``'s complete clipped sum of one backward pass (``None``: no example reached ``p``)."""

    def collect(self) -> dict[nn.Parameter, torch.Tensor]:
        """The step's sums (a parameter without one has sum zero), and start a new step."""


class LocalSums:
    """The sums of this process, kept whole until the step."""

    def __init__(self) -> None:
        self._sums: dict[nn.Parameter, torch.Tensor] = {}

    def add(self, p: nn.Parameter, contribution: torch.Tensor | None) -> None:
        if contribution is None:
            return
        total = self._sums.get(p)
        if total is None:
            self._sums[p] = contribution.to(accumulation_dtype(p.dtype)).reshape(p.shape)
        else:
            total.add_(contribution.reshape(p.shape))

    def collect(self) -> dict[nn.Parameter, torch.Tensor]:
        sums, self._sums = self._sums, {}
        return sums


class StepAccumulator:
    """The clipped sums (in ``sink``, by default :class:`LocalSums`), booked example count and per-group
    norms of the current logical step."""

    def __init__(self, sink: Sink | None = None) -> None:
        self.sink = LocalSums() if sink is None else sink
        self._examples = 0
        self._norms: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._booked: set[int] = set()

    def book_batch(self, serial: int) -> bool:
        """Claim physical batch ``serial`` for a backward pass; False if it was already booked."""
        if serial in self._booked:
            return False
        self._booked.add(serial)
        return True

    def add(self, p: nn.Parameter, contribution: torch.Tensor | None) -> None:
        """Add a clipped, weighted per-sample gradient sum for ``p`` (``None``: no example of this
        backward pass reached ``p``). The engine books every trainable parameter once per backward pass,
        clip group after clip group, each in its parameters' order."""
        self.sink.add(p, contribution)

    def add_norms(self, group: str, norms: torch.Tensor) -> None:
        self._norms[group].append(norms.detach())

    def add_examples(self, count: int) -> None:
        self._examples += count

    def pop(self) -> StepResult:
        """Hand over the step's bookings and start a new step."""
        result = StepResult(self.sink.collect(), self._examples,
                            {name: values[0] if len(values) == 1 else torch.cat(values)
                             for name, values in self._norms.items()})
        self._examples, self._norms, self._booked = 0, defaultdict(list), set()
        return result
