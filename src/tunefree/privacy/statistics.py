"""Private statistics of a data set, each released once (before training, for instance): a Gaussian
release of any vector, a partition selection (which keys of histograms to release when the keys come
from the private data: category sets, class labels) and a quantile from a noisy histogram.

Each function adds its noise from a :class:`~tunefree.privacy.NoiseSource` and returns, with the released
value, the ``DpEvent`` it must be accounted as. Pass the events to ``make_private(prior_releases=[...])``:
the run's ledger holds them before its first step, and its training noise is calibrated on their exact
composition with the planned steps, so the whole run spends the target ε. The command line's private
preprocessing (``tunefree train``) is built on them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import dp_accounting as dpa
import torch

from .randomness import NoiseSource

__all__ = ["release_gaussian", "release_quantile", "select_partitions", "selection_threshold",
           "threshold_event"]


def release_gaussian(values: torch.Tensor, sensitivity: float, noise_multiplier: float,
                     randomness: NoiseSource) -> tuple[torch.Tensor, dpa.DpEvent]:
    """Releases ``values`` (float64, CPU), whose L2 sensitivity is ``sensitivity``, with Gaussian noise of
    standard deviation ``noise_multiplier·sensitivity``: one Gaussian event of that multiplier."""
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be a positive finite number, got {noise_multiplier}")
    values = values.to(torch.float64)
    noise = randomness.normal(values.shape, torch.device("cpu"), torch.float64)
    return values + noise_multiplier * sensitivity * noise, dpa.GaussianDpEvent(noise_multiplier)


def threshold_event(noise_multiplier: float, threshold_delta: float) -> dpa.DpEvent:
    """What a partition selection costs: the Gaussian mechanism of multiplier σ on the counts of the keys
    both neighbours have, composed with a (0, ``threshold_delta``) release — the chance that a key only
    the added example has clears the threshold — written as a Poisson-sampled non-private event of that
    probability (exactly (0, p)-DP; the accountant takes p off δ)."""
    return dpa.ComposedDpEvent([dpa.GaussianDpEvent(noise_multiplier),
                                dpa.PoissonSampledDpEvent(threshold_delta, dpa.NonPrivateDpEvent())])


def selection_threshold(noise_multiplier: float, histograms: int, threshold_delta: float) -> float:
    """τ of a partition selection over ``histograms`` histograms (each example adds 1 to one key of each):
    a count of 1 plus noise of deviation σ√k clears τ = 1 + σ√k·Φ⁻¹(1 − p/k) with probability p/k, so the
    k keys a new example can bring are released with probability at most p = ``threshold_delta``."""
    from scipy.stats import norm

    if histograms < 1:
        raise ValueError(f"a partition selection needs at least one histogram, got {histograms}")
    if not 0 < threshold_delta < 1:
        raise ValueError(f"threshold_delta must be in (0, 1), got {threshold_delta}")
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be a finite number ≥ 0, got {noise_multiplier}")
    return 1.0 + noise_multiplier * math.sqrt(histograms) * float(norm.isf(threshold_delta / histograms))


def select_partitions(histograms: Sequence[Mapping[Any, int]], noise_multiplier: float,
                      threshold_delta: float, randomness: NoiseSource
                      ) -> tuple[list[dict[Any, float]], float, dpa.DpEvent]:
    """Differentially private partition selection: which keys of each histogram to release, when the keys
    themselves come from the private data (category sets, class labels).

    Each example adds 1 to one key of each of the k histograms, so the counts of the keys both neighbours
    have move by at most √k in L2: every count gets Gaussian noise of deviation σ√k, and a key is released
    when its noisy count reaches :func:`selection_threshold`. Keys that no example has are never seen, and a
    key only one example has is released with probability at most ``threshold_delta``/k. Returns the
    released keys of each histogram with their noisy counts (in the histogram's order; the noisy counts of
    the released keys are part of the release), τ and the event (:func:`threshold_event`). σ = 0 is the
    exact, non-private selection (every key seen; the event spends ε = ∞)."""
    threshold = selection_threshold(noise_multiplier, len(histograms), threshold_delta)
    keys = [list(histogram) for histogram in histograms]
    counts = torch.tensor([float(h[key]) for h, ks in zip(histograms, keys) for key in ks],
                          dtype=torch.float64)
    if noise_multiplier > 0 and counts.numel():
        std = noise_multiplier * math.sqrt(len(histograms))
        counts = counts + std * randomness.normal(counts.shape, torch.device("cpu"), torch.float64)
    selected, offset = [], 0
    for ks in keys:
        selected.append({key: count for key, count in zip(ks, counts[offset:offset + len(ks)].tolist())
                         if count >= threshold})
        offset += len(ks)
    return selected, threshold, threshold_event(noise_multiplier, threshold_delta)


def release_quantile(values: torch.Tensor, edges: Sequence[float], quantile: float, noise_multiplier: float,
                     randomness: NoiseSource) -> tuple[float, dpa.DpEvent]:
    """A private ``quantile`` of ``values``, rounded up to one of the increasing public ``edges``: the
    histogram of the values over (−∞, e₀], (e₀, e₁], …, (e_{m−1}, ∞) — one example adds 1 to one bin, L2
    sensitivity 1 — released with Gaussian noise of deviation σ; the answer is its post-processing, the
    first edge whose noisy cumulative count reaches ``quantile`` of the noisy total (the last edge if none
    does). σ = 0 is the exact histogram (ε = ∞)."""
    if not edges or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"edges must be a non-empty increasing sequence, got {list(edges)}")
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile must be in (0, 1], got {quantile}")
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be a finite number ≥ 0, got {noise_multiplier}")
    bins = torch.bucketize(values.to(torch.float64).flatten(), torch.tensor(list(edges), dtype=torch.float64))
    histogram = torch.bincount(bins, minlength=len(edges) + 1).to(torch.float64)
    if noise_multiplier > 0:
        histogram = histogram + noise_multiplier * randomness.normal(histogram.shape, torch.device("cpu"),
                                                                     torch.float64)
    cumulative = histogram.cumsum(0)
    reached = torch.nonzero(cumulative[:len(edges)] >= quantile * cumulative[-1]).flatten()
    edge = edges[int(reached[0])] if len(reached) else edges[-1]
    return float(edge), dpa.GaussianDpEvent(noise_multiplier)
