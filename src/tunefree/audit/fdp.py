"""The f-DP one-run bound (Mahloujifar, Melis & Chaudhuri 2024): the one-run audit's guesses tested
against the privacy curve the run's ledger claims, instead of the worst mechanism with its (ε, δ).

**The curve.** dp_accounting's PLD accountant composes the ledger's event and gives δ(ε) for every ε; a
run that is (ε, δ(ε))-DP for every ε is f-DP for ``f = sup_ε f_{ε,δ(ε)}`` (Dong, Roth & Su 2022,
Prop. 2.12). We keep δ(ε) on a grid of ε: fewer pairs give a smaller f, a weaker hypothesis, so the
test stays valid; the PLD is pessimistic (δ too large), which also only weakens it. f is symmetric (δ(ε)
is the larger of the add and remove directions), and ``f̄ = 1 − f`` is concave.

**The test.** m canaries, each in with probability ½; k guesses, C of them right. For every i ≥ 1 and
canary j, f-DP applied to the test "the guess on j is right and ≥ i − 1 other guesses are right" (the
other canaries fixed), averaged over the canaries with the concavity of f̄, gives

    rᵢ ≤ f̄(hᵢ₋₁),   rᵢ = E[C·1{C ≥ i}]/m,   hᵢ = E[(k − C)·1{C ≥ i}]/m,   r₀ + h₀ = k/m.

If P[C ≥ c] ≥ τ, the least values these constraints allow, from ``r_c = τc/m``, ``h_c = τ(k − c)/m`` down
to i = 0, must not exceed k/m; when they do, P[C ≥ c] < τ and the curve is rejected at level τ (the
paper's algorithm; the tests check it against the linear program over the same constraints).

**ε_LB.** The family of curves of the ledger's event with every noise multiplier scaled by s. The
smallest s whose curve is rejected gives ε_LB, the ε at δ of that curve: ε_LB > claimed ε exactly when the
ledger's own curve (s = 1) is rejected. It is a bound on the curve, which the ledger claims in full (every
(ε, δ(ε)) pair), not on one (ε, δ) pair: a run that kept the claimed (ε, δ) but broke the curve elsewhere
is caught too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import dp_accounting as dpa
import numpy as np
from dp_accounting.pld import pld_privacy_accountant

from ..privacy.accounting import (
    MIN_NOISE_SIGMA_FOR_PLD,
    accountable,
    epsilon_of,
    is_threshold,
    split_threshold_delta,
)
from .bounds import Guesses

CURVE_POINTS = 160  # ε grid of a curve: 0 … the ε at δ = SMALLEST_DELTA
SMALLEST_DELTA = 1e-12
CURVE_DISCRETIZATION = 1e-2  # PLD grid of the curves tested (pessimistic: coarser only weakens the test)
SCALE_RANGE = (1 / 16, 64.0)  # noise scales s searched: ε_LB saturates at the ε of s = 1/16
SEARCH_STEPS = 10  # bisection steps in log s: s* to within a factor 1.007


@dataclass(frozen=True)
class PrivacyCurve:
    """A trade-off function given by (ε, δ(ε)) pairs: f = sup over the pairs of f_{ε,δ}."""

    epsilons: np.ndarray
    deltas: np.ndarray

    def __post_init__(self) -> None:
        if self.epsilons.shape != self.deltas.shape or self.epsilons.ndim != 1 or not len(self.epsilons):
            raise ValueError("a privacy curve needs as many δ as ε (at least one pair)")
        object.__setattr__(self, "_up", np.exp(self.epsilons))
        object.__setattr__(self, "_down", np.exp(-self.epsilons))

    def inverse_power(self, power: float) -> float:
        """f̄⁻¹(power): the least false-positive rate at which a test may reach this true-positive rate
        (∞ above 1). Each pair forbids TPR > δ + eᵉ·FPR and TPR > 1 − e⁻ᵉ(1 − δ − FPR)."""
        if power > 1:
            return math.inf
        d = self.deltas
        lowest = np.maximum((power - d) * self._down, 1 - d - self._up * (1 - power))  # type: ignore[attr-defined]
        return max(0.0, float(lowest.max()))


def curve_of(event: dpa.DpEvent) -> PrivacyCurve:
    """The privacy curve of everything ``event`` releases, from dp_accounting's PLD accountant; a (0, p)
    release (partition selection's threshold) adds p to every δ."""
    event, threshold_delta = split_threshold_delta(accountable(event))
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=CURVE_DISCRETIZATION)
    accountant.compose(event)
    top = float(accountant.get_epsilon(SMALLEST_DELTA))
    epsilons = np.linspace(0.0, top, CURVE_POINTS)
    deltas = np.array([accountant.get_delta(float(e)) for e in epsilons]) + threshold_delta
    return PrivacyCurve(epsilons, np.minimum(deltas, 1.0))


