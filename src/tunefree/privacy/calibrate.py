"""Noise calibration on the planned ledger of the whole run.

Given a function from one scalar noise level to the planned run's DpEvent, find the noise level whose ε —
as it will be reported, on the report's accounting grid — is at most the target and within 1% of it.
Budget splits (quantile releases, loss releases, releases before training) are solved the same way,
jointly on the composed event, never by adding ε's.

The search brackets and bisects σ on a coarse PLD grid (cheap where σ is small and the PLD wide),
accepting a σ whose reported ε is in the band; where the coarse grid cannot land there, it solves on the
reported ε itself, by interpolation in log σ – log ε (ε falls roughly as a power of σ) kept inside the
bracket. Solving on the reported ε matters at small ε: there the coarse grid overstates ε by more than
the 1% tolerance (at ε ≈ 0.04, q = 0.01, 1,000 steps, by a factor 2), and a search on it alone never
lands within 1% of the target as reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import dp_accounting as dpa

from .accounting import REPORT_DISCRETIZATION, SEARCH_DISCRETIZATION, epsilon_of

RELATIVE_TOLERANCE = 0.01
# Below this noise level a run spends hundreds of ε (effectively no privacy) and its PLD takes
# seconds to minutes and gigabytes to compute; the search and the calculator stop here.
MIN_NOISE_MULTIPLIER = 0.3
# Above this noise level the search gives up: the target is below what the run spends without training
# (its releases before training), or so close to it that no noise reaches it.
MAX_NOISE_MULTIPLIER = 1e9


def calibrate(
    planned: Callable[[float], dpa.DpEvent], target_epsilon: float, delta: float,
    accountant: str = "pld", tolerance: float = RELATIVE_TOLERANCE,
) -> float:
    """The noise level σ with ``(1 - tolerance)·target ≤ ε(planned(σ)) ≤ target``, ε as reported.

    ``planned(σ)`` must spend less as σ grows. Raises if no σ up to ``MAX_NOISE_MULTIPLIER`` reaches
    the target. A target so loose that even ``MIN_NOISE_MULTIPLIER`` spends less returns that floor: the
    run then spends less than the target, never more. Where the reported ε jumps across the whole band
    (a PLD grid's step), the σ returned spends the most below the target that a bracket of relative
    width 10⁻⁹ finds.
    """
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be positive, got {target_epsilon}")
    reported: dict[float, float] = {}

    def coarse(sigma: float) -> float:
        return epsilon_of(planned(sigma), delta, accountant, SEARCH_DISCRETIZATION)

    def eps(sigma: float) -> float:  # as the ledger will report it
        if sigma not in reported:
            reported[sigma] = epsilon_of(planned(sigma), delta, accountant, REPORT_DISCRETIZATION)
        return reported[sigma]

    def too_much(sigma: float) -> bool:
        if sigma >= MAX_NOISE_MULTIPLIER:
            raise ValueError(f"no noise level reaches epsilon={target_epsilon} at delta={delta}: the run "
                             f"spends more even at σ = {MAX_NOISE_MULTIPLIER:g} (its releases before "
                             "training may take the whole budget)")
        return True

    # 1. On the coarse grid, which overstates ε a little and costs little at small σ: a bracket, then σ
    #    within the band.
    low, high = 0.5, 1.0
    while coarse(high) > target_epsilon and too_much(high):
        low, high = high, high * 2
    while coarse(low) <= target_epsilon:
        if low <= MIN_NOISE_MULTIPLIER:  # even the floor spends less on the coarse grid: as reported?
            if eps(MIN_NOISE_MULTIPLIER) <= target_epsilon:
                return MIN_NOISE_MULTIPLIER
            break
        high, low = low, max(low / 2, MIN_NOISE_MULTIPLIER)
    else:
        # geometric bisection on the coarse grid, checked on the reported ε near the target (the σ this
        # finds is the one calibration has always found, so runs and checkpoints keep their σ) ...
        while high / low > 1 + 1e-9:
            if coarse(high) >= (1 - tolerance / 2) * target_epsilon \
                    and (1 - tolerance) * target_epsilon <= eps(high) <= target_epsilon:
                return high
            middle = (low * high) ** 0.5
            if coarse(middle) > target_epsilon:
                low = middle
            else:
                high = middle
        # ... unless the coarse grid overstates ε by more than the band (small ε): then on the reported ε
    # 2. A bracket on the reported ε, eps(low) > target ≥ eps(high) (or the floor): ε as reported is below
    #    the coarse grid's, so the bracket widens downwards.
    while eps(high) > target_epsilon and too_much(high):
        low, high = high, high * 1.05
    step = 1.02
    low = max(high / step, MIN_NOISE_MULTIPLIER)
    while eps(low) <= target_epsilon:
        if low <= MIN_NOISE_MULTIPLIER:
            return MIN_NOISE_MULTIPLIER
        high, step = low, step ** 2
        low = max(high / step, MIN_NOISE_MULTIPLIER)
    # 3. σ within the band of the reported ε.
    return _solve(eps, low, high, target_epsilon, tolerance)


def _solve(eps: Callable[[float], float], low: float, high: float, target: float, tolerance: float) -> float:
    """σ in ``[low, high]`` with ``(1 - tolerance)·target ≤ eps(σ) ≤ target``, given ``eps(low) > target
    ≥ eps(high)`` and ``eps`` decreasing: log ε interpolated linearly in log σ between the bracket's ends,
    aiming at the middle of the band (Illinois: an end kept twice has its weight halved), bisecting when
    the interpolation leaves the bracket. Where ``eps`` jumps across the whole band, the upper end once the
    bracket is 10⁻⁹ wide (it spends below the target)."""
    floor = (1 - tolerance) * target
    aim = math.log((1 - tolerance / 2) * target)
    x_low, x_high = math.log(low), math.log(high)
    g_low, g_high = math.log(eps(low)) - aim, math.log(eps(high)) - aim
    kept = 0  # > 0: the low end moved that many times in a row; < 0: the high end
    while eps(math.exp(x_high)) < floor and x_high - x_low > 1e-9:
        x = x_high - g_high * (x_high - x_low) / (g_high - g_low) if g_high != g_low else math.nan
        if not x_low < x < x_high:
            x = (x_low + x_high) / 2
        spent = eps(math.exp(x))
        if spent > target:
            x_low, g_low = x, math.log(spent) - aim
            kept = max(kept, 0) + 1
            if kept > 1:
                g_high /= 2
        else:
            x_high, g_high = x, math.log(spent) - aim
            kept = min(kept, 0) - 1
            if kept < -1:
                g_low /= 2
    return math.exp(x_high)
