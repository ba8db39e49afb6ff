"""Accountant figures against independent implementations, calibration, and the ledger."""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
from dp_accounting.pld import pld_privacy_accountant
from prv_accountant import PRVAccountant
from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism
from scipy.stats import norm
from support.marks import slow_case

import tunefree
from tunefree.privacy.accounting import accountable, epsilon_of, planned_event
from tunefree.privacy.ledger import Ledger


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact ε of a μ-GDP mechanism (Balle & Wang 2018), by root finding on the tight δ(ε)."""
    from scipy.optimize import brentq

    def delta_of(eps):
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)

    return brentq(lambda e: delta_of(e) - delta, 0, 100)


@pytest.mark.parametrize("sigma,steps", [slow_case(0.8, 1), slow_case(1.0, 10), (2.0, 100), (5.0, 1000)])
def test_full_batch_matches_the_exact_gaussian_formula(sigma, steps):
    # q = 1: T Gaussian releases compose to one Gaussian of μ = √T/σ, whose ε has a closed form.
    exact = gaussian_epsilon(math.sqrt(steps) / sigma, 1e-5)
    pld = tunefree.epsilon(noise_multiplier=sigma, sample_rate=1.0, steps=steps, delta=1e-5)
    assert exact <= pld <= exact * 1.003 + 1e-3


GRID = [slow_case(0.6, 0.01, 1000), slow_case(1.0, 0.004, 2500), slow_case(1.1, 0.05, 300),
        slow_case(2.0, 0.1, 200), (4.0, 0.2, 100)]


@pytest.mark.parametrize("sigma,q,steps", GRID)
def test_pld_agrees_with_prv_accountant(sigma, q, steps):
    prv = PRVAccountant(prvs=PoissonSubsampledGaussianMechanism(noise_multiplier=sigma,
                                                                sampling_probability=q),
                        max_self_compositions=steps, eps_error=0.01, delta_error=1e-10)
    low, _, high = prv.compute_epsilon(delta=1e-5, num_self_compositions=[steps])
    pld = tunefree.epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=1e-5)
    # dp_accounting's PLD is pessimistic: at least the certified lower bound, and close to the upper.
    assert low <= pld <= high * 1.01 + 1e-3
    rdp = tunefree.epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=1e-5,
                           accountant="rdp")
    assert rdp >= pld  # RDP is a valid but looser bound


@pytest.mark.parametrize("target,q,steps", [(0.5, 0.01, 500), slow_case(3.0, 0.1, 300),
                                             slow_case(8.0, 0.05, 2000)])
@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_calibration_round_trip(target, q, steps, accountant):
    sigma = tunefree.noise_multiplier(target_epsilon=target, sample_rate=q, steps=steps,
                                      delta=1e-5, accountant=accountant)
    spent = tunefree.epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=1e-5,
                             accountant=accountant)
    assert 0.99 * target <= spent <= target


def test_no_noise_means_no_privacy():
    assert tunefree.epsilon(noise_multiplier=0.0, sample_rate=0.1, steps=10, delta=1e-5) == math.inf


@pytest.mark.parametrize("kwargs", [
    {"noise_multiplier": 1.0, "sample_rate": 1.5, "steps": 10, "delta": 1e-5},
    {"noise_multiplier": 1.0, "sample_rate": 0.1, "steps": 0, "delta": 1e-5},
    {"noise_multiplier": 1.0, "sample_rate": 0.1, "steps": 10, "delta": 1.0},
    {"noise_multiplier": -1.0, "sample_rate": 0.1, "steps": 10, "delta": 1e-5},
    {"noise_multiplier": 1.0, "sample_rate": 0.1, "steps": 10, "delta": 1e-5, "accountant": "gdp"},
])
def test_calculator_refuses_bad_input(kwargs):
    with pytest.raises(ValueError):
        tunefree.epsilon(**kwargs)


def test_composed_gaussians_on_one_batch_reduce_exactly():
    # Two Gaussian releases on one batch are one Gaussian with σ = (σ₁⁻² + σ₂⁻²)^(-1/2): checked
    # against the closed form at q = 1 (Proposition 3.1 of the group-wise clipping paper).
    event = dpa.PoissonSampledDpEvent(1.0, dpa.ComposedDpEvent([dpa.GaussianDpEvent(1.5),
                                                               dpa.GaussianDpEvent(4.0)]))
    mu = math.sqrt(1.5 ** -2 + 4.0 ** -2)
    assert epsilon_of(event, 1e-6) == pytest.approx(gaussian_epsilon(mu, 1e-6), rel=3e-3)
    reduced = accountable(event)
    assert reduced.event.noise_multiplier == pytest.approx(1 / mu)


@pytest.mark.slow
def test_ledger_compresses_runs_and_survives_a_round_trip():
    ledger = Ledger()
    for _ in range(50):
        ledger.record_step(0.1, [dpa.GaussianDpEvent(1.2)])
    for _ in range(5):
        ledger.record_step(0.1, [dpa.GaussianDpEvent(1.2), dpa.GaussianDpEvent(3.0)])
    assert ledger.steps == 55
    assert len(ledger.state_dict()["runs"]) == 2
    copy = Ledger()
    copy.load_state_dict(ledger.state_dict())
    assert copy.epsilon(1e-5) == ledger.epsilon(1e-5)
    plain = tunefree.epsilon(noise_multiplier=1.2, sample_rate=0.1, steps=55, delta=1e-5)
    assert ledger.epsilon(1e-5) > plain  # the extra releases are paid for


def test_empty_ledger_spent_nothing():
    assert Ledger().epsilon(1e-5) == 0.0


@pytest.mark.slow
def test_ledger_composes_alternating_steps_as_two_self_compositions():
    ledger = Ledger()
    every_fifth = [dpa.GaussianDpEvent(1.0), dpa.GaussianDpEvent(5.0)]
    for step in range(100):
        ledger.record_step(0.1, every_fifth if step % 5 == 0 else every_fifth[:1])
    assert len(ledger.event().events) == 2
    expected = dpa.ComposedDpEvent([
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)), 80),
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.ComposedDpEvent(every_fifth)),
                                20)])
    assert ledger.epsilon(1e-5) == pytest.approx(epsilon_of(expected, 1e-5), rel=1e-9)


@pytest.mark.parametrize("event", [
    slow_case(planned_event(1.3, 0.05, 40)),
    slow_case(dpa.ComposedDpEvent([dpa.GaussianDpEvent(20.0), dpa.GaussianDpEvent(20.0),
                                   planned_event(2.0, 0.2, 30)])),
    dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(1.0, dpa.GaussianDpEvent(3.0)), 5),
    slow_case(dpa.ComposedDpEvent([planned_event(1.1, 0.1, 7),
                                   dpa.PoissonSampledDpEvent(0.0, dpa.GaussianDpEvent(1.0)),
                                   dpa.SelfComposedDpEvent(planned_event(0.9, 0.02, 3), 4)])),
    slow_case(dpa.ComposedDpEvent([planned_event(1.3, 0.05, 10),
                                   dpa.PoissonSampledDpEvent(0.05, dpa.LaplaceDpEvent(2.0))])),
])
def test_pld_epsilon_is_the_pld_accountants_to_the_last_bit(event):
    """epsilon_of keeps the PLD of each release to answer a growing ledger quickly; it must give exactly
    the figure of dp_accounting's PLD accountant (the Laplace case goes through the accountant itself),
    the first time and again from the kept PLDs."""
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(accountable(event))
    expected = accountant.get_epsilon(1e-5)
    assert epsilon_of(event, 1e-5) == expected
    assert epsilon_of(event, 1e-5) == expected
