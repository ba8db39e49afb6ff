"""The f-DP one-run bound: its recursion is the exact optimum of the constraints f-DP puts on the guesses,
it is valid for the mechanism it hypothesises, tighter than the (ε, δ) bound for the Gaussian mechanism,
and it moves above ε when the noise is smaller than claimed."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from scipy import optimize, stats

from tunefree.audit import Guesses, PrivacyCurve, curve_of, fdp_epsilon_bound, fdp_rejects
from tunefree.audit.bounds import best_one_run_bound, default_guess_sizes, top_bottom_guesses
from tunefree.audit.combined import one_run_bounds
from tunefree.audit.fdp import scaled
from tunefree.privacy.accounting import epsilon_of, planned_event


def _largest_tail_lp(m: int, k: int, c: int, curve: PrivacyCurve) -> float:
    """max P[C ≥ c] over distributions of the number C of right guesses (out of k, m canaries) that
    meet rᵢ ≤ f̄(hᵢ₋₁) for i = 1 … k, f̄ given by the curve's (ε, δ) pairs: a linear program."""
    right = np.arange(k + 1)
    rows, bounds = [], []
    for i in range(1, k + 1):
        r = np.where(right >= i, right, 0) / m
        h = np.where(right >= i - 1, k - right, 0) / m
        for e, d in zip(curve.epsilons, curve.deltas):  # f̄(x) ≤ δ + eᵉx and ≤ 1 − e⁻ᵉ(1 − δ − x)
            rows += [r - math.exp(e) * h, r - math.exp(-e) * h]
            bounds += [d, 1 - math.exp(-e) * (1 - d)]
    result = optimize.linprog(-(right >= c).astype(float), A_ub=np.array(rows), b_ub=bounds,
                              A_eq=np.ones((1, k + 1)), b_eq=[1.0], bounds=(0, None), method="highs")
    assert result.success
    return -result.fun


def _smallest_rejected_level(guesses: Guesses, curve: PrivacyCurve) -> float:
    low, high = 0.0, 1.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (low, middle) if fdp_rejects(guesses, curve, middle) else (middle, high)
    return high


