"""Adaptive group-wise clipping: private quantile thresholds, the budget split, noise allocation."""

from __future__ import annotations

import copy
import math

import dp_accounting as dpa
import pytest
import torch
import torch.nn.functional as F
from dp_accounting.pld import pld_privacy_accountant
from support import component_step
from support.brute_force import clipped_sum, per_example_grads
from support.models import MLP
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tunefree import epsilon, make_private
from tunefree.clipping.functions import CLIP_FUNCTIONS, clip_function
from tunefree.clipping.groups import ClipGroup
from tunefree.components.thresholds import AdaptiveQuantile, QuantileEstimator
from tunefree.privacy.mechanisms import GradientRelease
from tunefree.privacy.plan import CountShare, Plan
from tunefree.privacy.randomness import SeededSource
from tunefree.step.component import StepReport


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one thread is several times faster than two on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dataset(n: int, d_in: int = 6, classes: int = 3, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d_in, generator=g, dtype=torch.float64),
                         torch.randint(0, classes, (n,), generator=g))


def explicit_groups(model: nn.Module) -> dict[str, list[str]]:
    names = [n for n, _ in model.named_parameters()]
    return {"weights": [n for n in names if n.endswith("weight")],
            "biases": [n for n in names if n.endswith("bias")]}


def run_steps(engine, steps: int, loss_fn=F.cross_entropy, before_step=None) -> None:
    batches = iter(engine.data_loader)
    for _ in range(steps):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(engine.data_loader)
            x, y = next(batches)
        engine.optimizer.zero_grad()
        loss_fn(engine.model(x), y).backward()
        if before_step is not None:
            before_step()
        engine.optimizer.step()


# ---------------------------------------------------------------- Proposition 3.1 and the ledger
@pytest.mark.parametrize("sigma,budget,groups", [(0.8, 0.01, 1), (1.3, 0.1, 7), (4.0, 0.5, 120)])
def test_proposition_3_1_identity(sigma, budget, groups):
    plan = Plan(0.1, 10, 100, 1e-5, noise_multiplier=sigma, shares=(CountShare(budget, groups),))
    gradient, count_std = plan.gradient_noise, plan.count_std
    # equation (3.1), and Remark 3.1: the counts cost the fraction r = Kσ²/(4σ_b²)
    assert gradient == pytest.approx((sigma ** -2 - groups / (2 * count_std) ** 2) ** -0.5,
                                     rel=1e-12)
    assert groups * sigma ** 2 / (4 * count_std ** 2) == pytest.approx(budget, rel=1e-12)
    assert gradient > sigma


def _engine(model, data, *, batch_size, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=kwargs.pop("lr", 0.0))
    return make_private(model, optimizer, DataLoader(data, batch_size=batch_size),
                        target_delta=kwargs.pop("target_delta", 1e-5), **kwargs)


@pytest.mark.slow
def test_joint_accounting_equals_target():
    torch.manual_seed(3)
    model, data = MLP().double(), dataset(1000)
    steps, target, delta = 40, 2.0, 1e-5
    engine = _engine(model, data, batch_size=50, target_epsilon=target, steps=steps,
                     groups="per-layer", thresholds=AdaptiveQuantile(budget=0.1), seed=0,
                     lr=0.1)
    run_steps(engine, steps)
    sigma = engine.noise_multiplier
    gradient = engine.optimizer.release.noise_multiplier
    count_std, k = engine.quantile_estimator.count_std, len(engine.groups)
    assert k == 2
    # every step: ONE sampled event composing the gradient release and the K count releases
    step = dpa.PoissonSampledDpEvent(0.05, dpa.ComposedDpEvent([
        dpa.GaussianDpEvent(gradient), dpa.GaussianDpEvent(engine.plan.count_noise)]))
    assert engine.plan.count_noise == pytest.approx(2 * count_std / math.sqrt(k), rel=1e-12)
    assert engine.ledger.event() == dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(step, steps)])
    spent = engine.epsilon()
    assert 0.99 * target <= spent <= target
    # independently: Proposition 3.1 says the joint release is plain DP-SGD with multiplier σ
    joint = (gradient ** -2 + k / (2 * count_std) ** 2) ** -0.5
    assert joint == pytest.approx(sigma, rel=1e-12)
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(joint)), steps)
    assert spent == pytest.approx(accountant.get_epsilon(delta), rel=1e-6)


