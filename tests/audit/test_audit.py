"""The empirical audit: its statistics are valid, a correct run passes, and broken runs are caught.

The broken mechanisms are built here by patching the library's classes for one audit (never by editing
the library): the audit must see through the real training step what each of them does.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.marks import slow_case
from support.training import train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.audit import (
    AuditSettings,
    Guesses,
    black_box_audit,
    clopper_pearson_epsilon_bound,
    multi_run_audit,
    noise_check,
    one_run_audit,
    one_run_epsilon_bound,
    separation_check,
)
from tunefree.audit.bounds import best_one_run_bound, clopper_pearson_upper
from tunefree.cli.main import main
from tunefree.privacy.mechanisms import GradientRelease
from tunefree.privacy.randomness import SeededSource

# q = 1 isolates the noise; q = ½ lets a broken sampler double it.
FULL_BATCH = dict(canaries=2000, sample_rate=1.0, steps=2, noise_multiplier=2.0, real_examples=64, seed=3)
HALF_BATCH = dict(canaries=1000, sample_rate=0.5, steps=10, noise_multiplier=2.0, real_examples=64, seed=3)


# ---------------------------------------------------------------------------------------- statistics
def test_all_right_guesses_give_the_closed_form_bound_without_delta():
    # δ = 0: P[r of r right] = pʳ, so ε_LB solves pʳ = 1 − confidence with p = eᵉ/(1 + eᵉ)
    for r in (10, 100, 1000):
        p = 0.05 ** (1 / r)
        expected = math.log(p / (1 - p))
        assert one_run_epsilon_bound(Guesses(r, r, r), 0.0, 0.95) == pytest.approx(expected, abs=1e-3)


@pytest.mark.slow
def test_one_run_bound_is_valid_for_randomized_response():
    # ε-DP randomized response on every canary: ε_LB may exceed ε in at most 5% of audits
    rng = np.random.default_rng(0)
    epsilon, m, trials = 1.0, 500, 200
    right = rng.binomial(m, 1 / (1 + math.exp(-epsilon)), size=trials)
    bounds = np.array([one_run_epsilon_bound(Guesses(m, int(v), m), 1e-5, 0.95) for v in right])
    assert (bounds > epsilon).mean() <= 0.08
    assert bounds.mean() > 0.5 * epsilon  # and it is not vacuous


def test_the_delta_term_weakens_the_bound():
    guesses = Guesses(200, 190, 1000)
    assert one_run_epsilon_bound(guesses, 1e-3, 0.95) < one_run_epsilon_bound(guesses, 0.0, 0.95)


def test_best_bound_pays_for_every_guess_size_it_tries():
    rng = np.random.default_rng(1)
    included = rng.random(1000) < 0.5
    scores = included + rng.normal(size=1000)
    one, _ = best_one_run_bound(scores, included, 1e-5, 0.95, sizes=[100])
    many, guesses = best_one_run_bound(scores, included, 1e-5, 0.95, sizes=[100, 100, 100, 100])
    assert guesses.guesses == 200 and many < one


def test_clopper_pearson_upper_bound_of_no_failures():
    assert clopper_pearson_upper(0, 50, 0.95) == pytest.approx(1 - 0.05 ** (1 / 50))
    assert clopper_pearson_upper(50, 50, 0.95) == 1.0


def test_clopper_pearson_epsilon_of_a_perfect_test():
    fpr = 1 - 0.025 ** (1 / 100)
    expected = math.log((1 - 1e-5 - fpr) / fpr)
    assert clopper_pearson_epsilon_bound(0, 100, 0, 100, 1e-5, 0.95) == pytest.approx(expected)
    assert clopper_pearson_epsilon_bound(50, 100, 50, 100, 1e-5, 0.95) == 0.0


def test_checks_find_the_noise_and_the_shift():
    rng = np.random.default_rng(2)
    included = rng.random(4000) < 0.5
    z = rng.normal(size=(5, 4000)) * 1.0 + 0.5 * included
    assert noise_check(z[:, ~included], 0.95).passed
    assert separation_check(z, included, 0.5, 0.95).passed
    assert not noise_check(0.9 * z[:, ~included], 0.95).passed
    check = separation_check(z, included, 0.25, 0.95)
    assert not check.passed and check.ratio == pytest.approx(2.0, rel=0.1)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="exactly one"):
        AuditSettings(noise_multiplier=1.0, target_epsilon=1.0)
    with pytest.raises(ValueError, match="needs noise"):
        AuditSettings(noise_multiplier=0.0)
    with pytest.raises(ValueError, match="denominator"):
        one_run_audit(AuditSettings(noise_multiplier=1.0, sample_rate=1 / math.pi, canaries=4, steps=1))


# ---------------------------------------------------------------------------------------- correct runs
@pytest.mark.slow
@pytest.mark.parametrize("settings", [FULL_BATCH, HALF_BATCH], ids=["q=1", "q=0.5"])
def test_a_correct_run_is_consistent(settings):
    result = one_run_audit(AuditSettings(**settings))
    assert result.epsilon_lower_bound <= result.epsilon
    assert result.epsilon_lower_bound > 0.25 * result.epsilon  # the audit has power
    assert result.verdict == "consistent", result.explain()
    assert result.steps == result.recorded_steps == settings["steps"]


@pytest.mark.parametrize("options", [
    slow_case(dict(clipping="abadi", groups="per-layer", thresholds="adaptive")),
    dict(clipping="psac", groups="per-param"),
], ids=["abadi-per-layer-adaptive", "psac-per-param"])
def test_correct_runs_with_other_components_are_consistent(options):
    result = one_run_audit(AuditSettings(**{**HALF_BATCH, "canaries": 400, **options}))
    assert result.epsilon_lower_bound <= result.epsilon
    assert result.verdict == "consistent", result.explain()


def test_the_claimed_epsilon_is_the_ledgers():
    result = one_run_audit(AuditSettings(**{**HALF_BATCH, "canaries": 100, "steps": 3}))
    assert result.epsilon == pytest.approx(tunefree.epsilon(
        noise_multiplier=2.0, sample_rate=0.5, steps=3, delta=1e-5), rel=1e-9)


# ---------------------------------------------------------------------------------------- broken runs
@pytest.mark.slow
def test_noise_four_times_too_small_breaks_the_lower_bound(monkeypatch):
    original = GradientRelease.noise_stds
    monkeypatch.setattr(GradientRelease, "noise_stds",
                        lambda self, thresholds: [s / 4 for s in original(self, thresholds)])
    result = one_run_audit(AuditSettings(**FULL_BATCH))
    assert result.epsilon_lower_bound > result.epsilon
    assert result.verdict == "violated"
    noise = next(c for c in result.checks if c.name == "noise")
    assert noise.ratio == pytest.approx(0.25, rel=0.05) and not noise.passed


@pytest.mark.slow
def test_a_release_at_twice_its_recorded_sensitivity_is_caught(monkeypatch):
    original = GradientRelease.release
    monkeypatch.setattr(GradientRelease, "release",
                        lambda self, sums, thresholds: original(
                            self, {p: 2 * s for p, s in sums.items()}, thresholds))
    result = one_run_audit(AuditSettings(**HALF_BATCH))
    separation = next(c for c in result.checks if c.name == "separation")
    assert separation.ratio == pytest.approx(2.0, rel=0.15) and not separation.passed
    assert result.verdict == "suspicious"


@pytest.mark.slow
def test_an_extra_unrecorded_release_is_caught(monkeypatch):
    original = GradientRelease.release

    def released_twice(self, sums, thresholds):
        # a release takes its sums over (adds the noise into them): the second one gets its own copy
        first, event = original(self, {p: s.clone() for p, s in sums.items()}, thresholds)
        second, _ = original(self, sums, thresholds)  # released into the update, never recorded
        return {p: (first[p] + second[p]) / 2 for p in first}, event

    monkeypatch.setattr(GradientRelease, "release", released_twice)
    result = one_run_audit(AuditSettings(**HALF_BATCH))
    noise = next(c for c in result.checks if c.name == "noise")
    assert noise.ratio == pytest.approx(1 / math.sqrt(2), rel=0.05) and not noise.passed
    assert result.verdict == "suspicious"


@pytest.mark.slow
def test_sampling_at_twice_the_accounted_rate_is_caught(monkeypatch):
    original = SeededSource.inclusion
    monkeypatch.setattr(SeededSource, "inclusion",
                        lambda self, step, n, rate: original(self, step, n, min(1.0, 2 * rate)))
    result = one_run_audit(AuditSettings(**HALF_BATCH))
    separation = next(c for c in result.checks if c.name == "separation")
    assert separation.ratio == pytest.approx(2.0, rel=0.15) and not separation.passed
    assert result.verdict == "suspicious"


# ---------------------------------------------------------------------------------------- other audits
@pytest.mark.slow
def test_multi_run_audit_of_a_correct_run():
    result = multi_run_audit(AuditSettings(noise_multiplier=2.0, sample_rate=1.0, steps=1,
                                           real_examples=8, seed=0), runs=16)
    assert result.epsilon == pytest.approx(tunefree.epsilon(
        noise_multiplier=2.0, sample_rate=1.0, steps=1, delta=1e-5), rel=1e-9)
    assert 0 <= result.epsilon_lower_bound <= result.epsilon
    assert result.guesses == 8 and result.canaries == 1


def test_multi_run_audit_calibrates_once_for_every_run():
    # the first run calibrates σ for the target; the others reuse it: one ledger, at the target ε
    result = multi_run_audit(AuditSettings(target_epsilon=2.0, sample_rate=1.0, steps=1, real_examples=8,
                                           seed=0), runs=4)
    assert result.epsilon == pytest.approx(2.0, rel=0.011)
    assert 0 <= result.epsilon_lower_bound <= result.epsilon


def _train_digits_like(dataset):
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 2))
    engine = tunefree.make_private(model, torch.optim.Adam(model.parameters(), lr=0.05),
                                   DataLoader(dataset, batch_size=64), target_delta=1e-5,
                                   noise_multiplier=0.8, epochs=3, seed=0)
    train(engine)
    return engine


def _minus_loss(model, canaries):
    x, y = canaries.tensors
    with torch.no_grad():
        return (-F.cross_entropy(model(x), y, reduction="none")).numpy()


@pytest.mark.slow
def test_black_box_audit_is_loose_and_valid():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 10, generator=generator)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    canary_x = torch.randn(200, 10, generator=generator)
    canaries = TensorDataset(canary_x, (canary_x[:, 0] <= 0).long())  # mislabelled
    result = black_box_audit(_train_digits_like, data, canaries, _minus_loss, seed=0)
    assert result.loose and result.kind == "black-box input-canary"
    assert 0 <= result.epsilon_lower_bound <= result.epsilon
    assert result.steps == result.recorded_steps > 0
    with pytest.raises(TypeError, match="DPEngine"):
        black_box_audit(lambda d: _train_digits_like(d).model, data, canaries, _minus_loss, seed=0)


# ---------------------------------------------------------------------------------------- command line
@pytest.mark.slow
@pytest.mark.parametrize("budget", [["--noise-multiplier", "2.0"], ["--target-epsilon", "2"]])
def test_cli_audit_writes_the_json_keys(tmp_path, capsys, budget):
    path = tmp_path / "audit.json"
    status = main(["audit", *budget, "--sample-rate", "0.5", "--steps", "4", "--canaries", "300",
                   "--seed", "0", "--json", str(path)])
    result = json.loads(path.read_text())
    assert {"epsilon", "epsilon_lower_bound", "confidence", "canaries", "verdict"} <= set(result)
    assert result["canaries"] == 300 and result["confidence"] == 0.95
    assert result["epsilon_lower_bound"] <= result["epsilon"]
    assert status == (0 if result["verdict"] == "consistent" else 1)
    out = capsys.readouterr().out
    assert "ε_LB" in out and "verdict" in out
    if budget[0] == "--target-epsilon":
        assert result["epsilon"] == pytest.approx(2.0, rel=0.011)


def test_cli_audit_refuses_a_sampling_rate_it_cannot_realise(capsys):
    status = main(["audit", "--noise-multiplier", "1", "--sample-rate", "0.123456789", "--steps", "1",
                   "--canaries", "10"])
    assert status == 2 and "denominator" in capsys.readouterr().err
