"""lr="auto" (DoG()): DoG (Ivgi et al. 2023) on the released gradient, aware of the known privacy noise.
The rule's equations on hand-made steps (noise-free and noisy), that it reads only released quantities,
that it adds nothing to the ledger, and that the averaged weights follow DoG's polynomial average."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from support import component_step
from support.models import MLP
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.components.dog import (
    AVERAGING,
    INPUT_RMS_REFERENCE,
    NOISE_BUDGET,
    SIGNIFICANCE,
    WALK_MARGIN,
    DistanceOverGradients,
    DoG,
    input_scale_factor,
)
from tunefree.privacy.ledger import to_dict
from tunefree.step.component import StepReport


class KnownNoise:
    """Stands in for the gradient release: each parameter's noise standard deviation (of the sum)."""

    def __init__(self, params, std):
        self.params, self.std = params, std

    def param_stds(self, thresholds):
        return [(p, self.std) for p in self.params]


def run_rule(gradients, std=0.0, batch=4.0, initial_distance=1e-2, noise_aware=True,
             report=None, closure=None, planned_steps=None, noise_budget=NOISE_BUDGET, input_rms=None):
    """SGD on one 3-vector with the given released gradients; returns the rule, the learning rates
    and the weights before each step."""
    weight = nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    settings = DoG(initial_distance, noise_budget, noise_aware, input_rms)
    rule = DistanceOverGradients(KnownNoise([weight], std), batch, settings, planned_steps=planned_steps)
    lrs, weights = [], []
    for t, g in enumerate(gradients):
        weights.append(weight.detach().clone())
        weight.grad = torch.as_tensor(g, dtype=torch.float64).clone()
        step, released = component_step(report or StepReport(step=t + 1, examples=4, thresholds={"all": 1.0}),
                                        optimizer, closure)
        rule.before_update(step)
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        rule.after_update(step)
        assert released == []  # nothing released
    return rule, lrs, weights, weight


GRADIENTS = [[0.5, -1.0, 0.25], [0.4, -0.7, 0.1], [0.1, -0.9, 0.3], [-0.2, -0.4, 0.6]]


def test_noise_free_steps_follow_dog():
    """η_t = max(r_ε, maxᵢ≤ₜ ‖xᵢ − x₀‖) / √(Σᵢ≤ₜ ‖gᵢ‖²), r_ε = 0.01·(1 + ‖x₀‖) (DoG, equation 1)."""
    _, lrs, weights, _ = run_rule(GRADIENTS)
    x0 = weights[0]
    distance = 0.01 * (1 + x0.norm().item())
    energy = 0.0
    for t, g in enumerate(GRADIENTS):
        distance = max(distance, (weights[t] - x0).norm().item())
        energy += torch.tensor(g, dtype=torch.float64).pow(2).sum().item()
        assert lrs[t] == pytest.approx(distance / math.sqrt(energy), rel=1e-12)
    assert lrs[-1] > lrs[0]  # it grows from r_ε while the gradients agree


def test_noise_aware_subtracts_the_known_noise_energy():
    """Noise of std s on each sum, divided by q·N = B: the energy loses d·(s/B)² per step (counted once
    above SIGNIFICANCE standard deviations √(2d)·(s/B)² of its fluctuation); the squared distance loses
    the noise walk of the earlier steps, ‖Σ η_i n_i‖² = W·χ²_d with W = Σ η_i²·(s/B)²: its mean d·W
    and WALK_MARGIN of its standard deviations √(2d)·W."""
    std, batch, d = 0.4, 4.0, 3
    v = (std / batch) ** 2
    gradients = [[2.0, -1.0, 0.5], [1.5, -0.5, 0.5], [1.0, -1.0, 1.0]]
    _, lrs, weights, _ = run_rule(gradients, std=std, batch=batch)
    _, plain, _, _ = run_rule(gradients, std=std, batch=batch, noise_aware=False)
    x0, distance, energy, walk = weights[0], 0.01 * (1 + weights[0].norm().item()), 0.0, 0.0
    for t, g in enumerate(gradients):
        moved = (weights[t] - x0).pow(2).sum().item() - d * walk - WALK_MARGIN * math.sqrt(2 * d) * walk
        distance = max(distance, math.sqrt(max(moved, 0.0)))
        energy += torch.tensor(g, dtype=torch.float64).pow(2).sum().item() - d * v
        floor = SIGNIFICANCE * math.sqrt((t + 1) * 2 * d * v * v)
        assert lrs[t] == pytest.approx(distance / math.sqrt(max(energy, floor)), rel=1e-12)
        walk += lrs[t] ** 2 * v
    assert lrs[0] > plain[0]  # less energy counted: a larger step than plain DoG's
    assert lrs[-1] > lrs[0]  # and the distance, resolved above the walk, still grows it


