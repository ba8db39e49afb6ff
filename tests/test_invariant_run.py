"""Invariant: the guarantee describes the run that happened.

A resumed ledger agrees with the Poisson sampler's position and with the wrapped optimizer's own update
count; a ledger carried into another run keeps every caveat of both runs; the data digest that checkpoints
and data-parallel ranks compare covers every example, so ranks holding different data are refused.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from support.gloo_harness import run_processes
from support.training import train
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, TensorDataset

import tunefree
from tunefree.errors import PrivacyError
from tunefree.privacy.plan import data_digest

N = 24


def dataset(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def private(optimizer_class=torch.optim.SGD, **options) -> tunefree.DPEngine:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    settings = {"noise_multiplier": 1.0, "steps": 8, "seed": 0, **options}
    return tunefree.make_private(model, optimizer_class(model.parameters(), lr=0.1),
                                 DataLoader(dataset(), batch_size=6), target_delta=1e-3, **settings)


def with_fewer_steps(state: dict, steps: int) -> dict:
    """``state`` with its ledger edited to record ``steps`` steps (its one run of identical events)."""
    edited = copy.deepcopy(state)
    [(event, _)] = edited["ledger"]["runs"]
    edited["ledger"]["runs"] = [(event, steps)]
    return edited


# ---------------------------------------------------------------------------- a resumed ledger
def test_a_ledger_edited_to_fewer_steps_is_refused_at_load():
    engine = private()
    train(engine, 3)
    resumed = private()
    with pytest.raises(PrivacyError, match="ledger records 1 private steps but its Poisson sampler handed "
                                           "out 3 batches"):
        resumed.load_state_dict(with_fewer_steps(engine.state_dict(), 1))
    resumed = private()
    resumed.load_state_dict(engine.state_dict())  # the true state resumes
    assert resumed.steps == 3


@pytest.mark.parametrize("optimizer_first", [True, False])
def test_the_optimizers_update_count_witnesses_an_edited_ledger_and_sampler(optimizer_first):
    """Adam counts its updates. With the sampler's position edited along with the ledger, the optimizer's
    state still says 3 updates: refused at load if the optimizer state is loaded first, else before the
    next update (whose release is then the only one recorded past the edit, and is not applied)."""
    engine = private(torch.optim.Adam)
    train(engine, 3)
    state = with_fewer_steps(engine.state_dict(), 1)
    state["schedule"]["consumed"] = 1
    resumed = private(torch.optim.Adam)
    message = r"optimizer has applied 3 updates but the ledger records 1 private steps"
    if optimizer_first:
        resumed.optimizer.load_state_dict(engine.optimizer.state_dict())
        with pytest.raises(PrivacyError, match=message):
            resumed.load_state_dict(state)
        return
    resumed.load_state_dict(state)
    resumed.optimizer.load_state_dict(engine.optimizer.state_dict())
    weights = [p.detach().clone() for p in resumed.model.parameters()]
    with pytest.raises(PrivacyError, match=message):
        train(resumed, 1)
    assert all(torch.equal(a, b) for a, b in zip(weights, resumed.model.parameters()))


# ---------------------------------------------------------------------------- carried-over ledgers
@pytest.mark.parametrize("old, new", [
    ({"poisson_sampling": True, "seed": 0}, {"poisson_sampling": False, "seed": None}),
    ({"poisson_sampling": False, "seed": None}, {"poisson_sampling": True, "seed": 0}),
    ({"poisson_sampling": True, "seed": None}, {"poisson_sampling": True, "seed": None}),
])
def test_a_carried_ledger_keeps_the_caveats_of_both_runs(old, new):
    """The new run's guarantee reports every caveat of the releases it accounts: the old run's (a seeded
    one, a non-Poisson loader) and its own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Poisson approximation is warned about
        first = private(**old)
        train(first, 2)
        second = private(**new)
    second.ledger.load_state_dict(first.ledger.state_dict())
    guarantee = second.guarantee()
    approximate = not (old["poisson_sampling"] and new["poisson_sampling"])
    seeded = old["seed"] is not None or new["seed"] is not None
    assert (guarantee.poisson_approximation, guarantee.seeded) == (approximate, seeded)
    assert ("Poisson approximation" in str(guarantee)) is approximate
    assert ("seeded run" in str(guarantee)) is seeded
    assert guarantee.steps == 2


def test_a_ledger_state_without_its_caveats_is_refused():
    engine = private()
    state = engine.ledger.state_dict()
    del state["seeded"]
    with pytest.raises(ValueError, match=r"lacks \['seeded'\]"):
        private().ledger.load_state_dict(state)


# ---------------------------------------------------------------------------- the data digest
class Rows(Dataset):
    """A map-style data set that is not a TensorDataset: (features, label, text) per row."""

    def __init__(self, data: TensorDataset):
        self.x, self.y = data.tensors

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i]), f"row {i}"


@pytest.mark.parametrize("wrap", [lambda d: d, Rows], ids=["tensors", "rows"])
def test_the_data_digest_covers_every_example_and_their_order(wrap):
    data = dataset()
    digest = data_digest(wrap(data), N)
    assert data_digest(wrap(dataset()), N) == digest
    for row in (1, 7, 13, 22):  # rows the old three-row digest never read
        x, y = (t.clone() for t in data.tensors)
        x[row, 2] = torch.nextafter(x[row, 2], torch.tensor(10.0))  # one ulp
        assert data_digest(wrap(TensorDataset(x, y)), N) != digest, row
    x, y = (t.clone() for t in data.tensors)
    x[[3, 4]], y[[3, 4]] = x[[4, 3]], y[[4, 3]]
    assert data_digest(wrap(TensorDataset(x, y)), N) != digest  # the order counts (sampling is by index)


def _different_data_scenario(rank: int) -> dict:
    """Rank 1 holds the same data set as rank 0 but for one interior row."""
    x, y = (t.clone() for t in dataset().tensors)
    if rank == 1:
        x[11, 0] += 1.0
    torch.manual_seed(1)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))
    try:
        tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              DataLoader(TensorDataset(x, y), batch_size=6), target_delta=1e-3,
                              noise_multiplier=1.0, steps=4, seed=0)
    except PrivacyError as error:
        return {"refused": str(error)}
    return {"refused": None}


@pytest.mark.distributed
def test_data_parallel_ranks_holding_different_data_are_refused(tmp_path: Path):
    ranks = run_processes(_different_data_scenario, tmp_path, world=2, deadline_s=90, collective_timeout_s=4)
    for rank, other in ((0, 1), (1, 0)):
        assert ranks[rank]["refused"] is not None
        assert f"rank {other} was set up differently" in ranks[rank]["refused"]
        assert "settings.data" in ranks[rank]["refused"]


def test_an_optimizer_state_from_another_run_is_refused_unless_it_predates_the_run():
    """Adam's state from 3 private steps, loaded after make_private without their ledger: refused before
    the first update. Loaded before make_private, it is training outside this guarantee (like
    pre-trained weights) and the run counts only its own updates."""
    first = private(torch.optim.Adam)
    train(first, 3)
    later = private(torch.optim.Adam)
    later.optimizer.load_state_dict(first.optimizer.state_dict())
    with pytest.raises(PrivacyError, match="optimizer has applied 3 updates but the ledger records 0"):
        train(later, 1)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    adam.load_state_dict(first.optimizer.state_dict())
    before = tunefree.make_private(model, adam, DataLoader(dataset(), batch_size=6), target_delta=1e-3,
                                   noise_multiplier=1.0, steps=8, seed=0)
    train(before, 2)
    assert before.steps == 2
