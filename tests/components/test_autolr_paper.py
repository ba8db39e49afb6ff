"""lr="auto" against the HyFreeDP paper's equations: the fit (equations 6-7, Algorithm 1 lines 7-11) with
unequal per-example losses, the loss bound R_l = Σ_k L̃^(k), the reuse of L(w) from the training forward,
the loss-difference probes, and the accounting of every probe release against the solved plan."""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
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


def paper_engine(auto: tunefree.AutoLR, noise_multiplier=0.0, steps=4):
    x, y = regression_data()
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=123.0)  # overwritten by lr="auto"
    engine = tunefree.make_private(
        model, optimizer, DataLoader(TensorDataset(x, y), batch_size=N), noise_multiplier=noise_multiplier,
        target_delta=1e-2, clipping="abadi", max_grad_norm=1e6, steps=steps, lr=auto, seed=0,
        accountant="rdp")  # RDP: a fast calibration of the loss noise
    return model, engine


def auto_component(engine):
    return engine.lr_rule


def one_step(model, engine, reuse=False):
    """One private step on the whole data set (q = 1: every example is in every batch)."""
    x, y = next(iter(engine.data_loader))
    assert len(y) == N
    engine.optimizer.zero_grad()
    losses = per_sample_losses(model, x, y)
    if reuse:
        auto_component(engine).record_training_losses(losses)
    losses.mean().backward()
    engine.optimizer.step(lambda: per_sample_losses(model, x, y))


def closed_form(model, w, w_next, lr_used, lr_initial, bound, differences=False):
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
    if differences:
        values = [values[0] - values[1], torch.zeros(N, dtype=torch.float64), values[2] - values[1]]
    means = [float(v.clamp(-bound, bound).sum()) / N for v in values]
    slope = (means[0] - means[2]) / (2 * lr_initial)
    curvature = (means[0] + means[2] - 2 * means[1]) / lr_initial ** 2
    return slope / curvature, means


@pytest.mark.parametrize("reuse", [False, True])
def test_paper_mode_sets_eta_to_b_over_a_of_the_clipped_unequal_losses(reuse):
    model, engine = paper_engine(tunefree.AutoLR(interval=1, mode="paper", initial_lr=0.01))
    x, y = regression_data()
    with torch.no_grad():
        start = per_sample_losses(model, x, y)
    assert start.max() > 1 > start.min() and len(set(start.tolist())) == N  # unequal, some clipped
    w = model.weight.detach().clone()
    one_step(model, engine, reuse=reuse)
    auto = auto_component(engine)
    fit = auto.state.history[0]
    expected, means = closed_form(model, w, model.weight.detach().clone(), auto.lr, 0.01, bound=1.0)
    assert fit.decision == "fit" and fit.loss_bound == 1.0  # the paper's initial R_l
    assert fit.losses == pytest.approx(means, rel=1e-12)
    assert auto.lr == fit.estimate == pytest.approx(expected, rel=1e-10)  # no clamp, no smoothing
    assert not 0.005 <= auto.lr <= 0.02  # far from [η/2, 2η]: the safeguarded mode would have clamped it


def test_the_next_loss_bound_is_the_sum_of_the_three_privatised_losses():
    model, engine = paper_engine(tunefree.AutoLR(interval=1, mode="paper", initial_lr=0.01),
                                 noise_multiplier=0.5)
    for _ in range(3):
        one_step(model, engine)
    history = auto_component(engine).state.history
    assert [f.loss_bound for f in history] == [1.0, sum(history[0].losses), sum(history[1].losses)]
    assert history[1].loss_bound != pytest.approx(history[0].losses[1])  # not the mean rule


def test_the_paper_keeps_eta_where_the_fit_has_no_minimiser():
    hyfreedp = tunefree.components.hyfreedp
    auto = hyfreedp.AutoLearningRate(hyfreedp.HyFreeDP(interval=1, mode="paper"), 0.0, 8.0, None)
    assert auto.propose_paper([1.0, 1.2, 1.0], 0.1)[3:] == (0.1, "no minimiser along the update: keep")
    assert auto.propose_paper([1.0, 0.9, 1.2], 0.1)[3:] == (0.1, "no minimiser along the update: keep")
    slope, curvature, estimate, lr, decision = auto.propose_paper([1.2, 1.0, 0.9], 0.1)
    assert (slope, curvature) == pytest.approx((1.5, 10.0)) and lr == estimate == pytest.approx(0.15)