def test_noise_walk_mean_and_deviation():
    """After steps η_i with coordinate noise variance v: W = Σ η_i² v, mean d·W, deviation √(2d)·W."""
    g = torch.Generator().manual_seed(0)
    std, batch, d = 2.0, 1.0, 3
    gradients = [torch.randn(d, generator=g, dtype=torch.float64) * std / batch for _ in range(12)]
    rule, lrs, _, _ = run_rule(gradients, std=std, batch=batch)
    walk = sum(lr ** 2 for lr in lrs) * (std / batch) ** 2
    assert rule.walk_variances == [pytest.approx(walk, rel=1e-12)]
    mean, deviation = rule.noise_walk([d])
    assert (mean, deviation) == (pytest.approx(d * walk), pytest.approx(math.sqrt(2 * d) * walk))


def test_pure_noise_does_not_blow_up_the_step():
    """Released gradients of pure noise: the remaining energy is no larger than its own fluctuation,
    so the floor keeps the step finite and of the order r_ε/√(2√(2d)·v)."""
    g = torch.Generator().manual_seed(0)
    std, batch, d = 1.0, 1.0, 3
    gradients = [torch.randn(d, generator=g, dtype=torch.float64) * std / batch for _ in range(20)]
    rule, lrs, _, _ = run_rule(gradients, std=std, batch=batch)
    assert all(math.isfinite(lr) and lr > 0 for lr in lrs)
    assert max(lrs) < 1.0  # r_ε ≈ 0.033 here: a step of order 1 would need real signal


def noisy_gradients(steps, std, batch, d=3, signal=1.0):
    g = torch.Generator().manual_seed(3)
    return [signal + torch.randn(d, generator=g, dtype=torch.float64) * std / batch for _ in range(steps)]


def test_noise_budget_bounds_the_step_by_the_walk_left_over_the_steps_left():
    """η_t = min(DoG's η_t, √((B − Σ_{i<t} η_i² E)/((T − t)·E))) with B = (κ(1 + ‖x₀‖))² and E = d·(s/B)²
    the noise energy of a step; with the budget binding from the start and constant noise it is the
    constant κ(1 + ‖x₀‖)/√(T·E), and the planned run's expected noise walk Σ η_t² E is exactly B."""
    std, batch, d, steps, kappa = 8.0, 1.0, 3, 12, 0.5
    energy = d * (std / batch) ** 2
    gradients = noisy_gradients(steps, std, batch)
    rule, lrs, weights, _ = run_rule(gradients, std=std, batch=batch, planned_steps=steps, noise_budget=kappa,
                                     initial_distance=10.0)
    _, unbounded, _, _ = run_rule(gradients, std=std, batch=batch, initial_distance=10.0)
    budget = (kappa * (1 + weights[0].norm().item())) ** 2
    assert lrs[0] < unbounded[0]  # the budget binds: DoG alone would step further
    walk = 0.0
    for t, lr in enumerate(lrs):
        assert lr == pytest.approx(math.sqrt((budget - walk) / ((steps - t) * energy)), rel=1e-12)
        walk += lr ** 2 * energy
    constant = kappa * (1 + weights[0].norm().item()) / math.sqrt(steps * energy)
    assert lrs == [pytest.approx(constant, rel=1e-9)] * steps
    assert walk == pytest.approx(budget, rel=1e-9)
    assert rule.noise_walk([d])[0] == pytest.approx(budget, rel=1e-9)


def test_noise_budget_falls_with_the_length_and_the_noise_of_the_run():
    """The bound is κ(1 + ‖x₀‖)/√(T·E): four times the steps or twice the noise halve it."""
    def first_lr(steps, std):
        _, lrs, _, _ = run_rule(noisy_gradients(1, std, 1.0), std=std, batch=1.0, planned_steps=steps,
                                noise_budget=0.5, initial_distance=10.0)
        return lrs[0]
    assert first_lr(40, 8.0) == pytest.approx(first_lr(10, 8.0) / 2, rel=1e-12)
    assert first_lr(10, 16.0) == pytest.approx(first_lr(10, 8.0) / 2, rel=1e-12)


