"""The budget of a command-line run and the private releases its preprocessing makes before training.

Preprocessing reads the training rows in a few places — the class labels, the category sets of text
columns, the scaling of numeric columns, the length of texts. Each such value is either declared public
by the user (``--labels``, ``--schema``, ``--max-length``) or released by a mechanism of
``tunefree.privacy`` whose noise is set by a share of the budget.

**Shares are of μ².** A Gaussian release of noise multiplier σ is μ-GDP with μ = 1/σ, and Gaussian
releases compose by adding μ²: the run's budget (ε, δ) is, in that currency, the μ of one Gaussian
release that spends exactly (ε, δ) (:meth:`Budget.mu`), and a release with ``share`` f gets
μ_f = √f·μ. What the shares cost training is then plain: releases taking f of μ² in all leave training
about √(1 − f) of its μ. The releases' events are ``make_private``'s ``prior_releases``: the run's
ledger holds them before the first step, and the training noise is calibrated on their exact composition
with the planned steps, so the reported ε — the ledger's — is the target (within the calibration's 1%).

**Partition selection** (labels, category sets): each count gets Gaussian noise and a value is kept when
its noisy count reaches τ = 1 + s·Φ⁻¹(1 − p/k), s the noise of one count, k the histograms and p
(``THRESHOLD_DELTA_SHARE`` of δ) the chance that a value only one row has is kept. τ depends on the share
and on δ only, never on N: with ε = 3 and the default δ = 1/N^1.1, a label held by 50 training rows and a
category value held by 100 are kept with probability at least 0.99 for every N up to 10⁶
(``tests/cli/test_cli_selection.py`` computes it). Labels are one selection (k = 1, ``LABEL_SHARE``); the
text columns another, over their k histograms, with ``CATEGORY_SHARE`` per column (up to
``CATEGORY_SHARE_CAP`` in all), so that one count's noise does not grow with k.

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

from ..privacy import (
    epsilon_of,
    gaussian_noise_multiplier,
    release_quantile,
    select_partitions,
    side_randomness,
)
from .split import cell_text

# Shares of the budget's μ² (module docstring), the smallest that keep a label of 50 training rows and a
# category value of 100 with probability 0.99 at ε = 3 for N up to 10⁶, and that standardise one numeric
# column from 100 rows (benchmarks/RESULTS.md §15 weighs them against training's share).
LABEL_SHARE = 0.07  # the class labels: one partition selection
CATEGORY_SHARE = 0.02  # each text column's category set, in one partition selection over the columns
CATEGORY_SHARE_CAP = 0.24  # the category sets in all (12 columns; more share it)
THRESHOLD_DELTA_SHARE = 0.05  # of δ, for each selection: the chance that a value one row has is kept
LENGTH_SHARE = 0.05  # the token length of texts, when --max-length is not given
LENGTH_QUANTILE = 0.95  # the share of training texts that fit in the released length
OTHER = "(other)"  # the category (and class) of every value not selected
SELECTION_STREAM, CATEGORY_STREAM, LENGTH_STREAM = 0x5E1EC7, 0xCA7E60, 0x1E9678


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

    @property
    def mu(self) -> float:
        """The budget as μ: that of one Gaussian release (μ-GDP) spending exactly (ε, δ); ∞ without
        privacy."""
        return 1 / gaussian_noise_multiplier(epsilon=self.epsilon, delta=self.delta) if self.private \
            else math.inf

    def noise(self, share: float, releases: int = 1) -> float:
        """σ of each of ``releases`` Gaussian releases that together take ``share`` of the budget's μ²
        (each μ = √(share/releases)·μ of the budget); 0 in a non-private run."""
        if not self.private:
            return 0.0
        return 1 / (math.sqrt(share / releases) * self.mu)

    def threshold_delta(self) -> float:
        """p of one partition selection: the chance that it keeps a value only one row has."""
        return THRESHOLD_DELTA_SHARE * self.delta


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


def select_sets(columns: Mapping[str, Sequence[Any]], budget: Budget, seed: int | None,
                share: float = LABEL_SHARE, name: str = "class labels", stream: int = SELECTION_STREAM
                ) -> tuple[dict[str, list[str]], Release]:
    """The values of each column (training rows only) that enough rows share, selected privately in one
    partition selection over the columns (each row adds one count to each: L2 sensitivity √k) taking
    ``share`` of the budget; in a non-private run, every value two rows share. The release reports the
    noisy count of each value kept and, by post-processing with the public N, about how many rows are
    ``(other)`` (the values not kept are not named: that would release them)."""
    threshold_delta = budget.threshold_delta()
    sigma = budget.noise(share)
    histograms = [histogram(values) for values in columns.values()]
    kept, threshold, event = select_partitions(histograms, sigma, threshold_delta,
                                               side_randomness(seed, stream))
    if not budget.private:  # exact: a value only one row has is no category (an identifier, a typo)
        kept = [{key: count for key, count in counts.items() if count >= 2} for counts in kept]
        threshold = 2.0
    rows = len(next(iter(columns.values()))) if columns else 0
    sets = {column: list(counts) for column, counts in zip(columns, kept)}
    release = Release(name, share, sigma, (event,),
                      {"columns": list(columns), "threshold": threshold, "threshold_delta": threshold_delta,
                       "count_noise": sigma * math.sqrt(len(columns)), "selected": sets,
                       "noisy_counts": {column: {key: round(count, 1) for key, count in counts.items()}
                                        for column, counts in zip(columns, kept)},
                       "other_rows": {column: max(0, round(rows - sum(counts.values())))
                                      for column, counts in zip(columns, kept)}})
    return sets, release


def category_share(columns: int) -> float:
    """The share of the category sets of ``columns`` text columns: ``CATEGORY_SHARE`` each, at most
    ``CATEGORY_SHARE_CAP`` (public: the number of columns)."""
    return min(CATEGORY_SHARE * columns, CATEGORY_SHARE_CAP)


def select_categories(columns: Mapping[str, Sequence[Any]], budget: Budget, seed: int | None
                      ) -> tuple[dict[str, list[str]], Release]:
    """The category sets of text columns no schema declares, in one partition selection
    (:func:`select_sets`) with ``CATEGORY_SHARE`` per column: one count's noise is the same for any
    number of columns up to the cap."""
    return select_sets(columns, budget, seed, category_share(len(columns)), "category sets", CATEGORY_STREAM)


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
