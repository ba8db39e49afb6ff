"""Standardising numeric table columns by a private estimate, accounted in the run's ledger.

A column's scale and centre computed from the private training rows would be a release, so they are
estimated with the Gaussian mechanism, in two releases over the d columns to standardise:

1. the magnitude: per column, a histogram of ⌈log₂|x|⌉ (bins 2^-20 … 2^40); one example adds one count
   to one bin of each column, so the release has L2 sensitivity √d and gets noise σ·√d. The bound
   Bⱼ = 2^k of the largest bin whose noisy count stands clear of the noise (> 4σ√d), or twice the
   noisy mode if none does (a small table);
2. the moments: uⱼ = clip(xⱼ/Bⱼ, −1, 1); Σuⱼ and Σuⱼ² over the rows, L2 sensitivity √(2d), noise σ·√(2d).
   The variance is never taken below twice the standard deviation of its own noise (public: σ√(2d)/N
   per moment): a column whose spread the noise hides is scaled as if it had that spread, not divided by
   a noisy number near zero (which blew such columns up to hundreds: RESULTS §5e).

Each release is a Gaussian mechanism of noise multiplier σ: two ``GaussianDpEvent(σ)`` go into the ledger
before the first training step. The two take ``SHARE`` of the budget's μ² (``releases.py``), the smallest
share with which one numeric column is standardised from 100 training rows at ε = 3 and the default δ
(:func:`minimum_rows`; a table with too few rows for that takes up to ``SHARE_CAP``,
:func:`share_for_table`), and the training noise is calibrated on the exact composition of every
preprocessing release with the planned steps: the whole run is (ε, δ)-DP, and the ledger reports what it
spent. The number of training rows N is public, as it is for the sampling rate. σ = 0 (``--epsilon
inf``) is the exact scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import dp_accounting as dpa
import torch

from ..privacy import NoiseSource, release_gaussian, side_randomness
from .releases import Budget, Release

STANDARDISATION_STREAM = 0x5CA1E

SHARE = 0.04  # the share of the budget's μ² of the two releases (releases.py)
SHARE_CAP = 0.40  # the most a small table with many columns takes rather than be refused (RESULTS §15f)
LOG2_RANGE = (-20, 40)  # magnitude bins: |x| ≤ 2^-20, (2^-20, 2^-19], …, (2^39, 2^40] and beyond
CLEAR_OF_NOISE = 4.0  # a bin "holds data" when its noisy count exceeds this many noise deviations
MIN_STD = 1e-3  # the smallest standard deviation (of x/B) divided by: a constant column stays bounded
RELEASES = 2


def noise_for_share(budget: Budget, share: float = SHARE) -> float:
    """σ of each of the two releases, so that together they take ``share`` of the budget's μ² (0 in a
    non-private run)."""
    return budget.noise(share, RELEASES)


def share_for_table(budget: Budget, rows: int, columns: int) -> float:
    """The share of the budget's μ² that the two releases take for a table of ``rows`` training rows and
    ``columns`` columns to standardise (both public): ``SHARE``, or, where that leaves too few rows
    (:func:`minimum_rows`), the least share up to ``SHARE_CAP`` with which the rows suffice — a small
    table with many columns pays more of its budget rather than be refused. The training noise is
    calibrated on the releases' events, whatever the share."""
    if not budget.private:
        return SHARE
    largest = rows / (4 * CLEAR_OF_NOISE * math.sqrt(columns)) * (1 - 1e-9)  # the largest σ that suffices
    if noise_for_share(budget) <= largest:
        return SHARE
    return SHARE_CAP if largest <= 0 else min(RELEASES / (largest * budget.mu) ** 2, SHARE_CAP)


@dataclass(frozen=True)
class Standardisation:
    """The released scaling of some feature columns: x ↦ (clip(x/B, −1, 1) − mean)/std. Everything here is
    a differentially private output (post-processing of the two noisy releases)."""

    columns: tuple[int, ...]
    bound: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    noise_multiplier: float

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the standardised columns replaced (a new tensor)."""
        out = x.clone()
        u = torch.clamp(x[:, list(self.columns)] / self.bound, -1.0, 1.0)
        out[:, list(self.columns)] = ((u - self.mean) / self.std).to(x.dtype)
        return out

    def events(self) -> list[dpa.DpEvent]:
        """What the ledger must record for the two releases."""
        return [dpa.GaussianDpEvent(self.noise_multiplier)] * RELEASES

    def to_dict(self) -> dict[str, list]:
        """The released scaling as JSON (saved with the model, so that new rows are scaled alike)."""
        return {"columns": list(self.columns), "bound": self.bound.tolist(), "mean": self.mean.tolist(),
                "std": self.std.tolist()}

    @classmethod
    def from_dict(cls, raw: dict[str, list], noise_multiplier: float = math.nan) -> Standardisation:
        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float64)

        return cls(tuple(raw["columns"]), tensor(raw["bound"]), tensor(raw["mean"]), tensor(raw["std"]),
                   noise_multiplier)


def minimum_rows(columns: int, noise_multiplier: float) -> int:
    """The fewest training rows with which a bin holding a quarter of them stands clear of the noise: below
    it the release could not tell the columns' magnitude, whatever the data (a rule on public numbers)."""
    return math.ceil(4 * CLEAR_OF_NOISE * noise_multiplier * math.sqrt(columns))