def test_a_public_input_scale_above_the_reference_shrinks_the_budget_in_proportion():
    """The walk budget is (κ(1 + ‖x₀‖)·min(1, ρ_ref/ρ))² for inputs of public root mean square ρ: at 4ρ_ref
    the binding step is a quarter; at or below ρ_ref, or unknown, the rule is the same bit for bit."""
    std, batch, steps, kappa = 8.0, 1.0, 10, 0.5
    gradients = noisy_gradients(steps, std, batch)

    def run(input_rms):
        return run_rule(gradients, std=std, batch=batch, planned_steps=steps, noise_budget=kappa,
                        initial_distance=10.0, input_rms=input_rms)
    plain, lrs, weights, _ = run(None)
    for rms in (INPUT_RMS_REFERENCE, INPUT_RMS_REFERENCE / 3):
        assert run(rms)[1] == lrs
    scaled, quarter, _, _ = run(4 * INPUT_RMS_REFERENCE)
    assert quarter == [pytest.approx(lr / 4, rel=1e-12) for lr in lrs]
    assert scaled.walk_budget == pytest.approx((kappa * (1 + weights[0].norm().item()) / 4) ** 2, rel=1e-12)
    assert plain.walk_budget == pytest.approx((kappa * (1 + weights[0].norm().item())) ** 2, rel=1e-12)
    assert [input_scale_factor(r) for r in (None, 0.1, INPUT_RMS_REFERENCE, 1.0, 2.0)] == [
        1.0, 1.0, 1.0, INPUT_RMS_REFERENCE, INPUT_RMS_REFERENCE / 2]


def test_a_public_input_scale_releases_nothing_and_is_part_of_the_plan():
    """input_rms is a public statement: the run's noise, ledger and ε are the fixed-lr run's, and a
    checkpoint of another input scale is refused (another budget)."""
    _, plain = private_run(None)
    _, scaled = private_run(tunefree.DoG(input_rms=4.0))
    assert to_dict(scaled.ledger.event()) == to_dict(plain.ledger.event())
    assert scaled.epsilon() == plain.epsilon()
    _, other = private_run(tunefree.DoG())
    factor = (INPUT_RMS_REFERENCE / 4) ** 2
    assert scaled.lr_rule.walk_budget == pytest.approx(other.lr_rule.walk_budget * factor, rel=1e-12)
    with pytest.raises(ValueError, match="input_rms"):
        other.load_state_dict(scaled.state_dict())


def test_noise_budget_left_unspent_by_dog_is_spent_later():
    """While DoG's own step is the smaller, the walk stays under the even share, and the bound on the
    steps left grows: it never takes back budget that was not used."""
    std, batch, steps = 8.0, 1.0, 10
    rule, lrs, _, _ = run_rule(noisy_gradients(steps, std, batch), std=std, batch=batch, planned_steps=steps,
                               noise_budget=0.5, initial_distance=1e-3)
    energy = 3 * (std / batch) ** 2
    assert lrs[0] < rule.walk_budget ** 0.5 / math.sqrt(steps * energy)  # DoG's tiny first step binds
    assert sum(lr ** 2 for lr in lrs) * energy <= rule.walk_budget * (1 + 1e-12)


def test_noise_budget_past_the_planned_steps_keeps_its_last_bound():
    std, batch, steps = 8.0, 1.0, 4
    rule, lrs, _, _ = run_rule(noisy_gradients(7, std, batch), std=std, batch=batch, planned_steps=steps,
                               noise_budget=0.5, initial_distance=10.0)
    assert lrs[steps:] == [pytest.approx(lrs[steps - 1], rel=1e-12)] * 3
    assert all(lr > 0 for lr in lrs)


def test_no_budget_without_a_planned_length_or_without_noise():
    gradients = noisy_gradients(5, 8.0, 1.0)
    _, plain, _, _ = run_rule(gradients, std=8.0, batch=1.0, noise_budget=None, planned_steps=5)
    _, unplanned, _, _ = run_rule(gradients, std=8.0, batch=1.0, planned_steps=None)
    assert plain == unplanned
    _, noiseless, _, _ = run_rule(GRADIENTS, planned_steps=4, noise_budget=1e-3)
    _, free, _, _ = run_rule(GRADIENTS, noise_budget=None)
    assert noiseless == free  # no noise: no walk to budget


def test_only_released_quantities_count():
    """Another private batch (its size, its norms, its closure) with the same released gradients gives
    the same learning rates: the rule is post-processing of the release."""
    _, lrs, _, _ = run_rule(GRADIENTS, std=0.1)
    private = StepReport(step=1, examples=999, group_norms={"all": torch.rand(999)}, thresholds={"all": 1.0})
    _, other, _, _ = run_rule(GRADIENTS, std=0.1, report=private, closure=lambda: torch.rand(999))
    assert other == lrs


