"""lr="auto" for optimizers other than plain SGD: DoG's SGD step η_t translated to the learning rate at which
the optimizer's update carries the same noise walk, lr_t = η_t·√(Σ s_j² / Σ P_j² s_j²) (Adam-type:
P_j = 1/(√max(v̂_j, s_j²) + ε); Adagrad: the same with v a sum; momentum μ: P = 1/(1 − μ)). The factor by
hand on known steps, the walk within the budget under pure noise, nothing released, the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from support import component_step
from test_autolr_dog import KnownNoise, private_run
from torch import nn

from tunefree.components.dog import NOISE_BUDGET, DistanceOverGradients, DoG
from tunefree.components.dog_optimizers import OptimizerDoG
from tunefree.privacy.ledger import to_dict
from tunefree.step.component import StepReport

GRADIENTS = [[0.5, -1.0, 0.25, 0.0], [0.4, -0.7, 0.1, 0.02], [0.1, -0.9, 0.3, -0.01]]


def steps_of(rule, optimizer, weight, gradients, std):
    """Step ``optimizer`` on ``weight`` with the given released gradients under ``rule``; the lrs set."""
    lrs = []
    for t, g in enumerate(gradients):
        weight.grad = torch.as_tensor(g, dtype=torch.float64).clone()
        report = StepReport(step=t + 1, examples=4, thresholds={"all": 1.0})
        step, released = component_step(report, optimizer)
        rule.before_update(step)
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        rule.after_update(step)
        assert released == []  # nothing released
    return lrs


def adam_rule(std=2.0, batch=4.0, make=lambda w: torch.optim.AdamW([w], lr=1.0), planned_steps=None,
              noise_budget=NOISE_BUDGET):
    weight = nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 0.3], dtype=torch.float64))
    optimizer = make(weight)
    rule = OptimizerDoG(optimizer, KnownNoise([weight], std), batch,
                        DoG(initial_distance=0.1, noise_budget=noise_budget), planned_steps=planned_steps)
    return rule, optimizer, weight


def test_adam_factor_by_hand():
    """lr_t = η_t·√(Σ s² / Σ s²/(√max(v̂, s²) + ε)²) with v̂ Adam's bias-corrected second moment of the
    released gradients, η_t DoG's SGD step (the first one equal to plain DoG's on the same gradient)."""
    std, batch = 2.0, 4.0
    s2 = (std / batch) ** 2
    rule, optimizer, weight = adam_rule(std, batch)
    beta2, eps = optimizer.param_groups[0]["betas"][1], optimizer.param_groups[0]["eps"]
    lrs = steps_of(rule, optimizer, weight, GRADIENTS, std)
    v, factors = torch.zeros(4, dtype=torch.float64), []
    for t, g in enumerate(GRADIENTS, start=1):
        v = beta2 * v + (1 - beta2) * torch.tensor(g, dtype=torch.float64) ** 2
        expected = torch.clamp(v / (1 - beta2 ** t), min=s2)
        factors.append(math.sqrt(4 * s2 / float((s2 / (expected.sqrt() + eps) ** 2).sum())))
    assert rule.factor == pytest.approx(factors[-1], rel=1e-9)
    assert lrs[-1] == rule.sgd_lr * rule.factor and rule.history == lrs
    plain_weight = nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 0.3], dtype=torch.float64))
    plain = DistanceOverGradients(KnownNoise([plain_weight], std), batch, DoG(initial_distance=0.1))
    first_eta = steps_of(plain, torch.optim.SGD([plain_weight], lr=1.0), plain_weight, GRADIENTS[:1], std)[0]
    assert lrs[0] == pytest.approx(first_eta * factors[0], rel=1e-9)
    assert math.sqrt(s2) < factors[0] < 1.0  # between the noise's deviation and the largest |g|


def test_without_noise_the_factor_is_the_rms_of_the_second_moments_root():
    """σ = 0 (a reference run): no walk to match; lr = η·√(mean v̂), the update of SGD's step length."""
    rule, optimizer, weight = adam_rule(std=0.0)
    steps_of(rule, optimizer, weight, GRADIENTS[:2], 0.0)
    g = torch.tensor(GRADIENTS[:2], dtype=torch.float64)
    v = (0.999 * 0.001 * g[0] ** 2 + 0.001 * g[1] ** 2) / (1 - 0.999 ** 2)
    assert rule.factor == pytest.approx(math.sqrt(float(v.mean())), rel=1e-9) and rule.factor > 0