def check_enough_rows(rows: int, columns: int, noise_multiplier: float, epsilon: float) -> None:
    """Refuse, before any release, a table too small for the private standardisation to say anything."""
    needed = minimum_rows(columns, noise_multiplier)
    if rows < needed:
        raise ValueError(
            f"{rows} training rows are too few to standardise {columns} numeric column(s) privately at "
            f"ε = {epsilon:g} (it needs {needed}, with {SHARE_CAP:.0%} of the budget for it): declare their "
            "ranges in --schema (public, free), or pass --numeric-scaling none to feed them to the model as "
            "they are")


def _magnitude_bins(x: torch.Tensor) -> torch.Tensor:
    low, high = LOG2_RANGE
    magnitude = x.abs().clamp_min(2.0 ** (low - 1))
    return torch.ceil(torch.log2(magnitude)).clamp(low, high).long() - low


def release(x: torch.Tensor, columns: list[int] | tuple[int, ...], noise_multiplier: float,
            randomness: NoiseSource) -> Standardisation:
    """Privately estimate the scaling of ``columns`` of the training features ``x`` (rows are examples)."""
    if not columns:
        raise ValueError("no columns to standardise")
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"σ must be a finite number ≥ 0 (0: the exact, non-private scaling), got "
                         f"{noise_multiplier}")
    values = x[:, list(columns)].to(torch.float64)
    rows, d = values.shape
    bins = LOG2_RANGE[1] - LOG2_RANGE[0] + 1
    histogram = torch.zeros(d, bins, dtype=torch.float64)
    histogram.scatter_add_(1, _magnitude_bins(values).T, torch.ones(d, rows, dtype=torch.float64))
    noise = noise_multiplier * math.sqrt(d)  # each example adds 1 to one bin of each of the d columns
    histogram = _released(histogram, math.sqrt(d), noise_multiplier, randomness)
    exponents = []
    for counts in histogram:
        clear = torch.nonzero(counts > CLEAR_OF_NOISE * noise).flatten()
        top = int(clear[-1]) if len(clear) else min(int(counts.argmax()) + 1, bins - 1)
        exponents.append(top + LOG2_RANGE[0])
    bound = torch.tensor([2.0 ** k for k in exponents], dtype=torch.float64)

    u = torch.clamp(values / bound, -1.0, 1.0)
    sums = torch.cat([u.sum(0), (u * u).sum(0)])
    sums = _released(sums, math.sqrt(2 * d), noise_multiplier, randomness)  # |u|, u² ≤ 1
    mean = (sums[:d] / rows).clamp(-1.0, 1.0)
    variance = sums[d:] / rows - mean ** 2
    std = torch.maximum(variance, variance_noise_floor(mean, noise_multiplier, d, rows)).sqrt()
    return Standardisation(tuple(columns), bound, mean, std, noise_multiplier)


def _released(values: torch.Tensor, sensitivity: float, noise_multiplier: float,
              randomness: NoiseSource) -> torch.Tensor:
    """The Gaussian release of ``values``; the values themselves in a non-private run (σ = 0)."""
    if noise_multiplier == 0:
        return values
    return release_gaussian(values, sensitivity, noise_multiplier, randomness)[0]


def variance_noise_floor(mean: torch.Tensor, noise_multiplier: float, columns: int,
                         rows: int) -> torch.Tensor:
    """The smallest variance divided by: twice the noise's standard deviation in the released variance
    E[u²] − mean² (each moment's noise has deviation r = σ√(2d)/N, so the variance's is at most
    r·(1 + 2|mean|)), and never below ``MIN_STD``² (a constant column stays bounded)."""
    resolution = noise_multiplier * math.sqrt(2 * columns) / rows
    return (2 * resolution * (1 + 2 * mean.abs())).clamp_min(MIN_STD ** 2)


def secret_randomness(seed: int | None) -> NoiseSource:
    """The standardisation's own noise source: secure by default; for a seeded run, a stream derived
    from the seed that no other release of the run draws from."""
    return side_randomness(seed, STANDARDISATION_STREAM)


def release_record(released: Standardisation, names: list[str], share: float) -> Release:
    """The standardisation as one preprocessing release of the run (its two events, ``share`` of the
    budget's μ²)."""
    return Release("standardisation", share, released.noise_multiplier, tuple(released.events()),
                   {"columns": [names[i] for i in released.columns]})