def test_training_losses_replace_the_closure_at_w():
    """Handed over, L(w) comes from the training forward: the closure runs at w ± Δ only."""
    model, engine = paper_engine(tunefree.AutoLR(interval=1, mode="paper", initial_lr=0.01))
    x, y = next(iter(engine.data_loader))
    engine.optimizer.zero_grad()
    losses = per_sample_losses(model, x, y)
    auto_component(engine).record_training_losses(losses)
    losses.mean().backward()
    calls = []

    def closure():
        calls.append(model.weight.detach().clone())
        return per_sample_losses(model, x, y)

    w = model.weight.detach().clone()
    engine.optimizer.step(closure)
    assert len(calls) == 2 and not any(torch.equal(c, w) for c in calls)


def test_training_losses_of_the_wrong_batch_are_refused():
    model, engine = paper_engine(tunefree.AutoLR(interval=1, mode="paper"))
    x, y = next(iter(engine.data_loader))
    engine.optimizer.zero_grad()
    losses = per_sample_losses(model, x, y)
    auto_component(engine).record_training_losses(losses[:3])
    losses.mean().backward()
    with pytest.raises(ValueError, match="record_training_losses gave 3 losses for a step of 8"):
        engine.optimizer.step(lambda: per_sample_losses(model, x, y))
    with pytest.raises(ValueError, match="1-D tensor"):
        auto_component(engine).record_training_losses(losses.mean())


def test_difference_probes_fit_the_clipped_differences():
    model, engine = paper_engine(tunefree.AutoLR(interval=1, mode="paper", probes="differences",
                                                 initial_lr=0.01))
    w = model.weight.detach().clone()
    one_step(model, engine)
    auto = auto_component(engine)
    fit = auto.state.history[0]
    expected, means = closed_form(model, w, model.weight.detach().clone(), auto.lr, 0.01, bound=1.0,
                                  differences=True)
    assert fit.losses == pytest.approx(means, rel=1e-12) and fit.losses[1] == 0.0
    assert auto.lr == pytest.approx(expected, rel=1e-10)
    # R_d follows the released differences, scaled to the new step: 4·max|d̃|·η_new/η
    assert auto.state.loss_bound == pytest.approx(4 * max(abs(means[0]), abs(means[2])) * auto.lr / 0.01)


def joint(releases):
    return releases[0] if len(releases) == 1 else dpa.ComposedDpEvent(releases)


@pytest.mark.parametrize("auto", [
    tunefree.AutoLR(interval=3, mode="paper"),
    tunefree.AutoLR(interval=2, mode="paper", probes="differences", loss_privacy="laplace"),
    tunefree.AutoLR(interval=1, mode="safeguarded", probes="differences"),
])
def test_every_probe_release_is_in_the_ledger_as_the_plan_solved_it(auto):
    model, engine = paper_engine(auto, noise_multiplier=1.0, steps=7)
    plan = engine.plan
    assert plan.losses.releases_per_update == auto.releases_per_update
    assert plan.loss_noise > 0 and auto_component(engine).loss_noise == plan.loss_noise
    for _ in range(7):
        one_step(model, engine)
    recorded = [event for event, count in engine.ledger.state_dict()["runs"] for _ in range(count)]
    planned = [to_dict(dpa.PoissonSampledDpEvent(plan.sample_rate, joint(plan.step_releases(t))))
               for t in range(1, 8)]
    assert recorded == planned
    per_update = [len(plan.step_releases(t)) - 1 for t in range(1, 8)]
    assert per_update == [auto.releases_per_update if (t - 1) % auto.interval == 0 else 0
                          for t in range(1, 8)]
    assert engine.epsilon() == pytest.approx(plan.epsilon(), rel=1e-9)


def test_auto_lr_options_are_validated():
    with pytest.raises(ValueError, match="mode"):
        tunefree.AutoLR(mode="fast")
    with pytest.raises(ValueError, match="probes"):
        tunefree.AutoLR(probes="gradients")
    with pytest.raises(ValueError, match="initial_lr"):
        tunefree.AutoLR(initial_lr=-1.0)
    assert math.isclose(tunefree.AutoLR(mode="safeguarded").initial_lr, 1e-4)
