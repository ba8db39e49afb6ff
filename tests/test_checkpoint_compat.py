"""Checkpoints written by tunefree 0.1 (plan description format 1) keep loading: each stored run resumes
where it stopped and continues exactly as it did in 0.1 (seeded runs replay bit for bit)."""

from __future__ import annotations

import pytest
import torch
from fixtures.checkpoints import FIXTURE, RUNS, STEPS, build, train


@pytest.fixture(scope="module")
def stored():
    return torch.load(FIXTURE, weights_only=True)


@pytest.mark.parametrize("name", RUNS)
def test_a_checkpoint_of_version_0_1_resumes_its_run_exactly(stored, name):
    saved = stored[name]
    resumed = build(name)
    resumed.model.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["optimizer"])
    resumed.load_state_dict(saved["state"])
    assert resumed.steps == STEPS
    assert resumed.epsilon() == saved["epsilon"]
    assert resumed.clip_thresholds == pytest.approx(saved["thresholds"], rel=1e-12)
    train(resumed, 1)  # bit for bit where the run went on to in 0.1
    for key, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, saved["next model"][key], rtol=0, atol=0, msg=key)
    assert resumed.epsilon() == saved["next epsilon"]


def test_a_checkpoint_of_version_0_1_is_refused_by_another_run(stored):
    other = build("plain")
    with pytest.raises(ValueError, match="other privacy settings"):
        other.load_state_dict(stored["typed"]["state"])
