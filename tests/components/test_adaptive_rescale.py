"""AdaptiveQuantile(rescale=True) with Abadi clipping: the group-wise paper's C̃ₖ = C·Qₖ/√(Σⱼ Qⱼ²)."""

from __future__ import annotations

import math

import pytest
import torch
from support.models import MLP
from support.training import train
from torch.utils.data import DataLoader, TensorDataset

from tunefree import AdaptiveQuantile, make_private


def engine_for(thresholds, groups="per-layer"):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(64, 6, generator=g, dtype=torch.float64),
                         torch.randint(0, 3, (64,), generator=g))
    model = MLP().double()
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=64),
                        noise_multiplier=0.0, target_delta=1e-5, clipping="abadi", groups=groups,
                        max_grad_norm=1.0, thresholds=thresholds, seed=0)


def test_rescaled_thresholds_keep_the_total_and_follow_the_estimates():
    engine = engine_for(AdaptiveQuantile(target=0.7, rescale=True))
    initial = math.sqrt(sum(c ** 2 for c in engine.clip_thresholds.values()))
    train(engine, 5)
    estimates = engine.quantile_estimator.quantiles
    norm = math.sqrt(sum(q ** 2 for q in estimates.values()))
    expected = {k: initial * q / norm for k, q in estimates.items()}
    assert engine.clip_thresholds == pytest.approx(expected, rel=1e-12)
    assert math.hypot(*engine.clip_thresholds.values()) == pytest.approx(initial, rel=1e-12)
    assert engine.clip_thresholds != pytest.approx(estimates)  # not the estimates themselves
    plain = engine_for(AdaptiveQuantile(target=0.7))  # without rescaling Abadi clips at the estimates
    train(plain, 5)
    assert plain.clip_thresholds == pytest.approx(plain.quantile_estimator.quantiles, rel=1e-12)


def test_rescaling_one_group_is_refused():
    with pytest.raises(ValueError, match="one group"):
        engine_for(AdaptiveQuantile(rescale=True), groups="all-layer")
    with pytest.raises(TypeError, match="rescale"):
        AdaptiveQuantile(rescale=1)
