"""Secret noise by default: sampling and noise come from os.urandom unless a seed asks for a reproducible
run, which the guarantee and the checkpoint then call out; resuming is exact in both modes."""

from __future__ import annotations

import copy
import os
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.privacy import randomness as randomness_module


def data(n=60):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def private(**kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return tunefree.make_private(model, optimizer, DataLoader(data(), batch_size=10),
                                 noise_multiplier=1.0, target_delta=1e-3, **kwargs)


def train(engine, steps):
    for _ in range(steps):
        x, y = next(iter(engine.data_loader))
        engine.optimizer.zero_grad()
        F.cross_entropy(engine.model(x), y).backward()
        engine.optimizer.step()


def test_default_run_draws_sampling_and_noise_from_os_urandom(monkeypatch):
    engine = private()
    drawn, urandom = [], os.urandom

    def counting(count):
        drawn.append(count)
        return urandom(count)

    monkeypatch.setattr(randomness_module.os, "urandom", counting)
    train(engine, 1)
    coordinates = sum(p.numel() for p in engine.model.parameters())
    # Box-Muller: two 8-byte uniforms per pair of noise coordinates, plus 8 bytes per example for sampling.
    assert sum(drawn) >= 8 * coordinates + 8 * 60
    assert engine.randomness.secret and engine.randomness.seed is None
    assert "seed" not in str(engine.guarantee())
    assert engine.state_dict()["randomness"]["randomness"] == "secure"


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


def test_secure_rng_keeps_working_and_is_refused_with_a_seed():
    assert private(secure_rng=True).randomness.secret
    with pytest.raises(ValueError, match="contradict"):
        private(secure_rng=True, seed=0)


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


class InlineExecutor:
    """Runs each submitted draw at once, so that the order of draws does not depend on the timing of
    the background thread (the draw ahead is then made the moment it is asked for)."""

    def __init__(self, **_):
        pass

    def submit(self, fn, *args):
        future = Future()
        future.set_result(fn(*args))
        return future


@pytest.fixture
def numbered_draws(monkeypatch):
    """Replaces the OS-backed Box-Muller draw by one whose k-th call returns k everywhere, to follow
    which block each release receives."""
    calls = []

    def draw(count):
        calls.append(count)
        return torch.full((count,), float(len(calls)), dtype=torch.float64)

    monkeypatch.setattr(randomness_module, "_secure_normal", draw)
    monkeypatch.setattr(randomness_module, "ThreadPoolExecutor", InlineExecutor)
    return calls


def test_secure_noise_is_drawn_one_release_ahead_and_each_block_is_used_once(numbered_draws):
    randomness = randomness_module.SecretSource()
    shapes = [torch.Size([30, 40]), torch.Size([40])]
    first = randomness.normals(shapes, torch.device("cpu"), torch.float32)
    second = randomness.normals(shapes, torch.device("cpu"), torch.float32)
    third = randomness.normals(shapes, torch.device("cpu"), torch.float32)
    # call 1 serves the first release at once; each release then starts the next block's draw
    assert [float(z[0].flatten()[0]) for z in (first, second, third)] == [1.0, 2.0, 3.0]
    assert numbered_draws == [1240] * 4  # three used, the fourth drawn ahead for the next release
    assert [z.shape for z in third] == shapes


def test_blocks_drawn_ahead_are_kept_per_size_and_small_draws_are_not_drawn_ahead(numbered_draws):
    randomness = randomness_module.SecretSource()
    cpu, f64 = torch.device("cpu"), torch.float64
    big, small = torch.Size([2000]), torch.Size([3])
    assert float(randomness.normal(big, cpu, f64)[0]) == 1.0
    assert float(randomness.normal(small, cpu, f64)[0]) == 3.0  # block 2 is the big one drawn ahead
    assert float(randomness.normal(small, cpu, f64)[0]) == 4.0  # nothing of size 3 was drawn ahead
    assert float(randomness.normal(big, cpu, f64)[0]) == 2.0
    assert numbered_draws == [2000, 2000, 3, 3, 2000]


def test_a_forked_process_never_uses_noise_drawn_ahead_before_the_fork(numbered_draws, monkeypatch):
    randomness = randomness_module.SecretSource()
    shape = [torch.Size([5000])]
    assert float(randomness.normals(shape, torch.device("cpu"), torch.float64)[0][0]) == 1.0
    monkeypatch.setattr(randomness_module.os, "getpid", lambda: -1)  # as seen from a forked child
    assert float(randomness.normals(shape, torch.device("cpu"), torch.float64)[0][0]) == 3.0


def test_secure_normals_are_standard_normal():
    z = randomness_module._secure_normal(200_001)
    assert z.shape == (200_001,) and z.dtype == torch.float64
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    assert abs(float((z.abs() < 1).double().mean()) - 0.6827) < 0.005  # the normal's mass within 1σ


def test_secure_poisson_samples_are_drawn_one_step_ahead_and_each_block_is_used_once(monkeypatch):
    calls = []

    def draw(count):  # the k-th draw includes exactly the examples 0..k-1
        calls.append(count)
        return (torch.arange(count) >= len(calls)).double()

    monkeypatch.setattr(randomness_module, "_secure_uniform", draw)
    monkeypatch.setattr(randomness_module, "ThreadPoolExecutor", InlineExecutor)
    randomness = randomness_module.SecretSource()
    included = [randomness.inclusion(step, 2000, 0.5) for step in range(3)]
    assert [int(mask.sum()) for mask in included] == [1, 2, 3]  # blocks 1, 2, 3: each used once
    assert calls == [2000] * 4  # the fourth drawn ahead for the next step
    assert int(randomness.inclusion(3, 100, 0.5).sum()) == 5  # a small draw is made when asked
    assert calls == [2000] * 4 + [100]


FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_v0_1.pt"


@pytest.mark.parametrize("kind, seed", [("seeded", 3), ("secret", None)])
def test_a_checkpoint_written_by_0_1_resumes(kind, seed):
    """``checkpoint_v0_1.pt`` was written by the code of 0.1 (``Randomness(secure)``, commit 1725c10) after 2
    steps of ``private(seed=...)``, with the weights and ε after 2 more: a seeded run resumed from it
    continues bit for bit (sampling and noise streams), a secret one continues its ledger."""
    saved = torch.load(FIXTURE, weights_only=True)[kind]
    assert set(saved["privacy"]["randomness"]) == {"seed", "secure", "randomness", "noise"}  # 0.1's keys
    resumed = private(seed=seed)
    resumed.model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["privacy"])
    assert resumed.randomness.secret == (seed is None) and resumed.steps == 2
    train(resumed, 2)
    assert resumed.epsilon() == saved["epsilon_after_two_more_steps"]
    after = saved["model_after_two_more_steps"]
    same = [torch.equal(w, after[name]) for name, w in resumed.model.state_dict().items()]
    assert all(same) if kind == "seeded" else not any(same)
