"""Poisson sampling: at every logical step each example is included independently with probability q.

Batch sizes vary and may be zero; an empty logical batch still yields one empty batch so that the
training loop steps (the noise is added and the step is accounted). Logical batches larger than memory
are cut into physical micro-batches; the optimizer steps once per logical batch.

An in-memory ``TensorDataset`` with the default collation, in the main process and without pinned
memory, is gathered in one indexing operation per tensor instead of one ``__getitem__`` per example and
a collation: the same batches, in the same order, at a fraction of the cost.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
    default_collate,
)

from ..errors import SettingsRefused
from ..privacy.randomness import NoiseSource
from .provenance import HandedOut, hand_out


class StepSchedule:
    """Shared by the loader and the optimizer: where the training loop stands in logical steps.

    ``consumed`` counts logical batches handed to the loop; ``ends_logical`` says whether the last
    physical batch handed out closed its logical batch (the optimizer steps only then). It is also the
    engine's provenance of the batch: ``batch_serial`` numbers the physical batches handed out (0: none
    yet) and ``batch_examples`` is the number of examples in the last one; ``handed_out`` records what
    the loader handed out last (``data/provenance.py``). ``checking`` (set by the optimizer) says whether
    the logical step handed out next is one the run checks; ``watchers`` are called after each batch is
    handed out (the loss check records the loop's computation from there on checked steps).
    """

    def __init__(self) -> None:
        self.checking = True
        self.watchers: list[Callable[[], None]] = []
        self.handed_out: HandedOut | None = None
        self.consumed = 0
        self.ends_logical = True
        self._open = False
        self.batch_serial = 0
        self.batch_examples: int | None = None

    def on_batch(self, first: bool, last: bool, examples: int) -> None:
        if first:
            if self._open:
                raise RuntimeError(
                    "the private loader moved to a new batch but optimizer.step() was not called for "
                    "the previous one: call step() after every batch, even an empty one (skipping a "
                    "step depends on the batch size, which is private)"
                )
            self.consumed += 1
            self._open = True
        self.ends_logical = last
        self.batch_serial += 1
        self.batch_examples = examples

    def on_step(self) -> bool:
        """Called by the optimizer; True when this call ends a logical batch (a real step)."""
        if not self.ends_logical:
            return False
        self._open = False
        return True

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed, self.ends_logical, self._open = state["consumed"], True, False


class PoissonBatchSampler(Sampler[list[int]]):
    """Index lists of Poisson-sampled logical batches, cut into physical chunks.

    Args:
        num_examples: size of the private data set N.
        sample_rate: inclusion probability q of each example at each step.
        steps_per_epoch: logical steps per pass over ``iter()`` (``round(1/q)`` by default).
        randomness: the run's source of randomness; step ``t``'s batch depends only on it and ``t``.
        schedule: the shared step counter; a new ``iter()`` continues the current epoch after a resume.
        max_physical_batch_size: largest chunk handed to the model at once (``None``: no limit).
        shard: ``(rank, world_size)`` of a data-parallel run: this process keeps only the sampled
            examples ``i ≡ rank (mod world_size)``, so that the ranks' batches together are one Poisson
            sample of the whole data set at rate q (with a seed, exactly the one-process batch).
    """

    def __init__(self, num_examples: int, sample_rate: float, steps_per_epoch: int,
                 randomness: NoiseSource, schedule: StepSchedule,
                 max_physical_batch_size: int | None = None, shard: tuple[int, int] = (0, 1)):
        super().__init__()
        rank, world_size = shard
        if not (0 <= rank < world_size):
            raise ValueError(f"shard must be (rank, world_size) with 0 ≤ rank < world_size, got {shard}")
        self.shard = shard
        self.num_examples, self.sample_rate = num_examples, sample_rate
        self.steps_per_epoch, self.randomness, self.schedule = steps_per_epoch, randomness, schedule
        self.max_physical_batch_size = max_physical_batch_size
        self.boundaries: deque[tuple[bool, bool, int]] = deque()  # first, last, examples

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        for indices in self.index_tensors():
            yield indices.tolist()

    def index_tensors(self) -> Iterator[torch.Tensor]:
        """The physical batches of ``iter()``, each as a 1-D ``torch.long`` tensor of indices."""
        self.boundaries.clear()
        start = self.schedule.consumed
        remaining = self.steps_per_epoch - start % self.steps_per_epoch
        rank, world_size = self.shard
        for step in range(start, start + remaining):
            included = self.randomness.inclusion(step, self.num_examples, self.sample_rate)
            indices = torch.nonzero(included[rank::world_size]).flatten()
            if world_size > 1:
                indices = indices.mul(world_size).add(rank)
            chunks = indices.split(self.max_physical_batch_size or max(len(indices), 1))
            for k, piece in enumerate(chunks):
                self.boundaries.append((k == 0, k == len(chunks) - 1, len(piece)))
                yield piece


class _EmptyAwareCollate:
    """Collates like the user's ``collate_fn``; an empty batch gets the right structure with size 0."""

    def __init__(self, dataset: Dataset, collate_fn: Any):
        self.dataset, self.collate_fn = dataset, collate_fn or default_collate

    def __call__(self, batch: list[Any]) -> Any:
        if batch:
            return self.collate_fn(batch)
        one = self.collate_fn([self.dataset[0]])
        return tree_map(lambda x: x[:0] if isinstance(x, torch.Tensor) else x, one)


def gathers_in_one_index(dataset: Dataset, collate_fn: Any, num_workers: int, pin_memory: bool) -> bool:
    """Whether a batch of ``dataset`` is exactly ``[t[indices] for t in dataset.tensors]``: a
    ``TensorDataset`` (whose class keeps its ``__getitem__``) collated by ``default_collate`` in the main
    process without pinned memory. ``default_collate`` stacks each tensor's rows into a list, which is
    what one indexing operation per tensor gives."""
    return (isinstance(dataset, TensorDataset) and type(dataset).__getitem__ is TensorDataset.__getitem__
            and collate_fn in (None, default_collate) and num_workers == 0 and not pin_memory)


class PoissonDataLoader(DataLoader):
    """A ``DataLoader`` whose batches are Poisson-sampled, built from the user's loader settings."""

    def __init__(self, dataset: Dataset, batch_sampler: PoissonBatchSampler, collate_fn: Any = None,
                 **loader_kwargs: Any):
        super().__init__(dataset, batch_sampler=batch_sampler,
                         collate_fn=_EmptyAwareCollate(dataset, collate_fn), **loader_kwargs)
        self.schedule = batch_sampler.schedule
        self.gathers = gathers_in_one_index(dataset, collate_fn, self.num_workers, self.pin_memory)

    def __iter__(self) -> Iterator[Any]:
        boundaries = self.batch_sampler.boundaries
        for batch in self._gathered() if self.gathers else super().__iter__():
            first, last, examples = boundaries.popleft()
            self.schedule.on_batch(first, last, examples)
            batch, self.schedule.handed_out = hand_out(batch, self.schedule.batch_serial, examples,
                                                       self.schedule.checking)
            for watch in self.schedule.watchers:
                watch()
            yield batch

    def _gathered(self) -> Iterator[list[torch.Tensor]]:
        """The batches of a ``TensorDataset``, each tensor's rows taken in one indexing operation."""
        tensors = self.dataset.tensors  # type: ignore[attr-defined]
        for rows in self.batch_sampler.index_tensors():
            yield [t.index_select(0, rows.to(t.device)) for t in tensors]


def steps_per_epoch(sample_rate: float) -> int:
    """Logical steps in one pass of the Poisson loader: ``round(1/q)``, at least one."""
    return max(1, round(1 / sample_rate))


def planned_steps(epochs: float | None, steps: int | None, sample_rate: float) -> int | None:
    """The planned number of logical steps from ``epochs`` (of ``round(1/q)`` steps each, the last
    one rounded up) or ``steps``; ``None`` when neither is given. The one conversion used everywhere
    (``make_private`` and the command line)."""
    if epochs is not None and steps is not None:
        raise ValueError("give epochs or steps, not both")
    if steps is not None:
        if isinstance(steps, bool) or int(steps) != steps or steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps}")
        return int(steps)
    if epochs is not None:
        if not (epochs > 0 and math.isfinite(epochs)):
            raise ValueError(f"epochs must be a positive finite number, got {epochs}")
        return math.ceil(epochs * steps_per_epoch(sample_rate))
    return None