def test_momentum_and_adagrad_factors():
    """Momentum μ: lr = (1 − μ)·η. Adagrad: its second moment is the sum of squares (no correction)."""
    rule, optimizer, weight = adam_rule(make=lambda w: torch.optim.SGD([w], lr=1.0, momentum=0.9))
    lrs = steps_of(rule, optimizer, weight, GRADIENTS, 2.0)
    assert lrs[-1] == pytest.approx(0.1 * rule.sgd_lr, rel=1e-12)
    rule, optimizer, weight = adam_rule(std=0.4, make=lambda w: torch.optim.Adagrad([w], lr=1.0))
    steps_of(rule, optimizer, weight, GRADIENTS, 0.4)
    s2, eps = 0.01, optimizer.param_groups[0]["eps"]
    total = torch.tensor(GRADIENTS, dtype=torch.float64).square().sum(0)
    factor = math.sqrt(4 * s2 / float((s2 / (torch.clamp(total, min=s2).sqrt() + eps) ** 2).sum()))
    assert rule.factor == pytest.approx(factor, rel=1e-6)


def test_pure_noise_walk_of_adamw_stays_within_the_budget():
    """Released gradients that are noise only: the walk Σ lr_t² Σ_j s_j²/(√v̂_j + ε)² of AdamW's update
    over the planned run stays within the budget (κ(1 + ‖x₀‖))², as DoG's SGD walk does."""
    std, batch, planned = 2.0, 4.0, 20
    rule, optimizer, weight = adam_rule(std, batch, planned_steps=planned, noise_budget=0.1)
    budget = (0.1 * (1 + float(weight.detach().norm()))) ** 2
    noise = torch.Generator().manual_seed(3)
    walk, v = 0.0, torch.zeros(4, dtype=torch.float64)
    s2 = (std / batch) ** 2
    for t in range(1, planned + 1):
        g = torch.randn(4, generator=noise, dtype=torch.float64) * math.sqrt(s2)
        lr = steps_of(rule, optimizer, weight, [g.tolist()], std)[0]
        v = 0.999 * v + 0.001 * g ** 2
        walk += lr ** 2 * float((s2 / (torch.clamp(v / (1 - 0.999 ** t), min=s2).sqrt() + 1e-8) ** 2).sum())
    assert walk <= budget * (1 + 1e-9)
    assert walk >= 0.5 * budget  # and the budget is what set the step (DoG alone would take more)


def test_make_private_with_adamw_spends_exactly_the_plain_run():
    """lr='auto' with AdamW: no release of its own (same ledger and ε as AdamW at a fixed lr); the
    optimizer's lr is the rule's at every step, and the averaged model is kept as for SGD."""
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1.0)  # noqa: E731
    _, plain = private_run(None, adamw)
    _, auto = private_run("auto", adamw)
    assert to_dict(auto.ledger.event()) == to_dict(plain.ledger.event())
    assert auto.epsilon() == plain.epsilon()
    rule = auto.lr_rule
    assert isinstance(rule, OptimizerDoG) and len(rule.history) == 6
    assert auto.optimizer.param_groups[0]["lr"] == rule.history[-1] == rule.sgd_lr * rule.factor
    assert 0 < rule.factor < 1  # noise per coordinate: σ/(qN) = 1/16


@pytest.mark.parametrize("make, message", [
    (lambda m: torch.optim.RMSprop(m.parameters()), "RMSprop"),
    (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), "amsgrad"),
    (lambda m: torch.optim.SGD(m.parameters(), lr=1.0, momentum=0.9, dampening=0.5), "dampening"),
])
def test_refuses_what_it_cannot_translate(make, message):
    with pytest.raises(ValueError, match=message) as refused:
        private_run("auto", make)
    if message == "RMSprop":
        assert "AdamW" in str(refused.value) and "HyFreeDP" in str(refused.value)


def test_state_round_trip_continues_the_same_learning_rates():
    rule, optimizer, weight = adam_rule(planned_steps=3)
    steps_of(rule, optimizer, weight, GRADIENTS[:2], 2.0)
    resumed = OptimizerDoG(optimizer, KnownNoise([weight], 2.0), 4.0, DoG(initial_distance=0.1),
                           planned_steps=3)
    resumed.load_state_dict(rule.state_dict())
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[weight].items()}
    value = weight.detach().clone()
    straight = steps_of(rule, optimizer, weight, GRADIENTS[2:], 2.0)
    optimizer.state[weight] = state
    with torch.no_grad():
        weight.copy_(value)
    assert steps_of(resumed, optimizer, weight, GRADIENTS[2:], 2.0) == pytest.approx(straight, rel=0)


def test_cli_optimizers_take_lr_auto():
    """Every optimizer the command line offers runs with lr='auto' (two steps)."""
    from tunefree.cli.training import OPTIMIZERS

    for name, make in OPTIMIZERS.items():
        _, engine = private_run("auto", lambda m, make=make: make(m.parameters(), 1.0), steps=2)
        assert len(engine.lr_rule.history) == 2 and all(lr > 0 for lr in engine.lr_rule.history), name