def test_polynomial_average():
    """x̄₁ = x₁, x̄ₜ = (1 − (γ+1)/(t+γ))·x̄ₜ₋₁ + (γ+1)/(t+γ)·xₜ over the weights after each step."""
    rule, lrs, weights, last = run_rule(GRADIENTS)
    after = weights[1:] + [last.detach()]
    expected = after[0].clone()
    for t in range(2, len(after) + 1):
        w = (AVERAGING + 1) / (t + AVERAGING)
        expected = (1 - w) * expected + w * after[t - 1]
    torch.testing.assert_close(rule.average[0], expected, rtol=1e-12, atol=1e-14)
    target = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    rule.apply_average([target])
    torch.testing.assert_close(target.detach(), expected)
    with rule.averaged():  # by default, the optimizer's own parameter, put back after the block
        torch.testing.assert_close(last.detach(), expected)
    assert not torch.equal(last.detach(), expected)
    rule.apply_average()
    torch.testing.assert_close(last.detach(), expected)


def test_averaged_weights_go_only_where_they_fit():
    """A list in another order, or one with a frozen parameter more, is refused rather than written
    wrongly; a rule loaded from a checkpoint has no parameters to write into until it steps."""
    rule, *_ = run_rule(GRADIENTS)
    for wrong in ([nn.Parameter(torch.zeros(4, dtype=torch.float64))],
                  [nn.Parameter(torch.zeros(3, dtype=torch.float64))] * 2):
        with pytest.raises(ValueError, match="shapes are not those"):
            rule.apply_average(wrong)
    loaded = DistanceOverGradients(KnownNoise([], 0.0), 4.0)
    loaded.load_state_dict(rule.state_dict())
    with pytest.raises(ValueError, match="not stepped since it was loaded"):
        loaded.apply_average()
    with pytest.raises(ValueError, match="no step was taken"):
        DistanceOverGradients(KnownNoise([], 0.0), 4.0).apply_average()


def data(n=64):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def private_run(lr, optimizer=None, steps=6):
    torch.manual_seed(0)
    model = MLP()
    optimizer = optimizer(model) if optimizer else torch.optim.SGD(model.parameters(), lr=0.1)
    engine = tunefree.make_private(model, optimizer, DataLoader(data(), batch_size=16), noise_multiplier=1.0,
                                   target_delta=1e-3, steps=steps, lr=lr, seed=0, accountant="rdp")
    taken = 0
    while taken < steps:
        for x, y in engine.data_loader:
            engine.optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            engine.optimizer.step()  # no closure: DoG needs no loss
            taken += 1
            if taken == steps:
                break
    return model, engine


def test_make_private_with_dog_spends_exactly_the_plain_run():
    """No release of its own: the same noise, the same ledger and ε as the fixed-lr run."""
    _, plain = private_run(None)
    model, dog = private_run(tunefree.DoG())
    assert dog.plan.gradient_noise == plain.plan.gradient_noise
    assert to_dict(dog.ledger.event()) == to_dict(plain.ledger.event())
    assert dog.epsilon() == plain.epsilon()
    assert isinstance(dog.lr_rule, DistanceOverGradients)
    history = dog.lr_rule.history
    assert len(history) == 6 and all(lr > 0 for lr in history)
    assert dog.optimizer.param_groups[0]["lr"] == history[-1]


def test_dog_takes_plain_sgd_as_it_is_and_translates_other_optimizers():
    """Plain SGD gets DoG's step itself; SGD with momentum or AdamW its translation
    (tests/test_autolr_optimizers.py)."""
    from tunefree.components.dog_optimizers import OptimizerDoG

    assert type(private_run(tunefree.DoG())[1].lr_rule) is DistanceOverGradients
    for make in (lambda m: torch.optim.AdamW(m.parameters()),
                 lambda m: torch.optim.SGD(m.parameters(), lr=1.0, momentum=0.9)):
        assert isinstance(private_run(tunefree.DoG(), make, steps=1)[1].lr_rule, OptimizerDoG)


def test_make_private_spends_the_noise_budget_over_the_planned_steps():
    """The rule gets the plan's length and the option's κ; the run's expected noise walk stays within
    (κ(1 + ‖x₀‖))², and a checkpoint of another budget is refused (it is in the plan's fingerprint)."""
    model, engine = private_run(tunefree.DoG(noise_budget=0.05), steps=6)
    rule = engine.lr_rule
    assert rule.planned_steps == engine.planned_steps == 6 and rule.noise_budget == 0.05
    energy = sum(d * v for d, v in rule.coordinate_variances(engine.clip_thresholds))
    assert sum(lr ** 2 for lr in rule.history) * energy <= rule.walk_budget * (1 + 1e-9)
    assert rule.history[-1] == pytest.approx(rule.budget_lr, rel=1e-12)  # the budget binds at this noise
    _, other = private_run(tunefree.DoG(noise_budget=None), steps=6)
    assert other.lr_rule.noise_budget is None and max(other.lr_rule.history) > max(rule.history)
    with pytest.raises(ValueError, match="noise_budget"):
        other.load_state_dict(engine.state_dict())


