"""The audit hooked into training: make_private(..., audit_canaries=m) and audit_training(engine).

The canaries ride in the run's own gradient release, on coordinates outside the model: a correct run
is consistent, a run whose noise is patched down is caught, and the model, the optimizer and the ledger
are those of a run without canaries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.training import train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.audit import audit_training
from tunefree.privacy.mechanisms import GradientRelease

EXAMPLES, BATCH = 256, 128  # q = ½


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(EXAMPLES, 4, generator=generator)
    return TensorDataset(x, (x[:, 0] > 0).float())


def _train(steps: int, canaries: int | None, seed: int | None = 0, **options) -> tuple[tunefree.DPEngine,
                                                                                      nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(_data(), batch_size=BATCH), target_delta=1e-5,
                                   noise_multiplier=options.pop("noise_multiplier", 2.0), steps=steps,
                                   seed=seed, audit_canaries=canaries, **options)
    train(engine, steps, loss=lambda model, x, y: F.binary_cross_entropy_with_logits(model(x).squeeze(-1), y))
    return engine, model


@pytest.mark.slow
def test_an_audited_correct_run_is_consistent():
    engine, _ = _train(10, 1000, verify_every=5)  # the independence check runs at steps 1, 5 and 10
    result = audit_training(engine)
    assert result.epsilon == pytest.approx(tunefree.epsilon(noise_multiplier=2.0, sample_rate=0.5,
                                                            steps=10, delta=1e-5), rel=1e-9)
    assert 0.25 * result.epsilon < result.epsilon_lower_bound <= result.epsilon
    assert result.fdp_bound >= result.steinke_bound
    assert result.verdict == "consistent", result.explain()
    assert result.steps == result.recorded_steps == 10 and result.canaries == 1000


def test_an_audited_run_with_groups_and_adaptive_thresholds_is_consistent():
    engine, _ = _train(6, 600, clipping="abadi", groups="per-layer", thresholds="adaptive")
    result = audit_training(engine)
    assert result.epsilon_lower_bound <= result.epsilon
    assert result.verdict == "consistent", result.explain()


@pytest.mark.slow
def test_an_audited_run_with_noise_four_times_too_small_is_caught(monkeypatch):
    original = GradientRelease.noise_stds
    monkeypatch.setattr(GradientRelease, "noise_stds",
                        lambda self, thresholds: [s / 4 for s in original(self, thresholds)])
    result = audit_training(_train(10, 1000, seed=None)[0])  # secure randomness: a real run
    assert result.epsilon_lower_bound > result.epsilon
    assert result.verdict == "violated"


def test_canaries_never_reach_the_model_or_the_ledger():
    # one seeded step: the canary block is drawn after the model's noise, so the model's update is
    # bit for bit that of the run without canaries; the ledger is the same
    audited, audited_model = _train(1, 500)
    plain, plain_model = _train(1, None)
    for p, q in zip(audited_model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)
    assert audited.ledger.state_dict() == plain.ledger.state_dict()
    assert list(audited.model.state_dict()) == list(plain.model.state_dict())
    assert sum(p.numel() for g in audited.optimizer.param_groups for p in g["params"]) == \
        sum(p.numel() for p in plain_model.parameters())
    assert plain.canaries is None and len(audited.canaries.z) == 1


def test_bad_audit_requests_are_refused():
    with pytest.raises(ValueError, match="at least 2"):
        _train(1, 1)
    with pytest.raises(TypeError, match="must be an int"):
        _train(1, 10.0)
    with pytest.raises(ValueError, match="weighted"):
        _train(1, 10, noise_allocation="weighted")
    with pytest.raises(ValueError, match="needs a noisy run"):
        _train(1, 10, noise_multiplier=0.0)
    with pytest.raises(ValueError, match="no audit canaries"):
        audit_training(_train(1, None)[0])
    model = nn.Linear(4, 1)
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(_data(), batch_size=BATCH), target_delta=1e-5,
                                   noise_multiplier=1.0, steps=1, audit_canaries=10)
    with pytest.raises(ValueError, match="released nothing"):
        audit_training(engine)
