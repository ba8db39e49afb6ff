"""The front door: validation, Poisson sampling, noise, empty batches, micro-batches, checkpoints."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from support.marks import slow_case
from support.training import train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

import tunefree


def dataset(n=200, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g))


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def private(model=None, data=None, batch_size=20, **kwargs):
    model = model or small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"noise_multiplier": 1.0, "target_delta": 1e-4, "seed": 0, **kwargs}
    return tunefree.make_private(model, opt, DataLoader(data or dataset(), batch_size=batch_size),
                                 **options)


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs,match", [
    ({"target_epsilon": 1.0, "noise_multiplier": 1.0, "epochs": 1}, "exactly one"),
    ({"noise_multiplier": None}, "exactly one"),
    ({"noise_multiplier": None, "target_epsilon": 1.0}, "epochs or steps"),
    ({"noise_multiplier": None, "target_epsilon": -1.0, "epochs": 1}, "positive"),
    ({"target_delta": 0.01}, "1/N"),
    ({"target_delta": 0.0}, r"\(0, 1\)"),
    ({"epochs": 1, "steps": 3}, "not both"),
    ({"accountant": "gdp"}, "accountant"),
    ({"clipping": "median"}, "clipping"),
    ({"groups": "per-block"}, "groups"),
    ({"loss_reduction": "max"}, "loss_reduction"),
    ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ({"physical_batch_size": 0}, "physical_batch_size"),
])
def test_bad_arguments_are_refused_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        private(**kwargs)


def test_eval_mode_model_is_refused():
    model = small_model().eval()
    with pytest.raises(ValueError, match="model.train()"):
        private(model)


def test_batch_size_above_dataset_is_refused():
    with pytest.raises(ValueError, match="> 1"):
        private(batch_size=500)


def test_weighted_sampler_is_refused():
    data = dataset()
    loader = DataLoader(data, batch_size=10, sampler=WeightedRandomSampler([1.0] * 200, 200))
    model = small_model()
    with pytest.raises(ValueError, match="Poisson"):
        tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                              noise_multiplier=1.0, target_delta=1e-4)


def test_optimizer_missing_parameters_is_refused():
    model = small_model()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not in the optimizer"):
        tunefree.make_private(model, opt, DataLoader(dataset(), batch_size=10),
                              noise_multiplier=1.0, target_delta=1e-4)


def test_model_is_the_same_object_and_detaches_cleanly():
    model = small_model()
    engine = private(model)
    assert engine.model is model
    assert isinstance(engine.optimizer, torch.optim.Optimizer)
    assert engine.detach() is model


# ----------------------------------------------------------------------------- calibration
@pytest.mark.slow
def test_target_epsilon_is_met_by_the_planned_run():
    engine = private(noise_multiplier=None, target_epsilon=2.0, epochs=3)
    assert engine.planned_steps == 3 * 10
    spent = tunefree.epsilon(noise_multiplier=engine.noise_multiplier, sample_rate=0.1,
                             steps=30, delta=1e-4)
    assert 0.99 * 2.0 <= spent <= 2.0
    train(engine, 30)
    assert engine.steps == 30
    assert engine.epsilon() == pytest.approx(spent, rel=1e-9)


def test_zero_noise_reports_infinite_epsilon():
    engine = private(noise_multiplier=0.0)
    train(engine, 2)
    assert engine.epsilon() == math.inf


# ----------------------------------------------------------------------------- Poisson sampling
def test_poisson_inclusion_frequency():
    engine = private(batch_size=20)  # q = 0.1
    counts = torch.zeros(200)
    sizes = []
    sampler = engine.data_loader.batch_sampler
    for step in range(400):
        included = engine.randomness.inclusion(step, 200, sampler.sample_rate)
        counts += included
        sizes.append(int(included.sum()))
    # Each example: Binomial(400, 0.1) → mean 40, sd 6; the mean over 200 examples has sd 0.42.
    assert abs(counts.mean().item() - 40) < 2.0
    assert counts.min() > 10 and counts.max() < 70
    sizes = torch.tensor(sizes, dtype=torch.float64)
    assert abs(sizes.var().item() - 200 * 0.1 * 0.9) < 5  # Var = Nq(1-q) = 18
    assert len(engine.data_loader) == 10


def test_same_seed_same_batches_different_seed_different_batches():
    first = list(private(seed=5).data_loader.batch_sampler)
    second = list(private(seed=5).data_loader.batch_sampler)
    third = list(private(seed=6).data_loader.batch_sampler)
    assert first == second and first != third


def test_empty_batches_still_step_add_noise_and_are_accounted():
    data = dataset(n=50)
    engine = private(data=data, batch_size=1, target_delta=1e-3)  # q = 0.02: many empty batches
    before = [p.detach().clone() for p in engine.model.parameters()]
    empty = 0
    for x, y in engine.data_loader:
        engine.optimizer.zero_grad()
        if len(y) == 0:
            empty += 1
            assert x.shape == (0, 5)
        F.cross_entropy(engine.model(x), y).backward()
        engine.optimizer.step()
    assert empty > 0
    assert engine.steps == 50
    assert all(not torch.equal(b, p) for b, p in zip(before, engine.model.parameters()))


def test_skipping_step_on_a_batch_is_an_error():
    engine = private()
    batches = iter(engine.data_loader)
    next(batches)
    with pytest.raises(RuntimeError, match="step"):
        next(batches)


def test_non_poisson_loader_needs_opt_in_and_says_so():
    with pytest.warns(UserWarning, match="Poisson approximation"):
        engine = private(poisson_sampling=False)
    assert engine.data_loader.batch_size == 20
    train(engine, 3)
    assert "Poisson approximation" in str(engine.guarantee())


# ----------------------------------------------------------------------------- noise
@pytest.mark.parametrize("groups", ["all-layer", "per-layer", "per-param"])
def test_noise_standard_deviation_is_sigma_times_sensitivity(groups):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 50))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = tunefree.make_private(model, opt, DataLoader(dataset(n=1000, d=100), batch_size=10),
                                   noise_multiplier=1.7, max_grad_norm=2.5, groups=groups,
                                   target_delta=1e-4, seed=1)
    engine.optimizer.step()  # no backward: the clipped sum is zero, the gradient is pure noise
    noise = torch.cat([p.grad.flatten() for p in model.parameters()]) * 10  # × q·N
    expected = 1.7 * 2.5
    # 15,150 draws: the sample sd has relative sd 0.6%; 3% is five of those.
    assert abs(noise.std().item() / expected - 1) < 0.03
    assert abs(noise.mean().item()) < 5 * expected / math.sqrt(noise.numel())
    assert engine.steps == 1


def test_secure_randomness_trains():
    engine = private(seed=None)
    train(engine, 3)
    assert engine.steps == 3 and engine.randomness.secret


# ----------------------------------------------------------------------------- micro-batches
def test_physical_micro_batches_give_the_same_step_as_whole_batches():
    whole = private(model=small_model().double(), data=_double(dataset()))
    split = private(model=small_model().double(), data=_double(dataset()), physical_batch_size=3)
    train(whole, 5)
    train(split, 5)
    assert whole.steps == split.steps == 5
    for p, q in zip(whole.model.parameters(), split.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def _double(data):
    x, y = data.tensors
    return TensorDataset(x.double(), y)


def test_lr_scheduler_drives_the_wrapped_optimizer():
    engine = private()
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    train(engine, 2)
    scheduler.step()
    scheduler.step()
    assert engine.optimizer.original.param_groups[0]["lr"] == pytest.approx(0.025)


# ----------------------------------------------------------------------------- checkpoints
def _fresh(seed=3):
    model = small_model().double()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = tunefree.make_private(model, opt, DataLoader(_double(dataset()), batch_size=20),
                                   noise_multiplier=1.1, target_delta=1e-4, seed=seed)
    return model, opt, engine


@pytest.mark.parametrize("stop_after", [slow_case(10), 14])  # an epoch boundary and mid-epoch
def test_checkpoint_and_resume_continue_the_same_run(stop_after):
    model, _, engine = _fresh()
    train(engine, 25)

    model_a, opt_a, engine_a = _fresh()
    train(engine_a, stop_after)
    checkpoint = copy.deepcopy({"model": model_a.state_dict(), "optimizer": opt_a.state_dict(),
                                "privacy": engine_a.state_dict()})
    model_b, opt_b, engine_b = _fresh(seed=99)  # the checkpoint's seed wins
    model_b.load_state_dict(checkpoint["model"])
    engine_b.optimizer.load_state_dict(checkpoint["optimizer"])
    engine_b.load_state_dict(checkpoint["privacy"])
    train(engine_b, 25 - stop_after)
    assert engine_b.steps == 25
    assert engine_b.epsilon() == engine.epsilon()
    for p, q in zip(model.parameters(), model_b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_checkpoint_of_another_run_is_refused():
    _, _, engine = _fresh()
    state = engine.state_dict()
    other = private()
    with pytest.raises(ValueError, match="other privacy settings"):
        other.load_state_dict(state)


def test_warning_free_default_path():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = private()
        train(engine, 2)


@pytest.mark.parametrize("kwargs", [
    {"noise_allocation": "random"}, {"lr": "fast"},
    {"thresholds": tunefree.AdaptiveQuantile(rescale=True), "clipping": "abadi"},  # refused while assembling
])
def test_refused_arguments_leave_the_model_unhooked(kwargs):
    model = small_model()
    with pytest.raises(ValueError):
        private(model, **kwargs)
    x, y = dataset().tensors
    F.cross_entropy(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())  # ordinary autograd, no engine
