"""The user's own loader under ``poisson_sampling=False``: each example at most once per epoch.

Such a run is accounted as the Poisson approximation: each step as a Poisson sample at rate
q = batch_size / N, each example adding at most one clipped gradient (sensitivity R). A loader that hands
out an example twice — a ``WeightedRandomSampler`` for class balance, ``RandomSampler(replacement=True)``,
a ``num_samples`` beyond the data set, any sampler of the user's — gives that example two clipped
gradients in a step or an epoch: 12–13·R measured against the 2R of replacing one example (issue 29).

Enforced by behaviour, for any sampler: :func:`own_loader` puts a watch between the loader's
``BatchSampler`` and its sampler, in place, which refuses the second occurrence of an index in one pass (an
epoch: one ``iter()``) before its batch is fetched, so before any release; a sampler that draws with
replacement is refused at ``make_private``. What it sees and cannot see: docs/refusals.md.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, Sampler

from ..errors import PrivacyError, SettingsRefused

_FIX = ("Train with tunefree's Poisson loader (poisson_sampling=True, the default, with a plain "
        "DataLoader: each example is drawn independently at every step, and the guarantee is a proof), or "
        "with a sampler that hands out each example at most once per pass (DataLoader(..., shuffle=True)). "
        "To balance classes, weight each example's loss by a weight of its class instead (clipping bounds "
        "each weighted example by R; the class weights must come from public frequencies, not from the "
        "training set's own counts; docs/refusals.md)")


def own_loader(loader: DataLoader) -> DataLoader:
    """``loader`` (the same object) with every epoch's indices watched: a second occurrence of an example
    is refused before its batch is handed out. Refuses a sampler that draws with replacement up front."""
    sampler = loader.sampler
    if getattr(sampler, "replacement", False) is True:
        raise SettingsRefused(
            f"poisson_sampling=False with a {type(sampler).__name__} that draws with replacement: it hands "
            "out some examples several times in a step or an epoch, so one example adds several clipped "
            "gradients to the releases (12–13·R measured where the accounting assumes at most 2R for "
            f"replacing one example). {_FIX}")
    batches = loader.batch_sampler
    if not isinstance(batches, BatchSampler):  # a DataLoader with a batch_size always has one
        raise TypeError(f"the data loader's batch sampler is a {type(batches).__name__}, not a BatchSampler: "
                        "pass a DataLoader with batch_size (and, if any, a sampler of single indices)")
    if not isinstance(batches.sampler, _EachOncePerEpoch):
        batches.sampler = _EachOncePerEpoch(batches.sampler, batches.batch_size)
    return loader


class _EachOncePerEpoch(Sampler):
    """The user's sampler, refusing an index it already handed out in the same pass."""

    def __init__(self, sampler: Any, batch_size: int):
        super().__init__()
        self.sampler, self.batch_size = sampler, batch_size

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        seen: dict[Hashable, int] = {}
        for position, index in enumerate(self.sampler):
            key = _key(index)
            first = seen.setdefault(key, position)
            if first != position:
                raise PrivacyError(
                    f"the data loader handed out example {index!r} twice in one epoch (at positions {first} "
                    f"and {position} of the epoch: batches {first // self.batch_size} and "
                    f"{position // self.batch_size}), so nothing of the batch that repeats it is trained on "
                    "or released. Under poisson_sampling=False the run is accounted as the Poisson "
                    "approximation, in which each example adds at most one clipped gradient to a step and "
                    f"appears at most once per pass; a repeated example adds one per occurrence. {_FIX}")
            yield index


def _key(index: Any) -> Hashable:
    """An index as a set key: integers of any kind (Python, NumPy, 0-d tensors) by value."""
    try:
        return operator.index(index)
    except TypeError:
        pass
    try:
        hash(index)
    except TypeError:
        raise PrivacyError(
            f"the data loader's sampler hands out indices of type {type(index).__name__}, which tunefree "
            "cannot compare, so it cannot check that no example is handed out twice in an epoch "
            "(poisson_sampling=False): use a sampler of integer (or hashable) indices") from None
    return index