@pytest.mark.slow
def test_noise_multiplier_means_the_joint_release():
    model, data = MLP().double(), dataset(200)
    engine = _engine(model, data, batch_size=20, noise_multiplier=1.5, groups="per-param",
                     thresholds=AdaptiveQuantile(budget=0.2), seed=0)
    gradient = engine.optimizer.release.noise_multiplier
    assert gradient == pytest.approx(1.5 / math.sqrt(0.8))
    k = len(engine.groups)
    assert engine.quantile_estimator.count_std == pytest.approx(1.5 * math.sqrt(k) / (2 * 0.2**0.5))
    run_steps(engine, 3)
    expected = epsilon(noise_multiplier=1.5, sample_rate=0.1, steps=3, delta=1e-5)
    assert engine.epsilon() == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------- the estimator itself
def _groups(thresholds: dict[str, float]) -> list[ClipGroup]:
    return [ClipGroup(name, [name], [nn.Parameter(torch.zeros(3))], threshold=value)
            for name, value in thresholds.items()]


def test_update_divides_by_the_expected_batch_size():
    groups = _groups({"a": 1.0, "b": 2.0, "unused": 0.5})
    settings = AdaptiveQuantile(target=0.7, lr=0.3, budget=0.01)
    estimator = QuantileEstimator(groups, settings, 0.0)
    norms = {"a": torch.tensor([0.5, 0.9, 1.0, 1.5, 3.0], dtype=torch.float64),
             "b": torch.tensor([0.1, 2.5, 4.0, 5.0, 9.0], dtype=torch.float64)}
    step, events = component_step(StepReport(step=1, examples=5, group_norms=norms), expected_batch_size=8.0)
    estimator.after_update(step)
    thresholds = estimator.thresholds()
    # unclipped counts: a 3 of 5, b 1 of 5, unused 5 of 5 (no gradient: norm 0); b̃ = count/(q·N)
    # with the centring undone: ((count − 5/2) / 8 + 1/2)
    for g, start, unclipped in zip(groups, (1.0, 2.0, 0.5), (3, 1, 5), strict=True):
        fraction = (unclipped - 2.5) / 8 + 0.5
        assert thresholds[g.name] == pytest.approx(start * math.exp(-0.3 * (fraction - 0.7)), rel=1e-12)
        assert g.threshold == start, "the estimator never changes the groups themselves"
        assert estimator.unclipped_fractions[g.name] == pytest.approx(fraction, rel=1e-12)
    assert events == [dpa.GaussianDpEvent(0.0)]

    # with a scale: the same estimates, and thresholds at that constant total sensitivity
    groups = _groups({"a": 1.0, "b": 2.0, "unused": 0.5})
    scaled = QuantileEstimator(groups, settings, 0.0, scale=3.0)
    assert math.hypot(*scaled.thresholds().values()) == pytest.approx(3.0, rel=1e-12)
    scaled.after_update(step)
    assert scaled.quantiles == pytest.approx(estimator.quantiles, rel=1e-12)
    total = math.hypot(*estimator.quantiles.values())
    for name, threshold in scaled.thresholds().items():
        assert threshold == pytest.approx(3.0 * scaled.quantiles[name] / total, rel=1e-12)


