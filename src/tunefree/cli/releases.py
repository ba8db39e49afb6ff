"""The budget of a command-line run and the private releases its preprocessing makes before training.

Preprocessing reads the training rows in a few places — the category sets of text columns, the set of
class labels, the scaling of numeric columns, the length of texts. Each such value is either declared
public by the user (``--schema``, ``--labels``, ``--max-length``) or released by a mechanism of
``privacy/mechanisms.py`` whose noise is set by a fixed share of the budget: σ is that of a release
spending ``share``·ε at ``share``·δ alone. The releases' events are ``make_private``'s ``prior_releases``:
the run's ledger holds them before the first step, and the training noise is calibrated on their exact
composition with the planned steps, so the reported ε — the ledger's — is the target (within the
calibration's 1%), not the sum of the shares' ε.

With ``--epsilon inf`` (a non-private reference run) every release is exact (σ = 0) and the ledger says
ε = ∞.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dp_accounting as dpa
import torch

from ..privacy import epsilon_of, release_quantile, select_partitions, side_randomness
from ..privacy import noise_multiplier as calibrated_noise
from .split import cell_text

SELECTION_SHARE = 0.05  # category sets and class labels, one partition selection over all of them
THRESHOLD_SHARE = 0.5  # of the selection's δ: the chance that a value one row has clears the threshold
LENGTH_SHARE = 0.05  # the token length of texts, when --max-length is not given
LENGTH_QUANTILE = 0.95  # the share of training texts that fit in the released length
OTHER = "(other)"  # the category (and class) of every value not selected
SELECTION_STREAM, LENGTH_STREAM = 0x5E1EC7, 0x1E9678


def default_delta(num_examples: int) -> float:
    return 1.0 / num_examples ** 1.1


def delta_choice(delta: float | None, num_examples: int) -> tuple[float, str]:
    """δ of the run and how it was chosen, as the output states it."""
    if delta is not None:
        return delta, f"δ = {delta:.3g}, given by --delta"
    value = default_delta(num_examples)
    return value, (f"δ = 1/N^1.1 = {value:.3g} for N = {num_examples} training examples, the default "
                   f"(below 1/N = {1 / num_examples:.3g}, as a guarantee needs; --delta sets it)")


@dataclass(frozen=True)
class Budget:
    """The run's (ε, δ); ``epsilon`` = ∞ is a non-private reference run."""

    epsilon: float
    delta: float
    accountant: str = "pld"

    @property
    def private(self) -> bool:
        return math.isfinite(self.epsilon)

    def noise(self, share: float, releases: int = 1, delta_share: float = 1.0) -> float:
        """σ of each of ``releases`` Gaussian releases that together spend ``share``·ε at
        ``share``·``delta_share``·δ; 0 in a non-private run."""
        if not self.private:
            return 0.0
        return calibrated_noise(target_epsilon=share * self.epsilon, sample_rate=1.0, steps=releases,
                                delta=share * delta_share * self.delta, accountant=self.accountant)


@dataclass(frozen=True)
class Release:
    """One preprocessing release: what it released and what it cost (``events`` go into the ledger)."""

    name: str
    share: float
    noise_multiplier: float
    events: tuple[dpa.DpEvent, ...]
    released: Mapping[str, Any] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        """The release as ``report.json`` lists it."""
        return {"release": self.name, "share": self.share, "noise_multiplier": self.noise_multiplier,
                **self.released}


def prior_releases(releases: Iterable[Release]) -> list[dpa.DpEvent]:
    """Every event of the preprocessing releases, in order: ``make_private``'s ``prior_releases``."""
    return [event for release in releases for event in release.events]


def preprocessing_epsilon(releases: Sequence[Release], delta: float, accountant: str) -> float:
    """ε at ``delta`` of the preprocessing releases alone, from the accountant (0 without any); the
    run's ε composes them with training."""
    events = prior_releases(releases)
    return epsilon_of(dpa.ComposedDpEvent(events), delta, accountant) if events else 0.0


def natural_order(values: Iterable[Any]) -> list[Any]:
    """Values sorted as numbers when they all are, else as text: a public order for a released set."""
    values = list(values)
    try:
        return sorted(values, key=lambda v: float(v))
    except (TypeError, ValueError):
        return sorted(values, key=cell_text)


def histogram(values: Iterable[Any]) -> dict[str, int]:
    """Counts of each value, keyed by its text (so 1, 1.0 and "1" are one value), in a public order."""
    counts = Counter(cell_text(v) for v in values)
    return {key: counts[key] for key in natural_order(counts)}


def select_sets(columns: Mapping[str, Sequence[Any]], budget: Budget, seed: int | None
                ) -> tuple[dict[str, list[str]], Release]:
    """The values of each column (training rows only) that enough rows share, selected privately in one
    partition selection over all the columns (each row adds one count to each: L2 sensitivity √k); in
    a non-private run, every value two rows share."""
    threshold_delta = SELECTION_SHARE * THRESHOLD_SHARE * budget.delta
    sigma = budget.noise(SELECTION_SHARE, delta_share=1 - THRESHOLD_SHARE)
    histograms = [histogram(values) for values in columns.values()]
    selected, threshold, event = select_partitions(histograms, sigma, threshold_delta,
                                                   side_randomness(seed, SELECTION_STREAM))
    if not budget.private:  # exact: a value only one row has is no category (an identifier, a typo)
        selected = [[key for key in keys if h[key] >= 2] for h, keys in zip(histograms, selected)]
        threshold = 2.0
    sets = dict(zip(columns, selected))
    release = Release("category and label sets", SELECTION_SHARE, sigma, (event,),
                      {"columns": list(columns), "threshold": threshold, "threshold_delta": threshold_delta,
                       "selected": sets})
    return sets, release


def private_length(lengths: torch.Tensor, edges: Sequence[int], budget: Budget, seed: int | None
                   ) -> tuple[int, Release]:
    """The smallest of ``edges`` that holds ``LENGTH_QUANTILE`` of the training texts' token lengths,
    by a private quantile (one Gaussian histogram release, sensitivity 1)."""
    sigma = budget.noise(LENGTH_SHARE)
    value, event = release_quantile(lengths, edges, LENGTH_QUANTILE, sigma,
                                    side_randomness(seed, LENGTH_STREAM))
    length = int(value)
    return length, Release("text length", LENGTH_SHARE, sigma, (event,),
                           {"quantile": LENGTH_QUANTILE, "edges": list(edges), "length": length})
