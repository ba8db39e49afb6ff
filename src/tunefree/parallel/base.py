"""How one private run spans processes: the :class:`Parallelism` protocol, one axis of the run.

A run is one process (:class:`Single`), data parallel (``ddp.py``: DDP), sharded (``fsdp.py``: FSDP2) or
cut into pipeline stages (``stages.py``). Each is one object that every part of the run asks the same
questions: where each step's Poisson sample comes from (``sampling``) and which of its examples this
process trains on (``shard``), where the engine books its clipped sums (``sink``), how a release sums
the processes' values and noises each coordinate once (``noisy_sum`` for the gradient, ``noisy_values``
for the few numbers of the counts and losses: ``privacy.mechanisms.Reduction``), which clip groups the
run has beyond this process's (``all_groups``: the noise allocation and the adaptive thresholds' joint
counts and scale are over all of them), whether a flag holds on every process (``agree``), and which
options it runs (``kind``: each option lists the kinds it runs under). No part of the run is written
once per parallelism.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from ..clipping.groups import ClipGroup
from ..persample.accumulator import LocalSums, Sink
from ..privacy.mechanisms import OneProcess, Reduction
from ..privacy.randomness import NoiseSource

ONE_PROCESS, DDP, FSDP2, STAGES = "one process", "DDP", "FSDP2", "pipeline stages"


class Sampling(Protocol):
    """Where a step's Poisson sample comes from (a :class:`NoiseSource` is one)."""

    def inclusion(self, step: int, num_examples: int, sample_rate: float) -> torch.Tensor:
        """Which examples logical step ``step`` includes (bool, CPU)."""


class Parallelism(Reduction, Protocol):
    """The parallelism of a run (see the module docstring)."""

    kind: str  # ONE_PROCESS, DDP, FSDP2 or STAGES: the options of a run name the kinds they run under

    @property
    def shard(self) -> tuple[int, int]:
        """``(rank, world_size)``: which examples of each Poisson sample this process trains on."""

    def sampling(self, randomness: NoiseSource) -> Sampling:
        """Where each step's Poisson sample comes from: ``randomness``, or (pipeline stages) the first
        stage's sample, broadcast."""

    def sink(self, groups: Sequence[ClipGroup]) -> Sink:
        """Where the engine books the clipped sums of ``groups``' parameters."""

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` is True on every process (a collective: every process must call it)."""

    def from_first(self, value: int) -> int:
        """Process 0's ``value``, on every process (a collective)."""

    def take_over(self) -> None:
        """Switch the wrapper's own gradient synchronisation off while tunefree owns the model."""

    def release_model(self) -> None:
        """Give the wrapper its gradient synchronisation back."""


class DataParallelBase:
    """What the data-parallel kinds (DDP, FSDP2) share: each of the ``world_size`` processes trains on its
    shard of every Poisson sample, which it samples from the run's own randomness, and every process holds
    every clip group of the run."""

    rank: int
    world_size: int

    @property
    def shard(self) -> tuple[int, int]:
        """``(rank, world_size)``: which examples of each Poisson sample this process trains on."""
        return self.rank, self.world_size

    def sampling(self, randomness: NoiseSource) -> NoiseSource:
        """Each rank samples its shard of every Poisson sample from the run's own randomness."""
        return randomness

    def all_groups(self, own: Mapping[str, tuple[float, int]]) -> dict[str, tuple[float, int]]:
        """Every rank holds every clip group of the run."""
        return dict(own)


class Single(OneProcess):
    """One process: every example of each sample is this process's, the sums stay here."""

    kind = ONE_PROCESS
    shard = (0, 1)

    def sampling(self, randomness: NoiseSource) -> NoiseSource:
        return randomness

    def sink(self, groups: Sequence[ClipGroup]) -> Sink:
        return LocalSums()

    def agree(self, flag: bool) -> bool:
        return flag

    def from_first(self, value: int) -> int:
        return value

    def take_over(self) -> None:
        """Nothing to take over."""

    def release_model(self) -> None:
        """Nothing to give back."""
