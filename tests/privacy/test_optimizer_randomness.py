"""Secret noise by default: sampling and noise come from os.urandom unless a seed asks for a reproducible
run, which the guarantee and the checkpoint then call out; resuming is exact in both modes."""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch
from support.training import train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.privacy import chacha20


def data(n=60):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def private(**kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return tunefree.make_private(model, optimizer, DataLoader(data(), batch_size=10),
                                 noise_multiplier=1.0, target_delta=1e-3, **kwargs)


def test_default_run_draws_sampling_and_noise_from_one_key_read_from_os_urandom(monkeypatch):
    """Every secret number of a run (sampling and noise) is a function of the 32 bytes the process reads
    from ``os.urandom``: the same bytes give the same run, other bytes another run."""
    reads = []

    def fixed(key):
        def urandom(count):
            reads.append(count)
            return key[:count]
        return urandom

    weights = []
    for key in (bytes(range(32)), bytes(range(32)), bytes(range(1, 33))):
        monkeypatch.setattr(chacha20, "os", SimpleNamespace(urandom=fixed(key), getpid=os.getpid))
        engine = private()
        train(engine, 2)
        weights.append(engine.model[0].weight.detach().clone())
    assert reads == [32, 32, 32]  # one key per run's source, nothing else read
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    assert engine.randomness.secret and engine.randomness.seed is None
    assert "seed" not in str(engine.guarantee())
    assert engine.state_dict()["randomness"] == {"seed": None, "secure": True, "randomness": "secure",
                                                 "noise": {}}  # no key, no counter in a checkpoint


def test_two_default_runs_with_the_same_torch_seed_differ():
    first, second = private(), private()
    train(first, 2)
    train(second, 2)
    assert not torch.equal(first.model[0].weight, second.model[0].weight)


def test_a_seeded_run_says_that_the_seed_removes_the_noise():
    engine = private(seed=3)
    train(engine, 1)
    assert not engine.randomness.secret
    assert "anyone who knows the seed can remove the noise" in str(engine.guarantee())
    assert engine.guarantee().seeded
    state = engine.state_dict()["randomness"]
    assert state["seed"] == 3 and "anyone who knows the seed can remove the noise" in state["randomness"]


def test_a_secure_run_resumes_its_ledger_and_sampler_position():
    engine = private()
    train(engine, 4)  # 4 of the 6 steps of the first epoch
    checkpoint = copy.deepcopy({"model": engine.model.state_dict(), "privacy": engine.state_dict()})
    resumed = private()
    resumed.model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["privacy"])
    assert resumed.steps == 4 and resumed.randomness.secret
    assert len(list(resumed.data_loader.batch_sampler)) == 2  # the rest of the epoch, not a new one
    train(resumed, 2)
    whole = private(seed=1)
    train(whole, 6)
    assert resumed.epsilon() == whole.epsilon()


def test_a_checkpoint_resumes_only_in_the_mode_it_was_made_in():
    secure, seeded = private(), private(seed=2)
    with pytest.raises(ValueError, match="secure run and this run is seeded"):
        seeded.load_state_dict(secure.state_dict())
    with pytest.raises(ValueError, match="seeded run and this run is secure"):
        secure.load_state_dict(seeded.state_dict())