def test_lr_auto_without_a_planned_length_is_refused_unless_its_budget_is_off():
    """The noise budget is spent over the planned steps: with σ given and no length there are none."""
    torch.manual_seed(0)
    model = MLP()

    def make(auto):
        return tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                     DataLoader(data(), batch_size=16), noise_multiplier=1.0,
                                     target_delta=1e-3, lr=auto, seed=0)
    with pytest.raises(ValueError, match="give epochs or steps"):
        make("auto")
    engine = make(tunefree.DoG(noise_budget=None))
    assert engine.lr_rule.noise_budget is None and engine.lr_rule.planned_steps is None


def test_dog_options():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="noise_budget"):
            tunefree.DoG(noise_budget=bad)
    with pytest.raises(ValueError, match="initial_distance"):
        tunefree.DoG(initial_distance=0.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="input_rms"):
            tunefree.DoG(input_rms=bad)


def test_component_state_round_trip_continues_the_same_learning_rates():
    """Save the rule's state after two steps, load it into a fresh rule: the next steps (same released
    gradients, same weights) get the same learning rates and the same average as the uninterrupted rule."""
    budgeted = {"std": 3.0, "planned_steps": 4, "noise_budget": 0.5, "initial_distance": 1.0}
    rule, lrs, weights, weight = run_rule(GRADIENTS[:2], **budgeted)
    state = rule.state_dict()
    resumed = DistanceOverGradients(KnownNoise([weight], 3.0), 4.0,
                                    DoG(initial_distance=1.0, noise_budget=0.5), planned_steps=4)
    resumed.load_state_dict(state)
    optimizer = torch.optim.SGD([weight], lr=1.0)
    _, full, _, full_last = run_rule(GRADIENTS, **budgeted)
    through, straight = [], []
    for t, g in enumerate(GRADIENTS[2:], start=2):
        weight.grad = torch.as_tensor(g, dtype=torch.float64).clone()
        step, _ = component_step(StepReport(step=t + 1, examples=4, thresholds={"all": 1.0}), optimizer)
        resumed.before_update(step)
        through.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        resumed.after_update(step)
        straight.append(full[t])
    assert through == straight
    torch.testing.assert_close(weight.detach(), full_last.detach(), rtol=0, atol=0)
    assert state["walk_variances"] and state["average"] is not None
    assert full[2:] != run_rule(GRADIENTS, std=3.0, initial_distance=1.0)[1][2:]  # the budget was at work


def test_engine_checkpoint_resumes_the_rule_bit_for_bit():
    """engine.state_dict() carries the rule's state: a seeded run resumed from it after 3 of 6 steps ends
    with the same weights and learning rates as the run that was never interrupted."""
    model, straight = private_run(tunefree.DoG(), steps=6)
    torch.manual_seed(0)
    first = MLP()
    engine = tunefree.make_private(first, torch.optim.SGD(first.parameters(), lr=0.1),
                                   DataLoader(data(), batch_size=16), noise_multiplier=1.0, target_delta=1e-3,
                                   steps=6, lr=tunefree.DoG(), seed=0, accountant="rdp")
    batches = iter(engine.data_loader)
    for _ in range(3):
        x, y = next(batches)
        engine.optimizer.zero_grad()
        F.cross_entropy(first(x), y).backward()
        engine.optimizer.step()
    saved = {"engine": engine.state_dict(), "model": first.state_dict()}
    engine.detach()
    second = MLP()
    second.load_state_dict(saved["model"])
    resumed = tunefree.make_private(second, torch.optim.SGD(second.parameters(), lr=0.1),
                                    DataLoader(data(), batch_size=16), noise_multiplier=1.0,
                                    target_delta=1e-3, steps=6, lr=tunefree.DoG(), seed=0,
                                    accountant="rdp")
    resumed.load_state_dict(saved["engine"])
    taken = 3
    while taken < 6:
        for x, y in resumed.data_loader:
            resumed.optimizer.zero_grad()
            F.cross_entropy(second(x), y).backward()
            resumed.optimizer.step()
            taken += 1
            if taken == 6:
                break
    assert resumed.lr_rule.history == straight.lr_rule.history[3:]
    for a, b in zip(second.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
