"""Noise calibration on the planned ledger of the whole run.

Given a function from one scalar noise level to the planned run's DpEvent, find the noise level whose ε
is at most the target and within 1% of it. Budget splits (quantile releases, loss releases) are solved
the same way, jointly on the composed event, never by adding ε's.
"""

from __future__ import annotations

from collections.abc import Callable

import dp_accounting as dpa

from .accounting import REPORT_DISCRETIZATION, SEARCH_DISCRETIZATION, epsilon_of

RELATIVE_TOLERANCE = 0.01
# Below this noise level a run spends hundreds of ε (effectively no privacy) and its PLD takes
# seconds to minutes and gigabytes to compute; the search and the calculator stop here.
MIN_NOISE_MULTIPLIER = 0.3


def calibrate(
    planned: Callable[[float], dpa.DpEvent], target_epsilon: float, delta: float,
    accountant: str = "pld", tolerance: float = RELATIVE_TOLERANCE,
) -> float:
    """The noise level σ with ``(1 - tolerance)·target ≤ ε(planned(σ)) ≤ target``.

    ``planned(σ)`` must spend less as σ grows. Raises if no finite σ reaches the target. A target so
    loose that even ``MIN_NOISE_MULTIPLIER`` spends less returns that floor: the run then spends less
    than the target, never more.
    """
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be positive, got {target_epsilon}")

    def eps(sigma: float, fine: bool = False) -> float:
        discretization = REPORT_DISCRETIZATION if fine else SEARCH_DISCRETIZATION
        return epsilon_of(planned(sigma), delta, accountant, discretization)

    low, high = 0.5, 1.0
    while eps(high) > target_epsilon:
        low, high = high, high * 2
        if high > 1e6:
            raise ValueError(f"no noise level reaches epsilon={target_epsilon} at delta={delta}")
    while eps(low) <= target_epsilon:
        if low <= MIN_NOISE_MULTIPLIER:
            return low
        high, low = low, max(low / 2, MIN_NOISE_MULTIPLIER)
    # ε(low) > target ≥ ε(high): shrink until ε(high) is within tolerance of the target.
    for _ in range(100):
        if eps(high) >= (1 - tolerance / 2) * target_epsilon:
            spent = eps(high, fine=True)
            if (1 - tolerance) * target_epsilon <= spent <= target_epsilon:
                return high
        middle = (low * high) ** 0.5
        if eps(middle) > target_epsilon:
            low = middle
        else:
            high = middle
    raise RuntimeError("noise calibration did not converge")  # pragma: no cover