@pytest.mark.slow
def test_count_noise_has_standard_deviation_sigma_b():
    groups = _groups({"a": 1.0, "b": 1.0})
    settings = AdaptiveQuantile(target=0.5, lr=1e-9, budget=0.05)
    count_noise, expected_batch = 3.0, 10.0
    estimator = QuantileEstimator(groups, settings, count_noise)
    count_std = count_noise * math.sqrt(2) / 2
    assert estimator.count_std == count_std
    norms = {"a": torch.tensor([0.5, 2.0]), "b": torch.tensor([0.5, 0.7])}
    exact = torch.tensor([(1 - 1) / expected_batch + 0.5, (2 - 1) / expected_batch + 0.5])
    draws = []
    randomness = SeededSource(1)
    for t in range(4000):
        step, events = component_step(StepReport(t, 2, norms), expected_batch_size=expected_batch,
                                      randomness=randomness)
        estimator.after_update(step)
        draws.append(torch.tensor([estimator.unclipped_fractions[g.name] for g in groups]))
    assert events == [dpa.GaussianDpEvent(count_noise)]
    noise = (torch.stack(draws) - exact) * expected_batch
    assert noise.mean(0).abs().max() < 5 * count_std / math.sqrt(4000)
    assert (noise.std(0) / count_std - 1).abs().max() < 5 / math.sqrt(2 * 4000)


# ---------------------------------------------------------------- convergence to the quantile
def _norms_by_brute_force(model, data, groups) -> dict[str, torch.Tensor]:
    x, y = data.tensors
    per_example = per_example_grads(model, F.cross_entropy, x, y)
    params = dict(model.named_parameters())
    return {g.name: torch.stack([torch.sqrt(sum((grads[params[n]] ** 2).sum()
                                                for n in g.param_names))
                                 for grads in per_example]) for g in groups}


# (grouping, clip function, target quantile, initial max_grad_norm: far above or below the norms)
CONVERGENCE_CASES = [("all-layer", "auto-s", 0.5, 30.0), ("per-layer", "auto-s", 0.5, 0.02),
                     ("per-param", "auto-s", 0.5, 30.0), ("explicit", "auto-s", 0.5, 0.02),
                     ("per-layer", "abadi", 0.8, 30.0), ("per-layer", "auto-v", 0.3, 0.02),
                     ("per-layer", "psac", 0.6, 30.0)]


@pytest.mark.parametrize("grouping,clipping,quantile,start", CONVERGENCE_CASES)
@pytest.mark.slow
def test_thresholds_converge_to_the_empirical_quantile(grouping, clipping, quantile, start):
    """Noise off, fixed weights, every example in every batch: each threshold settles at the
    empirical quantile of its group's per-sample norms. With a constant step η it may end in a
    small cycle around it (a step η·|b̃ − q| can jump over order statistics closer than that), so
    the fraction below the threshold is q within two examples and the threshold the quantile
    within 1%."""
    torch.manual_seed(0)
    model, data = MLP().double(), dataset(200)
    groups = explicit_groups(model) if grouping == "explicit" else grouping
    engine = _engine(model, data, batch_size=200, noise_multiplier=0.0, groups=groups,
                     clipping=clipping, thresholds=AdaptiveQuantile(target=quantile),
                     max_grad_norm=start, seed=0)
    run_steps(engine, 149)
    estimates = engine.quantile_estimator.quantiles
    last = dict(estimates)
    run_steps(engine, 1)
    norms = _norms_by_brute_force(copy.deepcopy(model), data, engine.groups)
    assert set(estimates) == set(norms)
    for name, estimate in estimates.items():
        below = (norms[name] <= estimate).double().mean().item()
        assert abs(below - quantile) <= 2 / 200 + 1e-12, (name, below)
        assert estimate == pytest.approx(torch.quantile(norms[name], quantile).item(), rel=0.01)
    # Abadi clips at the estimates; the normalising functions take them as relative group scales
    # at the initial total sensitivity
    total = math.sqrt(sum(v ** 2 for v in estimates.values()))
    expected = {name: v if clipping == "abadi" else start * v / total
                for name, v in estimates.items()}
    assert engine.clip_thresholds == pytest.approx(expected, rel=1e-12)
    # the released (here noiseless) clip fractions are those of the estimates the step used
    assert engine.clip_fractions == pytest.approx(
        {name: (norms[name] > last[name]).double().mean().item() for name in norms}, abs=1e-12)


