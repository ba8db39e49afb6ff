"""ε from DpEvents, through ``dp_accounting`` only: PLD (tight, the default) or RDP (an upper bound).

Releases that share one Poisson-sampled batch are one ``PoissonSampledDpEvent`` of their composition.
``dp_accounting`` accepts only a single Gaussian or Laplace mechanism inside a sampled event, so a
composition of Gaussian releases is reduced to the one Gaussian it is exactly equivalent to:
noise multipliers σₖ (each relative to its own sensitivity) compose to ``σ = (Σₖ σₖ⁻²)^(-1/2)``.
"""

from __future__ import annotations

import functools
import math

import dp_accounting as dpa
from dp_accounting.pld import pld_privacy_accountant, privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant

from .._validate import fraction
from ..errors import SettingsRefused

ACCOUNTANTS = ("pld", "rdp")
# PLD grid for reported figures (dp_accounting's default) and a coarser one for calibration searches;
# both are pessimistic, i.e. upper bounds on the true ε.
REPORT_DISCRETIZATION = 1e-4
SEARCH_DISCRETIZATION = 1e-3
# Below this noise multiplier a run spends hundreds of ε and the PLD of its privacy loss takes seconds
# to minutes and gigabytes (38 GiB at σ = 1e-3); such events are accounted by RDP, a cheap upper bound.
MIN_NOISE_SIGMA_FOR_PLD = 0.3


def check_accountant(accountant: str) -> None:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}: use 'pld' (tight) or 'rdp'")


def check_delta(delta: float, num_examples: int | None = None, option: str = "delta") -> float:
    """δ of a guarantee (``option``: the name the caller gave it): in (0, 1), and for a private data set
    of ``num_examples`` N examples, below 1/N: a δ of 1/N allows leaking whole examples."""
    fraction(option, delta)
    if num_examples is not None and delta >= 1 / num_examples:
        raise SettingsRefused(
            f"{option}={delta:.3g} is not below 1/N = {1 / num_examples:.3g} for N = {num_examples} "
            "examples: such a δ allows leaking whole examples; use δ ≪ 1/N, e.g. "
            f"{1 / num_examples ** 1.1:.2g}")
    return float(delta)


def combined_gaussian(events: list[dpa.DpEvent]) -> dpa.DpEvent:
    """The single Gaussian event exactly equivalent to a composition of Gaussian events on one batch."""
    if len(events) == 1:
        return events[0]
    if not all(isinstance(e, dpa.GaussianDpEvent) for e in events):
        raise ValueError(
            "only Gaussian releases can share one sampled batch in the accountant (their composition is "
            f"exactly one Gaussian); draw a separate batch for the other releases (got {events})")
    if any(e.noise_multiplier == 0 for e in events):
        return dpa.GaussianDpEvent(0.0)
    return dpa.GaussianDpEvent(sum(e.noise_multiplier ** -2 for e in events) ** -0.5)


def accountable(event: dpa.DpEvent) -> dpa.DpEvent:
    """Rewrite ``event`` into the exactly equivalent form dp_accounting's accountants accept."""
    if isinstance(event, dpa.PoissonSampledDpEvent):
        inner = event.event
        if isinstance(inner, dpa.ComposedDpEvent):
            inner = combined_gaussian(list(inner.events))
        return dpa.PoissonSampledDpEvent(event.sampling_probability, inner)
    if isinstance(event, dpa.ComposedDpEvent):
        return dpa.ComposedDpEvent([accountable(e) for e in event.events])
    if isinstance(event, dpa.SelfComposedDpEvent):
        return dpa.SelfComposedDpEvent(accountable(event.event), event.count)
    return event


def _is_non_private(event: dpa.DpEvent) -> bool:
    if isinstance(event, dpa.GaussianDpEvent):
        return event.noise_multiplier == 0
    if isinstance(event, dpa.LaplaceDpEvent):
        return event.noise_multiplier == 0
    if isinstance(event, dpa.NonPrivateDpEvent):
        return True
    if isinstance(event, dpa.PoissonSampledDpEvent):
        return event.sampling_probability > 0 and _is_non_private(event.event)
    if isinstance(event, (dpa.SelfComposedDpEvent,)):
        return event.count > 0 and _is_non_private(event.event)
    if isinstance(event, dpa.ComposedDpEvent):
        return any(_is_non_private(e) for e in event.events)
    return False


def _smallest_noise(event: dpa.DpEvent) -> float:
    """The smallest Gaussian noise multiplier anywhere in an accountable event (∞ if none)."""
    if isinstance(event, dpa.GaussianDpEvent):
        return event.noise_multiplier
    if isinstance(event, (dpa.PoissonSampledDpEvent, dpa.SelfComposedDpEvent)):
        return _smallest_noise(event.event)
    if isinstance(event, dpa.ComposedDpEvent):
        return min((_smallest_noise(e) for e in event.events), default=math.inf)
    return math.inf


