"""Statistical checks on the canary coordinates of a white-box audit (estimates, not bounds).

In units of the noise standard deviation the run claims, coordinate j of step t's release is
``μₜ·[canary j included and sampled] + noise``. Two checks follow, each a confidence interval that must
contain 1:

- noise: the observations of the canaries left out are pure noise; their root mean square is the
  ratio of the real noise to the claimed one (χ² interval);
- separation: the mean of the included canaries' observations minus the left-out ones' is q·μₜ on
  average; its ratio to that (normal interval) is the real sensitivity times sampling rate over the
  claimed ones.

A broken mechanism that an ε lower bound is too weak to expose (noise 2× too small, a release at twice
its recorded sensitivity, sampling at 2q) moves one of these ratios far outside its interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Check:
    """A measured ratio (1 when the run does what it claims) with its confidence interval."""

    name: str
    ratio: float
    low: float
    high: float
    confidence: float

    @property
    def passed(self) -> bool:
        return bool(self.low <= 1.0 <= self.high)

    def __str__(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        return (f"{self.name}: measured/claimed = {self.ratio:.4f} "
                f"[{self.low:.4f}, {self.high:.4f}] at {self.confidence:.1%} — {verdict}")


def noise_check(noise: np.ndarray, confidence: float) -> Check:
    """Ratio of the real to the claimed noise standard deviation, from observations that hold noise only
    (in units of the claimed standard deviation)."""
    from scipy import stats

    values = np.asarray(noise, dtype=float).ravel()
    n = values.size
    if n < 2:
        raise ValueError("the noise check needs at least two observations of left-out canaries")
    total = float(np.sum(values ** 2))
    tail = (1 - confidence) / 2
    low = math.sqrt(total / stats.chi2.ppf(1 - tail, n))
    high = math.sqrt(total / stats.chi2.ppf(tail, n))
    return Check("noise", math.sqrt(total / n), low, high, confidence)


def separation_check(observations: np.ndarray, included: np.ndarray, expected_shift: float,
                     confidence: float) -> Check:
    """Ratio of the measured mean shift of included over left-out canaries (per step, averaged over
    steps) to ``expected_shift`` = the average of q·μₜ."""
    from scipy import stats

    if not expected_shift > 0:
        raise ValueError(f"the expected shift must be positive, got {expected_shift}")
    per_canary = np.asarray(observations, dtype=float).mean(axis=0)
    inside, outside = per_canary[included], per_canary[~included]
    if min(len(inside), len(outside)) < 2:
        raise ValueError("the separation check needs at least two included and two left-out canaries")
    shift = inside.mean() - outside.mean()
    error = math.sqrt(inside.var(ddof=1) / len(inside) + outside.var(ddof=1) / len(outside))
    z = stats.norm.ppf(1 - (1 - confidence) / 2)
    return Check("separation", float(shift / expected_shift), float((shift - z * error) / expected_shift),
                 float((shift + z * error) / expected_shift), confidence)