def test_the_recursion_is_the_optimum_of_the_f_dp_constraints():
    # the algorithm's p-value equals the largest tail any distribution meeting the constraints has:
    # never below it (valid), never above it (nothing lost)
    rng = np.random.default_rng(0)
    compared = 0
    for _ in range(40):
        m = int(rng.integers(4, 30))
        k = int(rng.integers(1, m + 1))
        c = int(rng.integers(max(1, k // 2), k + 1))
        epsilons = np.sort(rng.uniform(0, 2, int(rng.integers(1, 4))))
        curve = PrivacyCurve(epsilons, rng.uniform(0, 0.02, len(epsilons)) * np.exp(-epsilons))
        p_value = _smallest_rejected_level(Guesses(k, c, m), curve)
        assert p_value == pytest.approx(_largest_tail_lp(m, k, c, curve), abs=1e-6)
        compared += p_value < 1
    assert compared >= 10  # enough instances where the bound says something


def test_pure_dp_curve_is_close_to_but_weaker_than_the_binomial_tail():
    # for ε-DP (δ = 0) randomized response makes exactly Binomial(k, eᵉ/(1+eᵉ)) right guesses: the
    # f-DP p-value must not be below that tail (valid); it is a little above it (its constraints
    # keep only what f-DP implies per canary), and equal for all-right guesses
    curve = PrivacyCurve(np.array([1.0]), np.array([0.0]))
    p = 1 / (1 + math.exp(-1.0))
    for k, v in ((10, 9), (100, 80), (50, 50)):
        tail = stats.binom.sf(v - 1, k, p)
        p_value = _smallest_rejected_level(Guesses(k, v, 1000), curve)
        assert tail <= p_value * (1 + 1e-6) and p_value <= 1.25 * tail


def test_curve_of_a_gaussian_is_its_trade_off_function():
    # one Gaussian mechanism of multiplier σ is exactly μ-GDP, μ = 1/σ: f̄⁻¹(y) = Φ(Φ⁻¹(y) − μ)
    curve = curve_of(dpa.GaussianDpEvent(2.0))
    for power in (0.05, 0.3, 0.7, 0.95):
        exact = stats.norm.cdf(stats.norm.ppf(power) - 0.5)
        assert exact * 0.97 <= curve.inverse_power(power) <= exact  # below: a weaker hypothesis


def _gaussian_scores(rng: np.random.Generator, m: int, steps: int, q: float, sigma: float,
                     real_sigma: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A white-box one-run audit of the Poisson-subsampled Gaussian simulated exactly: canary j's
    coordinate, in units of the claimed noise, is μ·[in and sampled] + N(0, (real/claimed)²)."""
    included = rng.random(m) < 0.5
    mu = 1 / sigma
    noise = (real_sigma or sigma) / sigma
    z = noise * rng.normal(size=(steps, m)) + mu * ((rng.random((steps, m)) < q) & included)
    absent = math.log1p(-q) if q < 1 else -math.inf
    return np.logaddexp(absent, math.log(q) + mu * z - mu ** 2 / 2).sum(axis=0), included


def test_the_test_is_valid_for_the_mechanism_it_hypothesises():
    # 300 simulated audits of the true mechanism: its own curve is rejected at level 5% at most ~5%
    # of the time; with the noise 4× smaller than claimed, nearly always
    rng = np.random.default_rng(1)
    sigma, q, steps, m = 2.0, 1.0, 4, 200
    curve = curve_of(planned_event(sigma, q, steps))
    sizes = [10, 25, 50]
    for real, low, high in ((sigma, 0.0, 0.08), (sigma / 4, 0.9, 1.0)):
        rejected = []
        for _ in range(300):
            scores, included = _gaussian_scores(rng, m, steps, q, sigma, real)
            rejected.append(any(fdp_rejects(top_bottom_guesses(scores, included, k), curve, 0.05 / 3)
                                for k in sizes))
        assert low <= np.mean(rejected) <= high


@pytest.mark.parametrize("q, sigma", [(1.0, 2.5), (0.5, 1.5)])
@pytest.mark.slow
def test_f_dp_bound_is_below_epsilon_and_above_the_steinke_bound(q, sigma):
    rng = np.random.default_rng(2)
    steps, m, delta = 10, 1000, 1e-5
    event = planned_event(sigma, q, steps)
    epsilon = epsilon_of(event, delta)  # about 4 for both
    scores, included = _gaussian_scores(rng, m, steps, q, sigma)
    bounds = one_run_bounds(scores, included, event, delta, 0.95)
    assert bounds.steinke < bounds.fdp <= epsilon
    assert bounds.best == bounds.fdp
    # noise 4× smaller than claimed: the claimed curve is rejected, ε_LB > ε
    scores, included = _gaussian_scores(rng, m, steps, q, sigma, sigma / 4)
    broken = one_run_bounds(scores, included, event, delta, 0.95)
    assert broken.fdp > epsilon and broken.fdp >= broken.steinke


def test_f_dp_bound_without_signal_is_zero_and_bad_input_is_refused():
    rng = np.random.default_rng(3)
    included = rng.random(400) < 0.5
    scores = rng.normal(size=400)  # no signal: the audit's power is nil
    guesses = [top_bottom_guesses(scores, included, k) for k in default_guess_sizes(400)]
    assert fdp_epsilon_bound(guesses, planned_event(1.0, 0.5, 5), 1e-5, 0.95) == 0.0
    with pytest.raises(ValueError, match="confidence"):
        fdp_epsilon_bound(guesses, planned_event(1.0, 0.5, 5), 1e-5, 1.0)
    with pytest.raises(ValueError, match="noise"):
        fdp_epsilon_bound(guesses, planned_event(0.0, 0.5, 5), 1e-5, 0.95)
    with pytest.raises(TypeError, match="scale"):
        scaled(dpa.NonPrivateDpEvent(), 2.0)


def test_scaled_event_scales_every_noise_multiplier():
    step = dpa.PoissonSampledDpEvent(0.5, dpa.ComposedDpEvent([dpa.GaussianDpEvent(2.0),
                                                               dpa.LaplaceDpEvent(4.0)]))
    event = scaled(dpa.SelfComposedDpEvent(step, 3), 0.5)
    inner = event.event.event.events
    assert event.count == 3 and event.event.sampling_probability == 0.5
    assert inner[0].noise_multiplier == 1.0 and inner[1].noise_multiplier == 2.0


def test_combined_bound_pays_for_both():
    # each bound inside the combination is computed at confidence 1 − (1 − c)/2
    rng = np.random.default_rng(4)
    sigma, q, steps = 2.0, 1.0, 4
    scores, included = _gaussian_scores(rng, 600, steps, q, sigma)
    bounds = one_run_bounds(scores, included, planned_event(sigma, q, steps), 1e-5, 0.95)
    alone, _ = best_one_run_bound(scores, included, 1e-5, 0.975)
    assert bounds.steinke == alone
