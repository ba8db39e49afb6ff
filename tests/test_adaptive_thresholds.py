"""Adaptive group-wise clipping: private quantile thresholds, the budget split, noise allocation."""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.grouping import make_groups
from tunefree.privacy.accounting import epsilon_of
from tunefree.privacy.mechanisms import GradientRelease
from tunefree.privacy.randomness import Randomness
from tunefree.thresholds import count_event, split_budget


def data(n=200):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def train(engine, steps):
    taken = 0
    while taken < steps:
        for x, y in engine.data_loader:
            engine.optimizer.zero_grad()
            F.cross_entropy(engine.model(x), y).backward()
            engine.optimizer.step()
            taken += 1
            if taken == steps:
                return


@pytest.mark.parametrize("groups", ["all-layer", "per-layer", "per-param"])
@pytest.mark.parametrize("quantile", [0.3, 0.7])
def test_thresholds_converge_to_the_empirical_quantile_without_noise(groups, quantile):
    net = model()
    dataset = data()
    engine = tunefree.make_private(
        net, torch.optim.SGD(net.parameters(), lr=0.0), DataLoader(dataset, batch_size=200),
        noise_multiplier=0.0, target_delta=1e-3, groups=groups, clipping="abadi",
        thresholds="adaptive", target_quantile=quantile, quantile_lr=0.2, max_grad_norm=5.0)
    train(engine, 300)  # q = 1: every step sees all 200 examples; the weights never move
    norms = engine.last_step.group_norms
    for group in engine.groups:
        sorted_norms = norms[group.name].sort().values
        threshold = engine.clip_thresholds[group.name]
        within = (sorted_norms <= threshold).double().mean().item()
        # the geometric update settles where the fraction within the threshold is q, up to one
        # example on either side and the multiplicative step exp(±η/B)
        assert abs(within - quantile) <= 2 / 200 + 1e-9, (group.name, within)
        empirical = torch.quantile(sorted_norms.double(), quantile).item()
        assert threshold == pytest.approx(empirical, rel=0.15)


def test_proposition_3_1_identity():
    sigma, k, r = 1.3, 7, 0.05
    gradient_sigma, count_std = split_budget(sigma, k, r)
    assert gradient_sigma == pytest.approx(sigma / math.sqrt(1 - r))
    assert (gradient_sigma ** -2 + k / (2 * count_std) ** 2) == pytest.approx(sigma ** -2, rel=1e-12)
    assert k * sigma ** 2 / (4 * count_std ** 2) == pytest.approx(r)  # Remark 3.1
    # the same identity through dp_accounting's PLD (unsampled composition, no reduction by us)
    both = dpa.ComposedDpEvent([dpa.GaussianDpEvent(gradient_sigma), count_event(count_std, k)])
    assert epsilon_of(both, 1e-5) == pytest.approx(epsilon_of(dpa.GaussianDpEvent(sigma), 1e-5),
                                                   rel=2e-3)


def test_joint_accounting_meets_the_target():
    net = model()
    engine = tunefree.make_private(
        net, torch.optim.SGD(net.parameters(), lr=0.1), DataLoader(data(), batch_size=20),
        target_epsilon=2.0, target_delta=1e-3, epochs=3, groups="per-layer",
        thresholds="adaptive", quantile_budget=0.1, seed=0)
    train(engine, engine.planned_steps)
    assert engine.steps == engine.planned_steps == 30
    # every step recorded the gradient and the counts as one sampled event
    event = engine.ledger.event().events[0].event
    assert isinstance(event.event, dpa.ComposedDpEvent) and len(event.event.events) == 2
    assert 0.99 * 2.0 <= engine.epsilon() <= 2.0
    gradient_sigma = engine.optimizer.release.noise_multiplier
    assert gradient_sigma == pytest.approx(engine.noise_multiplier / math.sqrt(0.9))
    # and the thresholds moved
    assert any(abs(c - 1 / math.sqrt(2)) > 1e-3 for c in engine.clip_thresholds.values())


@pytest.mark.parametrize("allocation", ["global", "equal-budget", "weighted"])
def test_noise_standard_deviation_of_each_group(allocation):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(60, 100), nn.Linear(100, 40))
    groups = make_groups(net, {"a": ["0.weight"], "b": ["0.bias", "1.bias"], "c": ["1.weight"]},
                         {"a": 0.5, "b": 2.0, "c": 1.0})
    sigma = 1.5
    release = GradientRelease(groups, sigma, Randomness(seed=3), allocation)
    noisy, event = release.release({})
    thresholds = [g.threshold for g in groups]
    gammas = {"global": [1.0] * 3, "equal-budget": thresholds,
              "weighted": [g.threshold / math.sqrt(g.size) for g in groups]}[allocation]
    s = math.sqrt(sum((c / gamma) ** 2 for c, gamma in zip(thresholds, gammas)))
    for group, gamma in zip(groups, gammas):
        values = torch.cat([noisy[p].flatten() for p in group.params])
        expected = sigma * s * gamma  # Algorithm 1, line 13
        tolerance = 5 / math.sqrt(2 * values.numel())  # five standard errors of a sample sd
        assert abs(values.std().item() / expected - 1) < tolerance, (group.name, allocation)
    assert event.noise_multiplier == sigma


def test_checkpoint_keeps_the_thresholds():
    def fresh():
        net = model()
        return tunefree.make_private(
            net, torch.optim.SGD(net.parameters(), lr=0.1), DataLoader(data(), batch_size=20),
            noise_multiplier=1.0, target_delta=1e-3, groups="per-layer", thresholds="adaptive",
            seed=4)

    engine = fresh()
    train(engine, 7)
    resumed = fresh()
    resumed.load_state_dict(engine.state_dict())
    assert resumed.clip_thresholds == engine.clip_thresholds


@pytest.mark.parametrize("kwargs,match", [
    ({"thresholds": "learned"}, "thresholds"),
    ({"thresholds": "adaptive", "target_quantile": 1.0}, "target_quantile"),
    ({"thresholds": "adaptive", "quantile_lr": 0.0}, "quantile_lr"),
    ({"thresholds": "adaptive", "quantile_budget": 1.0}, "quantile_budget"),
])
def test_bad_adaptive_settings_are_refused(kwargs, match):
    net = model()
    with pytest.raises(ValueError, match=match):
        tunefree.make_private(net, torch.optim.SGD(net.parameters(), lr=0.1),
                              DataLoader(data(), batch_size=20), noise_multiplier=1.0,
                              target_delta=1e-3, **kwargs)