@pytest.mark.parametrize("clipping", CLIP_FUNCTIONS)
def test_each_step_clips_with_the_current_thresholds(clipping):
    """After the thresholds have moved, one more step's gradient is the brute-force clipped sum
    under the thresholds read just before it (every clip function, per-layer groups)."""
    model, data = MLP().double(), dataset(64, seed=4)
    engine = _engine(model, data, batch_size=64, noise_multiplier=0.0, groups="per-layer",
                     clipping=clipping, thresholds=AdaptiveQuantile(target=0.6), seed=0)
    run_steps(engine, 5)
    before = dict(engine.clip_thresholds)
    assert before != pytest.approx({g: 1 / math.sqrt(2) for g in before}), "must have moved"
    if clipping != "abadi":  # relative scales at the total sensitivity max_grad_norm = 1
        assert math.hypot(*before.values()) == pytest.approx(1.0, rel=1e-12)
    reference = copy.deepcopy(model)
    run_steps(engine, 1)
    x, y = data.tensors
    per_example = per_example_grads(reference, F.cross_entropy, x, y)
    ref_groups = [ClipGroup(g.name, g.param_names,
                            [dict(reference.named_parameters())[n] for n in g.param_names],
                            threshold=before[g.name]) for g in engine.groups]
    expected, _ = clipped_sum(per_example, ref_groups, clip_function(clipping))
    for g, ref in zip(engine.groups, ref_groups, strict=True):
        for p, ref_p in zip(g.params, ref.params, strict=True):
            torch.testing.assert_close(p.grad, expected[ref_p] / 64, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- noise allocation (line 13)
def algorithm_1_line_13(noise_multiplier, thresholds, sizes, allocation):
    """σ_new·S·γₖ with S = (Σₖ Cₖ²/γₖ²)^½, written out from the paper."""
    gammas = {"global": [1.0] * len(thresholds),
              "equal-budget": list(thresholds),
              "weighted": [c / math.sqrt(d) for c, d in zip(thresholds, sizes, strict=True)]}
    gamma = gammas[allocation]
    s = math.sqrt(sum(c ** 2 / g ** 2 for c, g in zip(thresholds, gamma, strict=True)))
    return [noise_multiplier * s * g for g in gamma]


@pytest.mark.parametrize("allocation", ["global", "equal-budget", "weighted"])
def test_release_noise_per_group(allocation):
    sizes, thresholds, sigma = (4000, 600, 50), (0.3, 2.0, 1.1), 0.7
    groups = [ClipGroup(f"g{i}", [f"g{i}"], [nn.Parameter(torch.zeros(d, dtype=torch.float64))],
                        threshold=c)
              for i, (d, c) in enumerate(zip(sizes, thresholds, strict=True))]
    release = GradientRelease(groups, sigma, SeededSource(5), allocation)
    expected = algorithm_1_line_13(sigma, thresholds, sizes, allocation)
    # the release is exactly a Gaussian mechanism of multiplier σ: Σₖ (Cₖ/σₖ)² = σ⁻²
    assert sum((c / s) ** 2 for c, s in zip(thresholds, expected, strict=True)) == pytest.approx(
        sigma ** -2, rel=1e-12)
    samples = {g.name: [] for g in groups}
    for _ in range(20):
        noisy, event = release.release({}, {g.name: g.threshold for g in groups})
        for g in groups:
            samples[g.name].append(noisy[g.params[0]])
    assert event == dpa.GaussianDpEvent(sigma)
    for g, std in zip(groups, expected, strict=True):
        values = torch.cat(samples[g.name])
        n = values.numel()
        assert values.mean().abs() < 5 * std / math.sqrt(n)
        assert abs(values.std().item() / std - 1) < 5 / math.sqrt(2 * n), g.name
    if allocation != "global":
        assert len({round(s, 9) for s in expected}) == 3


@pytest.mark.parametrize("allocation", ["global", "equal-budget", "weighted"])
def test_training_noise_per_group_follows_the_moving_thresholds(allocation):
    """End to end, adaptive thresholds: with zero per-sample gradients, q·N·.grad is the noise;
    scaled by the standard deviation Algorithm 1 prescribes for the thresholds of that step, it
    is N(0, 1)."""
    model = nn.Sequential(nn.Linear(30, 40), nn.Tanh(), nn.Linear(40, 3)).double()
    data = dataset(400, d_in=30)
    sigma, budget = 0.9, 0.05
    engine = _engine(model, data, batch_size=40, noise_multiplier=sigma, groups=explicit_groups(
        model), max_grad_norm={"weights": 0.4, "biases": 1.5}, thresholds=AdaptiveQuantile(budget=budget),
        noise_allocation=allocation, seed=2)
    sizes = [g.size for g in engine.groups]
    standardized = {g.name: [] for g in engine.groups}
    current = {}

    def record_thresholds():
        current["stds"] = algorithm_1_line_13(sigma / math.sqrt(1 - budget),
                                              list(engine.clip_thresholds.values()), sizes,
                                              allocation)

    def step_and_collect():
        run_steps(engine, 1, loss_fn=lambda out, y: (out * 0).sum(), before_step=record_thresholds)
        for g, std in zip(engine.groups, current["stds"], strict=True):
            grads = torch.cat([p.grad.flatten() for p in g.params])
            standardized[g.name].append(grads * 40 / std)

    thresholds_seen = []
    for _ in range(30):
        step_and_collect()
        thresholds_seen.append(engine.clip_thresholds["weights"])
    assert len(set(thresholds_seen)) == 30, "the thresholds must move every step"
    assert {g.name: g.threshold for g in engine.groups} == {"weights": 0.4, "biases": 1.5}, (
        "the moving thresholds are the engine's state; the configured groups never change")
    for name, values in standardized.items():
        z = torch.cat(values)
        assert abs(z.std().item() - 1) < 5 / math.sqrt(2 * z.numel()), name
        assert z.mean().abs() < 5 / math.sqrt(z.numel()), name


# ---------------------------------------------------------------- checkpoints and bad input
@pytest.mark.slow
def test_resumed_run_continues_identically():
    def build():
        torch.manual_seed(11)
        model = MLP().double()
        return _engine(model, dataset(300), batch_size=30, noise_multiplier=1.1,
                       groups="per-layer", thresholds=AdaptiveQuantile(target=0.7, budget=0.1),
                       seed=7, lr=0.05)

    first = build()
    run_steps(first, 6)
    at_save = dict(first.clip_thresholds)
    saved = copy.deepcopy({"model": first.model.state_dict(),
                           "optimizer": first.optimizer.state_dict(),
                           "engine": first.state_dict()})
    run_steps(first, 7)
    resumed = build()
    resumed.model.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["optimizer"])
    resumed.load_state_dict(saved["engine"])
    assert resumed.clip_thresholds == at_save
    estimates = saved["engine"]["components"]["QuantileEstimator"]["quantiles"]
    assert resumed.quantile_estimator.quantiles == estimates
    run_steps(resumed, 7)
    assert resumed.clip_thresholds == first.clip_thresholds
    assert resumed.clip_fractions == first.clip_fractions
    assert resumed.epsilon() == first.epsilon()
    for a, b in zip(first.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)

    fixed = _engine(MLP().double(), dataset(300), batch_size=30,
                    noise_multiplier=resumed.noise_multiplier, groups="per-layer", seed=7)
    with pytest.raises(ValueError, match="other privacy settings"):
        fixed.load_state_dict(saved["engine"])


@pytest.mark.parametrize("settings,message", [
    (lambda: {"thresholds": "quantile"}, "unknown thresholds"),
    (lambda: {"thresholds": AdaptiveQuantile(target=1.0)}, r"AdaptiveQuantile.target must be in"),
    (lambda: {"thresholds": AdaptiveQuantile(lr=0.0)}, "AdaptiveQuantile.lr must be a positive"),
    (lambda: {"thresholds": AdaptiveQuantile(budget=1.0)}, "AdaptiveQuantile.budget"),
    (lambda: {"thresholds": AdaptiveQuantile(budget=0.0)}, "AdaptiveQuantile.budget"),
])
def test_bad_threshold_arguments(settings, message):
    with pytest.raises(ValueError, match=message):
        _engine(MLP().double(), dataset(100), batch_size=10, noise_multiplier=1.0, **settings())
