"""The releases of a data set (privacy/statistics.py, public in tunefree.privacy): partition selection
(category sets, class labels) and a histogram quantile (text lengths), their noise scales and their
accounting."""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
import torch
from scipy.stats import norm

from tunefree.privacy import (
    release_quantile,
    select_partitions,
    selection_threshold,
    threshold_event,
)
from tunefree.privacy.accounting import epsilon_of
from tunefree.privacy.ledger import Ledger
from tunefree.privacy.randomness import SeededSource


class ConstantNoise:
    """Every normal draw is ``value``: the noise added is ``value`` times its scale."""

    def __init__(self, value: float = 1.0):
        self.value = value

    def normal(self, shape, device, dtype):
        return torch.full(shape, self.value, device=device, dtype=dtype)


def test_the_threshold_releases_a_key_one_example_brings_with_probability_p_over_k():
    sigma, k, p = 2.0, 3, 1e-6
    tau = selection_threshold(sigma, k, p)
    assert tau == pytest.approx(1 + sigma * math.sqrt(k) * norm.isf(p / k))
    assert norm.sf((tau - 1) / (sigma * math.sqrt(k))) == pytest.approx(p / k, rel=1e-9)


def test_partition_selection_adds_noise_of_deviation_sigma_root_k_to_every_count():
    sigma, p = 2.0, 1e-3
    tau = selection_threshold(sigma, 2, p)
    shift = sigma * math.sqrt(2)  # every draw 1: each count gets exactly its noise deviation
    histograms = [{"a": math.ceil(tau - shift), "b": math.ceil(tau - shift) - 1},
                  {"x": 5, "y": math.ceil(tau - shift) + 3}]
    selected, threshold, event = select_partitions(histograms, sigma, p, ConstantNoise())
    assert threshold == tau and [list(s) for s in selected] == [["a"], ["y"]]
    assert selected[1]["y"] == histograms[1]["y"] + shift  # the noisy counts of the released keys
    assert event == threshold_event(sigma, p)
    # with σ = 0 the selection is exact: every key seen, whatever its count
    assert select_partitions(histograms, 0.0, p, ConstantNoise())[0] == [dict(h) for h in histograms]


def test_partition_selection_noise_has_the_stated_scale():
    """P(a count c is released) = Φ̄((τ − c)/(σ√k)): measured at c = 1 (a key one example brings: p/k),
    c = τ (½) and c = τ − σ√k (Φ̄(1)), 6,000 keys each."""
    sigma, k, p = 1.0, 2, 0.2
    tau = selection_threshold(sigma, k, p)
    std = sigma * math.sqrt(k)
    for count, expected in ((1, p / k), (tau, 0.5), (tau - std, norm.sf(1.0))):
        histograms = [{i: count for i in range(3000)} for _ in range(k)]
        selected, _, _ = select_partitions(histograms, sigma, p, SeededSource(int(count * 10)))
        share = sum(map(len, selected)) / 6000
        assert abs(share - expected) < 4 * math.sqrt(expected * (1 - expected) / 6000), (count, share)


def test_a_partition_selection_is_accounted_as_its_gaussian_at_delta_minus_p():
    sigma, p, delta = 3.0, 1e-6, 1e-5
    event = threshold_event(sigma, p)
    assert epsilon_of(event, delta) == epsilon_of(dpa.GaussianDpEvent(sigma), delta - p)
    assert epsilon_of(event, p) == math.inf  # the threshold's p takes all of δ
    ledger = Ledger()
    ledger.record(event)
    ledger.record(dpa.GaussianDpEvent(2.0))
    copy = Ledger()
    copy.load_state_dict(ledger.state_dict())
    both = dpa.ComposedDpEvent([dpa.GaussianDpEvent(sigma), dpa.GaussianDpEvent(2.0)])
    assert copy.epsilon(delta) == ledger.epsilon(delta) == epsilon_of(both, delta - p)
    nested = dpa.PoissonSampledDpEvent(0.5, event)  # a threshold inside a sampled event is not taken off
    with pytest.raises(ValueError, match="only Gaussian releases can share one sampled batch"):
        epsilon_of(nested, delta)


def test_quantile_noise_is_one_gaussian_per_bin_and_the_answer_an_edge():
    lengths = torch.tensor([3.0] * 10 + [12.0] * 60 + [40.0] * 25 + [300.0] * 5)
    edges = [8, 16, 32, 64, 128]
    # exact: 70% of the values are ≤ 16 and 95% are ≤ 64
    assert release_quantile(lengths, edges, 0.7, 0.0, ConstantNoise())[0] == 16
    assert release_quantile(lengths, edges, 0.95, 0.0, ConstantNoise())[0] == 64
    assert release_quantile(lengths, edges, 0.96, 0.0, ConstantNoise())[0] == 128  # none reaches: the last
    # bins (≤8, ≤16, ≤32, ≤64, ≤128, above): 10, 60, 0, 25, 0, 5. Every draw 1 adds σ = 10 to each:
    # cumulative 20, 90, 100, 135, … of a total 160, and 0.7·160 = 112 is first reached at the edge 64
    sigma = 10.0
    value, event = release_quantile(lengths, edges, 0.7, sigma, ConstantNoise())
    assert value == 64
    assert event == dpa.GaussianDpEvent(sigma)
    # draws −1: cumulative 0, 50, … of a total 40; 0.7·40 = 28 is reached at the edge 16
    assert release_quantile(lengths, edges, 0.7, sigma, ConstantNoise(-1.0))[0] == 16


def test_quantile_noise_has_the_stated_scale():
    """With one edge, the answer is that edge iff the noisy count below it reaches q of the noisy total;
    at c values below and none above, q = ½: released iff c + Z₁ ≥ (c + Z₁ + Z₂)/2, i.e. Z₁ − Z₂ ≥ −c:
    probability Φ(c/(σ√2))."""
    sigma, c = 3.0, 2
    values = torch.zeros(c)
    hits = sum(release_quantile(values, [1.0, 2.0], 0.5, sigma, SeededSource(i))[0] == 1.0
               for i in range(4000))
    expected = norm.cdf(c / (sigma * math.sqrt(2)))
    assert abs(hits / 4000 - expected) < 4 * math.sqrt(expected * (1 - expected) / 4000)


@pytest.mark.parametrize("call, match", [
    (lambda: selection_threshold(1.0, 0, 1e-6), "at least one histogram"),
    (lambda: selection_threshold(1.0, 1, 0.0), r"threshold_delta must be in \(0, 1\)"),
    (lambda: selection_threshold(-1.0, 1, 1e-6), "noise_multiplier must be a finite number"),
    (lambda: release_quantile(torch.zeros(3), [2, 1], 0.5, 1.0, ConstantNoise()), "increasing"),
    (lambda: release_quantile(torch.zeros(3), [1, 2], 0.0, 1.0, ConstantNoise()), r"quantile must be in"),
])
def test_bad_arguments_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_audit_curve_of_a_partition_selection_adds_its_p_to_every_delta():
    from tunefree.audit.fdp import curve_of

    sigma, p = 2.0, 1e-4
    gaussian, selection = curve_of(dpa.GaussianDpEvent(sigma)), curve_of(threshold_event(sigma, p))
    assert selection.epsilons.tolist() == gaussian.epsilons.tolist()
    assert selection.deltas == pytest.approx(gaussian.deltas + p, abs=1e-15)
