"""Noise calibration converges for every ε a user may ask for, on both accountants, and the σ it returns
spends, by dp_accounting's own accountants called directly, at most the target and within 1% of it."""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
from support.marks import slow_case

import tunefree
from tunefree.privacy import MIN_NOISE_MULTIPLIER

DELTA = 1e-5
# (target ε, sample rate, steps): ε from 0.01 to 100; full batches, small rates over long runs
# (the cases whose calibration takes seconds are marked slow)
GRID = [(0.01, 1.0, 1), (0.1, 1.0, 1), (1.0, 1.0, 1), slow_case(10.0, 1.0, 1), slow_case(100.0, 1.0, 1000),
        slow_case(0.01, 0.01, 1000), slow_case(0.1, 0.01, 1000), slow_case(1.0, 0.01, 1000),
        slow_case(10.0, 0.01, 1000), slow_case(0.01, 1e-4, 10**6), slow_case(1.0, 1e-3, 10**5),
        slow_case(0.15, 0.2, 200)]


def _direct_epsilon(sigma: float, q: float, steps: int, accountant: str) -> float:
    """ε of the run by dp_accounting's accountant itself (its default PLD grid, or RDP)."""
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    if accountant == "pld":
        accountant_ = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
    else:
        accountant_ = dpa.rdp.RdpAccountant()
    accountant_.compose(event)
    return accountant_.get_epsilon(DELTA)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("target, q, steps", GRID)
def test_calibration_lands_within_one_percent_below_the_target(target, q, steps, accountant):
    sigma = tunefree.noise_multiplier(target_epsilon=target, sample_rate=q, steps=steps, delta=DELTA,
                                      accountant=accountant)
    spent = _direct_epsilon(sigma, q, steps, accountant)
    assert sigma >= MIN_NOISE_MULTIPLIER and spent <= target
    assert spent >= 0.99 * target, (sigma, spent)


@pytest.mark.parametrize("accountant", [slow_case("pld"), "rdp"])
def test_a_target_looser_than_the_floor_returns_the_floor_spending_less(accountant):
    sigma = tunefree.noise_multiplier(target_epsilon=100.0, sample_rate=1.0, steps=1, delta=DELTA,
                                      accountant=accountant)
    assert sigma == MIN_NOISE_MULTIPLIER and _direct_epsilon(sigma, 1.0, 1, accountant) < 100.0


def test_a_target_no_noise_reaches_is_refused():
    from tunefree.privacy.calibrate import calibrate

    prior = dpa.GaussianDpEvent(1.0)  # a release before training that spends more than the target alone
    with pytest.raises(ValueError, match="no noise level reaches"):
        calibrate(lambda s: dpa.ComposedDpEvent([prior, dpa.GaussianDpEvent(s)]), 1.0, DELTA, "rdp")
    assert math.isfinite(calibrate(lambda s: dpa.ComposedDpEvent([prior, dpa.GaussianDpEvent(s)]), 6.0,
                                   DELTA, "rdp"))
