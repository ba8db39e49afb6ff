"""The privacy calculator people otherwise write by hand: ε of a DP-SGD run, or σ for a target ε."""

from __future__ import annotations

import math

from .accounting import check_accountant, check_delta, epsilon_of, planned_event
from .calibrate import calibrate


def _check_run(sample_rate: float, steps: int) -> None:
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps}")


def epsilon(*, noise_multiplier: float, sample_rate: float, steps: int, delta: float,
            accountant: str = "pld") -> float:
    """ε at ``delta`` of ``steps`` Poisson-sampled Gaussian releases with noise multiplier σ.

    Below σ = ``MIN_NOISE_SIGMA_FOR_PLD`` the PLD accountant is replaced by RDP (see ``epsilon_of``).
    """
    _check_run(sample_rate, steps)
    check_delta(delta)
    check_accountant(accountant)
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be a finite number ≥ 0, got {noise_multiplier}")
    return epsilon_of(planned_event(noise_multiplier, sample_rate, int(steps)), delta, accountant)


def noise_multiplier(*, target_epsilon: float, sample_rate: float, steps: int, delta: float,
                     accountant: str = "pld") -> float:
    """The noise multiplier σ whose run spends at most ``target_epsilon`` (and within 1% of it)."""
    _check_run(sample_rate, steps)
    check_delta(delta)
    check_accountant(accountant)
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be a positive finite number, got {target_epsilon}")
    return calibrate(lambda sigma: planned_event(sigma, sample_rate, int(steps)), target_epsilon,
                     delta, accountant)


def gaussian_noise_multiplier(*, epsilon: float, delta: float) -> float:
    """σ of one Gaussian release (noise σ·sensitivity) that is exactly (``epsilon``, ``delta``)-DP: the
    analytic Gaussian mechanism (Balle & Wang 2018), i.e. μ-GDP with μ = 1/σ, whose tight δ(ε) is
    Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2). ``epsilon`` ∞ is no noise (0). Gaussian releases compose by adding
    μ², so this is the currency in which a budget is shared between Gaussian releases."""
    check_delta(delta)
    if epsilon == math.inf:
        return 0.0
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be a positive number (or inf), got {epsilon}")
    from scipy.optimize import brentq
    from scipy.stats import norm

    def excess(log_mu: float) -> float:  # δ(ε) of μ-GDP minus the target, increasing in μ
        mu = math.exp(log_mu)
        return (norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * norm.cdf(-epsilon / mu - mu / 2)
                - delta) if epsilon < 700 else norm.cdf(-epsilon / mu + mu / 2) - delta

    low, high = -30.0, 10.0
    while excess(high) < 0:
        high += 10.0
    return math.exp(-brentq(excess, low, high, xtol=1e-12, rtol=1e-12))