def sample_rate_of(loader: DataLoader) -> tuple[int, float]:
    """The private data set's size N and the sampling rate q = batch_size / N of ``loader``."""
    if loader.batch_size is None:
        raise ValueError(
            "the data loader has no batch_size (a custom batch_sampler?): tunefree derives the "
            "sampling rate q = batch_size / len(dataset) from it; pass a DataLoader with batch_size"
        )
    if isinstance(loader.dataset, IterableDataset):
        raise SettingsRefused(
            f"the private data set is an IterableDataset ({type(loader.dataset).__name__}): it yields its "
            "examples itself, so tunefree cannot draw the Poisson sample (it picks examples by index), "
            "digest the data set, or see which examples a batch holds (under poisson_sampling=False it "
            "checks that no example is handed out twice in an epoch, which a stream may do). Give a "
            "map-style Dataset, with __getitem__ and __len__ (a TensorDataset, or a list of examples)")
    try:
        num_examples = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError as error:
        raise ValueError("the private data set must have a length (an iterable data set cannot be "
                         "Poisson-sampled)") from error
    if num_examples == 0:
        raise ValueError("the private data set is empty")
    sample_rate = loader.batch_size / num_examples
    if sample_rate > 1:
        raise ValueError(
            f"batch_size {loader.batch_size} exceeds the {num_examples} examples: the sampling rate "
            f"would be {sample_rate:.3g} > 1; use a batch_size of at most {num_examples}"
        )
    return num_examples, sample_rate