def fdp_rejects(guesses: Guesses, curve: PrivacyCurve, level: float) -> bool:
    """Whether ``guesses.correct`` or more right guesses happen with probability below ``level`` in
    every run that is f-DP for ``curve`` (so that seeing them rejects the curve at that level)."""
    m, k, c = guesses.canaries, guesses.guesses, guesses.correct
    if c == 0:
        return False
    r, h = level * c / m, level * (k - c) / m
    for i in range(c - 1, -1, -1):
        if r > k / m:
            return True
        h_next = max(h, curve.inverse_power(r))
        if h_next == h:  # nothing changes any more down to i = 0
            break
        r += i / (k - i) * (h_next - h)
        h = h_next
    return r + h > k / m * (1 + 1e-12)


def scaled(event: dpa.DpEvent, factor: float) -> dpa.DpEvent:
    """``event`` with every noise multiplier multiplied by ``factor`` (< 1: a less private run); a (0, p)
    release has no noise to scale."""
    if is_threshold(event):
        return event
    if isinstance(event, dpa.GaussianDpEvent):
        return dpa.GaussianDpEvent(event.noise_multiplier * factor)
    if isinstance(event, dpa.LaplaceDpEvent):
        return dpa.LaplaceDpEvent(event.noise_multiplier * factor)
    if isinstance(event, dpa.PoissonSampledDpEvent):
        return dpa.PoissonSampledDpEvent(event.sampling_probability, scaled(event.event, factor))
    if isinstance(event, dpa.ComposedDpEvent):
        return dpa.ComposedDpEvent([scaled(e, factor) for e in event.events])
    if isinstance(event, dpa.SelfComposedDpEvent):
        return dpa.SelfComposedDpEvent(scaled(event.event, factor), event.count)
    raise TypeError(f"cannot scale the noise of {event!r}")


def _smallest_noise(event: dpa.DpEvent) -> float:
    if is_threshold(event):
        return math.inf
    if isinstance(event, (dpa.GaussianDpEvent, dpa.LaplaceDpEvent)):
        return event.noise_multiplier
    if isinstance(event, (dpa.PoissonSampledDpEvent, dpa.SelfComposedDpEvent)):
        return _smallest_noise(event.event)
    if isinstance(event, dpa.ComposedDpEvent):
        return min((_smallest_noise(e) for e in event.events), default=math.inf)
    raise TypeError(f"cannot read the noise of {event!r}")


def fdp_epsilon_bound(guesses: Sequence[Guesses], event: dpa.DpEvent, delta: float,
                      confidence: float) -> float:
    """ε_LB of the f-DP test: the ε at ``delta`` of the least private run of the family (``event``
    with its noise scaled) that any of ``guesses`` rejects, each tested at level
    ``(1 − confidence)/len(guesses)`` (0 when none rejects even the most private one tried)."""
    if not guesses:
        raise ValueError("the f-DP bound needs at least one set of guesses")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    level = (1 - confidence) / len(guesses)

    def rejected(scale: float) -> bool:
        curve = curve_of(scaled(event, scale))
        return any(fdp_rejects(g, curve, level) for g in guesses)

    noise = _smallest_noise(event)
    if not noise > 0 or not math.isfinite(noise):
        raise ValueError(f"the f-DP bound needs a run with noise, got a noise multiplier of {noise}")
    low, high = max(SCALE_RANGE[0], MIN_NOISE_SIGMA_FOR_PLD / noise), SCALE_RANGE[1]
    if not rejected(high):
        return 0.0
    if rejected(low):  # ε_LB saturates at the least private run searched
        high = low
    else:  # the boundary lies between: bisect in log s
        for _ in range(SEARCH_STEPS):
            middle = math.sqrt(low * high)
            low, high = (low, middle) if rejected(middle) else (middle, high)
    return epsilon_of(scaled(event, high), delta)
