"""The user's own loader under ``poisson_sampling=False`` hands out each example at most once per epoch.

Such a run is accounted as the Poisson approximation at sensitivity R; a sampler that repeats an example
(class balancing with ``WeightedRandomSampler(replacement=True)``: 12–13·R measured, issue 29) gives it
one clipped gradient per occurrence. A sampler with ``replacement=True`` is refused at ``make_private``;
any other sampler is watched by what it hands out, and the batch that repeats an example is refused
before it is fetched, so its step releases nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    TensorDataset,
    WeightedRandomSampler,
)

import tunefree

N, BATCH = 32, 8


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g))


def private(loader: DataLoader, steps: int = 8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Poisson approximation's warning
        engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                                       target_delta=1e-3, noise_multiplier=1.0, steps=steps, seed=0,
                                       poisson_sampling=False)
    return model, engine


def train_epoch(model, engine, loader) -> int:
    steps = 0
    for x, y in loader:
        engine.optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        engine.optimizer.step()
        steps += 1
    return steps


class Listed(Sampler):
    """A sampler of the user's own, with no ``replacement`` attribute: it hands out ``order``."""

    def __init__(self, order: list[int]):
        super().__init__()
        self.order = order

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


@pytest.mark.parametrize("make", [
    lambda: WeightedRandomSampler(torch.linspace(1, 4, N), num_samples=N, replacement=True),
    lambda: RandomSampler(range(N), replacement=True)])
def test_a_sampler_with_replacement_is_refused_at_make_private_with_the_fix(make):
    loader = DataLoader(data(), batch_size=BATCH, sampler=make())
    model = nn.Linear(4, 3)
    with pytest.raises(tunefree.SettingsRefused, match="draws with replacement.*12–13·R.*Poisson loader.*"
                                                      "weight each example's loss.*public frequencies"):
        tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, target_delta=1e-3,
                              noise_multiplier=1.0, steps=2, poisson_sampling=False)
    assert not model._forward_pre_hooks  # refused before the model was hooked


@pytest.mark.parametrize("workers", [0, 1])
def test_an_epoch_that_hands_out_an_example_twice_is_refused_before_that_batch_is_released(workers):
    """A sampler of the user's own that oversamples: every example once, then examples 5..12 again. The
    four batches of distinct examples train; the fifth, which repeats example 5, is refused before it is
    fetched: no step of it is released, the model is as the fourth step left it. With a worker process the
    indices are still drawn in the main process, two batches ahead (the prefetch): the refusal comes two
    steps earlier, and releases nothing either."""
    order = torch.randperm(N, generator=torch.Generator().manual_seed(1)).tolist() + list(range(5, 13))
    loader = DataLoader(data(), batch_size=BATCH, sampler=Listed(order), num_workers=workers)
    model, engine = private(loader)
    done = []
    with pytest.raises(tunefree.PrivacyError, match=r"handed out example 5 twice in one epoch \(at positions "
                                                    rf"{order.index(5)} and 32 of the epoch: batches "
                                                    rf"{order.index(5) // BATCH} and 4\)"):
        for x, y in engine.data_loader:  # the very loader passed in: the loop may use either name
            engine.optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            engine.optimizer.step()
            done.append([p.detach().clone() for p in model.parameters()])
    assert engine.data_loader is loader
    trained = 4 - loader.prefetch_factor * workers if workers else 4
    assert len(done) == trained and engine.ledger.steps == trained
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), done[-1]))


def test_a_batch_holding_an_example_twice_is_refused_before_the_first_release():
    order = [3, 1, 4, 1, 5, 9, 2, 6] + list(range(10, 32))
    loader = DataLoader(data(), batch_size=BATCH, sampler=Listed(order))
    model, engine = private(loader)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(tunefree.PrivacyError, match="handed out example 1 twice .* batches 0 and 0"):
        train_epoch(model, engine, loader)
    assert engine.ledger.steps == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.slow
def test_a_shuffled_loader_trains_epoch_after_epoch_each_example_once_per_epoch():
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, engine = private(loader, steps=8)
    assert train_epoch(model, engine, loader) + train_epoch(model, engine, engine.data_loader) == 8
    assert engine.ledger.steps == 8 and engine.guarantee().poisson_approximation
    private(loader)  # the same loader made private again: watched once, not twice
    assert type(loader.batch_sampler.sampler.sampler) is RandomSampler


class Stream(IterableDataset):
    def __len__(self) -> int:
        return N

    def __iter__(self):
        for i in range(N):
            yield torch.randn(4), torch.tensor(i % 3)


@pytest.mark.parametrize("poisson", [True, False])
def test_an_iterable_dataset_is_refused_with_the_reason(poisson):
    model = nn.Linear(4, 3)
    with pytest.raises(tunefree.SettingsRefused, match="IterableDataset.*cannot draw the Poisson sample.*"
                                                      "handed out twice in an epoch.*map-style Dataset"):
        tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              DataLoader(Stream(), batch_size=BATCH), target_delta=1e-3, noise_multiplier=1.0,
                              steps=2, poisson_sampling=poisson)