def from_loader(loader: DataLoader, randomness: NoiseSource, schedule: StepSchedule,
                max_physical_batch_size: int | None = None, shard: tuple[int, int] = (0, 1)
                ) -> PoissonDataLoader:
    """The Poisson-sampled version of ``loader``: q = batch_size / len(dataset), whatever the number of
    processes; ``shard`` is ``(rank, world_size)`` of a data-parallel run (see
    :class:`PoissonBatchSampler`)."""
    if isinstance(loader.sampler, DistributedSampler):
        raise ValueError(
            "the data loader uses a DistributedSampler: tunefree shards the Poisson sampling across "
            "ranks itself; pass a loader over the whole data set, with batch_size the expected "
            "global batch size and no sampler")
    if not isinstance(loader.sampler, (SequentialSampler, RandomSampler)):
        raise ValueError(
            f"the data loader samples with {type(loader.sampler).__name__}; tunefree replaces the "
            "sampling by Poisson sampling (which its accounting assumes), so a custom or weighted "
            "sampler would be silently ignored: pass a loader with batch_size and no sampler"
        )
    num_examples, sample_rate = sample_rate_of(loader)
    sampler = PoissonBatchSampler(num_examples, sample_rate, steps_per_epoch(sample_rate),
                                  randomness, schedule, max_physical_batch_size, shard)
    kwargs = {k: getattr(loader, k) for k in ("num_workers", "pin_memory", "timeout",
                                              "worker_init_fn", "multiprocessing_context")}
    if loader.num_workers > 0:
        kwargs.update(prefetch_factor=loader.prefetch_factor,
                      persistent_workers=loader.persistent_workers)
    return PoissonDataLoader(loader.dataset, sampler, collate_fn=loader.collate_fn, **kwargs)