def is_threshold(event: dpa.DpEvent) -> bool:
    """A (0, p) release: a non-private event Poisson-sampled with probability p (what a partition
    selection costs beyond its Gaussian part, ``privacy.mechanisms.threshold_event``)."""
    return (isinstance(event, dpa.PoissonSampledDpEvent)
            and isinstance(event.event, dpa.NonPrivateDpEvent))


def split_threshold_delta(event: dpa.DpEvent) -> tuple[dpa.DpEvent, float]:
    """``event`` without its top-level (0, p) releases, and the sum of their p: by composition (ε, δ)
    of the rest at δ − Σp is (ε, δ) of the whole. A (0, p) release nested inside a sampled event stays
    (and makes ε infinite)."""
    if is_threshold(event):
        return dpa.ComposedDpEvent([]), event.sampling_probability
    if isinstance(event, dpa.SelfComposedDpEvent):
        rest, delta = split_threshold_delta(event.event)
        return dpa.SelfComposedDpEvent(rest, event.count), delta * event.count
    if isinstance(event, dpa.ComposedDpEvent):
        parts, total = [], 0.0
        for part in event.events:
            rest, delta = split_threshold_delta(part)
            parts.append(rest)
            total += delta
        return dpa.ComposedDpEvent(parts), total
    return event, 0.0


def epsilon_of(event: dpa.DpEvent, delta: float, accountant: str = "pld",
               discretization: float = REPORT_DISCRETIZATION) -> float:
    """ε at ``delta`` of everything ``event`` released (∞ if anything was released without noise).
    With the PLD accountant, an event with a noise multiplier below ``MIN_NOISE_SIGMA_FOR_PLD`` is
    accounted by RDP instead: an upper bound, in bounded time and memory. (0, p) releases (partition
    selection's threshold) take p off δ; ∞ if they take all of it."""
    check_accountant(accountant)
    check_delta(delta)
    event, threshold_delta = split_threshold_delta(accountable(event))
    if threshold_delta >= delta:
        return math.inf
    delta -= threshold_delta
    if _is_non_private(event):
        return math.inf
    if accountant == "pld" and _smallest_noise(event) >= MIN_NOISE_SIGMA_FOR_PLD:
        pld = _gaussian_pld(event, discretization)
        if pld is not None:
            return float(pld.get_epsilon_for_delta(delta))
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=discretization)
    else:
        acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def _gaussian_pld(event: dpa.DpEvent, discretization: float):
    """The PLD that ``dp_accounting``'s PLD accountant builds for ``event`` — the same calls in the same
    order, so the same ε to the last bit (tested) — when ``event`` is made of Gaussian and Poisson-sampled
    Gaussian releases; ``None`` for any other event. The PLD of one release is built once per (σ, q,
    grid) and kept: a run's ε is asked for again and again as its ledger grows."""
    releases = _gaussian_releases(event, 1)
    if releases is None:
        return None
    pld = privacy_loss_distribution.identity(value_discretization_interval=discretization)
    for release, count in releases:
        if isinstance(release, dpa.GaussianDpEvent):
            part = _release_pld(release.noise_multiplier / math.sqrt(count), 1.0, discretization)
        else:
            part = _release_pld(release.event.noise_multiplier, release.sampling_probability,
                                discretization).self_compose(count)
        pld = pld.compose(part)
    return pld


def _gaussian_releases(event: dpa.DpEvent, count: int) -> list[tuple[dpa.DpEvent, int]] | None:
    """The releases of ``event`` with their counts, in the PLD accountant's order; ``None`` unless each
    is a Gaussian or a Poisson-sampled Gaussian release (zero noise is handled before: ε = ∞)."""
    if isinstance(event, dpa.SelfComposedDpEvent):
        return _gaussian_releases(event.event, event.count * count)
    if isinstance(event, dpa.ComposedDpEvent):
        releases: list[tuple[dpa.DpEvent, int]] = []
        for part in event.events:
            found = _gaussian_releases(part, count)
            if found is None:
                return None
            releases += found
        return releases
    if isinstance(event, dpa.GaussianDpEvent):
        return [(event, count)]
    if isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(event.event, dpa.GaussianDpEvent):
        return [] if event.sampling_probability == 0 else [(event, count)]
    return None


@functools.lru_cache(maxsize=4)
def _release_pld(noise_multiplier: float, sampling_probability: float, discretization: float):
    """The PLD of one (Poisson-sampled) Gaussian release, as the PLD accountant builds it."""
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, value_discretization_interval=discretization,
        sampling_prob=sampling_probability)


def planned_event(noise_multiplier: float, sample_rate: float, steps: int) -> dpa.DpEvent:
    """The ledger of a plain DP-SGD run: ``steps`` Poisson-sampled Gaussian releases."""
    step = dpa.PoissonSampledDpEvent(sample_rate, dpa.GaussianDpEvent(noise_multiplier))
    return dpa.SelfComposedDpEvent(step, steps)
