"""What the command line's private preprocessing keeps, computed exactly from the thresholds and noise
its releases use (a kept value's noisy count c + s·Z reaches τ with probability Φ((c − τ)/s)): at ε = 3
and the default δ = 1/N^1.1, for every N up to 10⁶, a label of 50 training rows and a category value of
100 are kept with probability at least 0.99, and numeric columns are standardised from 100 rows each."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from tunefree.cli import releases, scaling
from tunefree.cli.releases import Budget, default_delta

SIZES = sorted({int(n) for n in np.geomspace(10, 10**6, 41)})


def _kept(release: releases.Release, count: int) -> float:
    """The probability that a value of ``count`` training rows is kept by ``release``'s selection."""
    released = release.released
    return float(norm.cdf((count - released["threshold"]) / released["count_noise"]))


@pytest.mark.parametrize("rows", SIZES)
def test_a_label_of_fifty_rows_is_kept_with_probability_099(rows):
    _, release = releases.select_sets({"label": ["a", "b"]}, Budget(3.0, default_delta(rows)), seed=0)
    assert release.released["count_noise"] == release.noise_multiplier  # one histogram: sensitivity 1
    assert _kept(release, 50) >= 0.99


@pytest.mark.parametrize("columns", [1, 2, 4, 8, 12])
@pytest.mark.parametrize("rows", SIZES)
def test_a_category_of_a_hundred_rows_is_kept_with_probability_099(rows, columns):
    table = {f"c{i}": ["a", "b"] for i in range(columns)}
    _, release = releases.select_categories(table, Budget(3.0, default_delta(rows)), seed=0)
    assert release.released["count_noise"] == pytest.approx(release.noise_multiplier * columns ** 0.5)
    assert _kept(release, 100) >= 0.99


def test_the_thresholds_depend_on_the_budget_only_and_grow_as_log_one_over_delta():
    """τ at a fixed δ does not change with N (no share of N); it grows like √log(1/δ) as δ shrinks."""
    budget = Budget(3.0, 1e-6)
    taus = {len(values): releases.select_sets({"label": values}, budget, 0)[1].released["threshold"]
            for values in (["a"] * 10, ["a"] * 10_000)}
    assert taus[10] == taus[10_000]
    wide = releases.select_sets({"label": ["a"]}, Budget(3.0, 1e-12), 0)[1].released["threshold"]
    assert taus[10] < wide < 3 * taus[10]


@pytest.mark.parametrize("columns", [1, 2, 4, 8])
def test_numeric_columns_are_standardised_from_a_hundred_rows_each(columns):
    rows = 100 * columns
    sigma = scaling.noise_for_share(Budget(3.0, default_delta(rows)))
    scaling.check_enough_rows(rows, columns, sigma, 3.0)  # not refused
    assert scaling.minimum_rows(columns, sigma) <= rows


@pytest.mark.parametrize("columns", [1, 4, 16, 30])
def test_a_small_table_takes_up_to_two_fifths_and_then_needs_35_rows_per_root_column(columns):
    rows = math.ceil(35 * math.sqrt(columns))
    budget = Budget(3.0, default_delta(rows))
    sigma = scaling.noise_for_share(budget, scaling.share_for_table(budget, rows, columns))
    scaling.check_enough_rows(rows, columns, sigma, 3.0)  # not refused
    assert scaling.minimum_rows(columns, sigma) <= rows


def test_shares_are_of_mu_squared_and_leave_training_the_rest():
    """Two releases at ``share`` f/2 each have μ² adding to f·μ² of the budget, and the budget's μ is that
    of one Gaussian release spending exactly (ε, δ)."""
    import dp_accounting as dpa

    from tunefree.privacy import epsilon_of

    budget = Budget(3.0, 1e-5, "pld")
    assert epsilon_of(dpa.GaussianDpEvent(1 / budget.mu), 1e-5) == pytest.approx(3.0, rel=1e-3)
    sigma = budget.noise(0.04, releases=2)
    assert 2 * sigma ** -2 == pytest.approx(0.04 * budget.mu ** 2)
    assert Budget(float("inf"), 1e-5).noise(0.5) == 0.0
