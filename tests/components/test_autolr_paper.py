"""HyFreeDP's learning rate against the paper's equations: the fit (equations 6-7, Algorithm 1 lines 7-11)
with unequal per-example losses, the loss bound R_l = Σ_k L̃^(k), the probe points, and the accounting of
every probe release against the solved plan (Algorithm 2)."""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.components.hyfreedp import LossShare, gen_learning_rate
from tunefree.privacy.ledger import to_dict

N = 8


def regression_data():
    """Eight examples whose squared errors at the start all differ (0.002 to 7.1): two above the
    initial R_l = 1, so the clipping of equation 7 bites."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    y = torch.tensor([0.3, -0.2, 0.5, 2.5, -2.4, 0.6, -0.1, 0.2], dtype=torch.float64)
    return x, y


def per_sample_losses(model, x, y):
    return 0.5 * (model(x).squeeze(1) - y) ** 2


def paper_engine(auto: tunefree.HyFreeDP, noise_multiplier=0.0, steps=4):
    x, y = regression_data()
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=123.0)  # overwritten by HyFreeDP
    engine = tunefree.make_private(
        model, optimizer, DataLoader(TensorDataset(x, y), batch_size=N), noise_multiplier=noise_multiplier,
        target_delta=1e-2, clipping="abadi", max_grad_norm=1e6, steps=steps, lr=auto, seed=0,
        accountant="rdp")  # RDP: a fast calibration of the loss noise
    return model, engine


def one_step(model, engine, losses=per_sample_losses):
    """One private step on the whole data set (q = 1: every example is in every batch)."""
    x, y = next(iter(engine.data_loader))
    assert len(y) == N
    engine.optimizer.zero_grad()
    per_sample_losses(model, x, y).mean().backward()
    engine.optimizer.step(lambda: losses(model, x, y))


def closed_form(model, w, w_next, lr_used, lr_initial, bound):
    """The paper's η = b/a from the clipped losses at w − Δ, w, w + Δ, recomputed by hand: the private
    SGD step taken was w_next = w − lr_used·m, the probes were at Δ = −lr_initial·m."""
    x, y = regression_data()
    m = (w - w_next) / lr_used
    values = []
    with torch.no_grad():
        for sign in (-1, 0, 1):
            model.weight.copy_(w - sign * lr_initial * m)
            values.append(per_sample_losses(model, x, y))
        model.weight.copy_(w_next)
    means = [float(v.clamp(-bound, bound).sum()) / N for v in values]
    slope = (means[0] - means[2]) / (2 * lr_initial)
    curvature = (means[0] + means[2] - 2 * means[1]) / lr_initial ** 2
    return slope / curvature, means


def test_eta_is_b_over_a_of_the_clipped_unequal_losses():
    model, engine = paper_engine(tunefree.HyFreeDP(interval=1, initial_lr=0.01))
    x, y = regression_data()
    with torch.no_grad():
        start = per_sample_losses(model, x, y)
    assert start.max() > 1 > start.min() and len(set(start.tolist())) == N  # unequal, some clipped
    w = model.weight.detach().clone()
    one_step(model, engine)
    auto = engine.lr_rule
    fit, = auto.history
    expected, means = closed_form(model, w, model.weight.detach().clone(), auto.lr, 0.01, bound=1.0)
    assert fit.loss_bound == 1.0  # the paper's initial R_l
    assert fit.losses == pytest.approx(means, rel=1e-12)
    assert auto.lr == fit.lr == pytest.approx(expected, rel=1e-10)
    assert not 0.005 <= auto.lr <= 0.02  # no clamp to [η/2, 2η], no smoothing: b/a as it is


def test_the_next_loss_bound_is_the_sum_of_the_three_privatised_losses():
    model, engine = paper_engine(tunefree.HyFreeDP(interval=1, initial_lr=0.01), noise_multiplier=0.5)
    for _ in range(3):
        one_step(model, engine)
    history = engine.lr_rule.history
    assert [f.loss_bound for f in history] == [1.0, sum(history[0].losses), sum(history[1].losses)]
    assert history[1].loss_bound != pytest.approx(history[0].losses[1])  # not the mean rule


def test_eta_is_kept_where_the_fit_has_no_minimiser():
    assert gen_learning_rate((1.0, 1.2, 1.0), 0.1)[2] == 0.1  # a < 0: a maximum along the update
    assert gen_learning_rate((1.0, 0.9, 1.2), 0.1)[2] == 0.1  # b < 0: the loss rises along the update
    slope, curvature, lr = gen_learning_rate((1.2, 1.0, 0.9), 0.1)
    assert (slope, curvature) == pytest.approx((1.5, 10.0)) and lr == pytest.approx(0.15)


def test_the_closure_runs_at_w_minus_delta_w_and_w_plus_delta_and_the_weights_come_back():
    """Line 7: the losses at w ± Δ, Δ = −η·m the optimizer's update at the current η (SGD: m the released
    gradient), and at w (line 2's losses); the step then updates from w."""
    model, engine = paper_engine(tunefree.HyFreeDP(interval=1, initial_lr=0.01))
    calls = []

    def losses(model, x, y):
        calls.append(model.weight.detach().clone())
        return per_sample_losses(model, x, y)

    w = model.weight.detach().clone()
    one_step(model, engine, losses)
    gradient = model.weight.grad
    assert len(calls) == 3 and torch.equal(calls[1], w)
    torch.testing.assert_close(calls[0], w + 0.01 * gradient, rtol=1e-12, atol=0)
    torch.testing.assert_close(calls[2], w - 0.01 * gradient, rtol=1e-12, atol=0)
    torch.testing.assert_close(model.weight.detach(), w - engine.lr_rule.lr * gradient, rtol=1e-12, atol=0)


def joint(releases):
    return releases[0] if len(releases) == 1 else dpa.ComposedDpEvent(releases)


@pytest.mark.parametrize("interval", [1, 3])
def test_every_probe_release_is_in_the_ledger_as_the_plan_solved_it(interval):
    model, engine = paper_engine(tunefree.HyFreeDP(interval=interval), noise_multiplier=1.0, steps=7)
    plan = engine.plan
    share = plan.share(LossShare)
    assert share.noise > 0 and engine.lr_rule.loss_noise == share.noise
    for _ in range(7):
        one_step(model, engine)
    recorded = [event for event, count in engine.ledger.state_dict()["runs"] for _ in range(count)]
    planned = [to_dict(dpa.PoissonSampledDpEvent(plan.sample_rate, joint(plan.step_releases(t))))
               for t in range(1, 8)]
    assert recorded == planned
    per_update = [len(plan.step_releases(t)) - 1 for t in range(1, 8)]
    assert per_update == [3 if (t - 1) % interval == 0 else 0 for t in range(1, 8)]
    assert engine.epsilon() == pytest.approx(plan.epsilon(), rel=1e-9)


def test_options_are_validated():
    with pytest.raises(ValueError, match="interval"):
        tunefree.HyFreeDP(interval=0)
    with pytest.raises(ValueError, match="initial_lr"):
        tunefree.HyFreeDP(initial_lr=-1.0)
    with pytest.raises(ValueError, match="> 1"):
        tunefree.HyFreeDP(gradient_noise_increase=1.0)
    assert math.isclose(tunefree.HyFreeDP().initial_lr, 1e-4) and tunefree.HyFreeDP().interval == 5
