"""The statistics of an audit: from membership guesses to a rigorous lower bound on ε.

Two bounds, both computed with scipy:

- one run (Steinke, Nasr & Jagielski 2023, Theorem 5.2): m canaries each included independently with
  probability ½; an auditor makes r guesses (the rest abstain) of which v are right. If the run is
  (ε, δ)-DP, P[v or more right] ≤ P[Binomial(r, p) ≥ v] + 2mδ·maxᵢ P[v − i ≤ Binomial(r, p) < v]/i with
  p = eᵉ/(1 + eᵉ). ε_LB is the largest ε this rejects at the stated confidence.
- many runs (Clopper–Pearson): a threshold test's false-positive and false-negative rates, each bounded
  from above by an exact binomial interval; any (ε, δ)-DP run has FPR·eᵉ + FNR ≥ 1 − δ (and the same with
  the two swapped), so ε_LB = ln((1 − δ − FNR⁺)/FPR⁺).

Every bound holds only for guesses (and thresholds) fixed before the membership is looked at; choosing
among several guess sizes is paid for with a union bound (Bonferroni) over the sizes tried.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_EPSILON = 50.0  # no audit here can resolve more; a bound at this value means "at least this"


@dataclass(frozen=True)
class Guesses:
    """An auditor's guesses on canaries: ``guesses`` made (r), ``correct`` among them (v), out of
    ``canaries`` (m) canaries in the run."""

    guesses: int
    correct: int
    canaries: int

    def __post_init__(self) -> None:
        if not 0 <= self.correct <= self.guesses <= self.canaries:
            raise ValueError(f"need 0 ≤ correct ≤ guesses ≤ canaries, got {self}")


def one_run_p_value(guesses: Guesses, epsilon: float, delta: float) -> float:
    """The probability that an (ε, δ)-DP run lets ``guesses.guesses`` guesses be right
    ``guesses.correct`` times or more (Steinke et al. 2023, Theorem 5.2)."""
    from scipy import stats

    r, v, m = guesses.guesses, guesses.correct, guesses.canaries
    if v == 0:
        return 1.0
    p = 1 / (1 + math.exp(-epsilon))
    tail = float(stats.binom.sf(v - 1, r, p))
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, p)  # P[B = v − i] for i = 1 … v
    spread = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(1.0, tail + 2 * m * delta * spread)


def one_run_epsilon_bound(guesses: Guesses, delta: float, confidence: float) -> float:
    """ε_LB: the largest ε at which (ε, δ)-DP is rejected with probability of error at most
    ``1 − confidence`` (0 when even ε = 0 is not rejected)."""
    from scipy import optimize

    _check_confidence(confidence)
    level = 1 - confidence
    if one_run_p_value(guesses, 0.0, delta) > level:
        return 0.0
    if one_run_p_value(guesses, MAX_EPSILON, delta) <= level:
        return MAX_EPSILON
    # the p-value decreases in ε: the root of p-value(ε) = level separates rejected from not rejected
    return float(optimize.brentq(lambda e: one_run_p_value(guesses, e, delta) - level, 0.0, MAX_EPSILON,
                                 xtol=1e-5))


def top_bottom_guesses(scores: np.ndarray, included: np.ndarray, k: int) -> Guesses:
    """Guess "in" for the ``k`` highest scores and "out" for the ``k`` lowest, abstain on the rest."""
    m = len(scores)
    if not 0 < 2 * k <= m:
        raise ValueError(f"k must be in [1, m/2] for m = {m} canaries, got {k}")
    order = np.argsort(scores, kind="stable")
    correct = int(included[order[-k:]].sum()) + int((~included[order[:k]]).sum())
    return Guesses(guesses=2 * k, correct=correct, canaries=m)


def default_guess_sizes(canaries: int) -> list[int]:
    """The guess sizes k tried by default: 0.5%, 1%, 2.5%, 5%, 10%, 25% and 50% of the canaries, each side."""
    sizes = {max(1, int(canaries * f)) for f in (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)}
    return sorted(k for k in sizes if 2 * k <= canaries)


def best_one_run_bound(scores: np.ndarray, included: np.ndarray, delta: float, confidence: float,
                       sizes: Sequence[int] | None = None) -> tuple[float, Guesses]:
    """The best ε_LB over the guess sizes ``sizes`` (top-k "in", bottom-k "out"), each tested at
    confidence ``1 − (1 − confidence)/len(sizes)`` so that the best of them holds at ``confidence``."""
    scores, included = np.asarray(scores, dtype=float), np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ValueError("scores and included must be 1-D arrays of the same length")
    sizes = default_guess_sizes(len(scores)) if sizes is None else list(sizes)
    if not sizes:
        raise ValueError("an audit needs at least two canaries")
    each = 1 - (1 - confidence) / len(sizes)
    results = [(one_run_epsilon_bound(g, delta, each), g)
               for g in (top_bottom_guesses(scores, included, k) for k in sizes)]
    return max(results, key=lambda result: result[0])


def clopper_pearson_upper(failures: int, trials: int, confidence: float) -> float:
    """The exact one-sided upper confidence bound of a binomial proportion."""
    from scipy import stats

    _check_confidence(confidence)
    if failures >= trials:
        return 1.0
    return float(stats.beta.ppf(confidence, failures + 1, trials - failures))


def clopper_pearson_epsilon_bound(false_positives: int, negatives: int, false_negatives: int,
                                  positives: int, delta: float, confidence: float) -> float:
    """ε_LB of a membership test with the given errors on ``negatives`` runs without the canary and
    ``positives`` runs with it; both rates are bounded at confidence ``1 − (1 − confidence)/2``."""
    each = 1 - (1 - confidence) / 2
    fpr = clopper_pearson_upper(false_positives, negatives, each)
    fnr = clopper_pearson_upper(false_negatives, positives, each)
    bounds = [0.0]
    for first, second in ((fpr, fnr), (fnr, fpr)):
        if 1 - delta - second > 0 and first > 0:
            bounds.append(math.log((1 - delta - second) / first))
    return max(bounds)


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
