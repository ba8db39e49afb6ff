"""The trainable parameter set is fixed at make_private (guards/trainable.py): any change is refused at the
next training forward."""

from __future__ import annotations

import pytest
import torch
from support.models import MLP
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.errors import PrivacyError


def engine_for(model):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    data = TensorDataset(torch.randn(8, 6), torch.zeros(8))
    return tunefree.make_private(model, optimizer, DataLoader(data, batch_size=4), noise_multiplier=1.0,
                                 target_delta=1e-3, steps=4)


def test_freezing_a_parameter_after_the_engine_is_refused_at_the_next_forward():
    model = MLP()
    engine = engine_for(model)
    x, _ = next(iter(engine.data_loader))
    model(x).sum().backward()  # trains normally first
    engine.optimizer.step()
    next(model.parameters()).requires_grad_(False)
    with pytest.raises(PrivacyError, match="but no longer requires grad.*make_private again"):
        model(torch.randn(3, 6))


def test_unfreezing_a_parameter_after_the_engine_is_refused():
    model = MLP()
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    engine_for(model)
    frozen.requires_grad_(True)
    with pytest.raises(PrivacyError, match="requires grad but was not trainable"):
        model(torch.randn(3, 6))


def test_a_module_appended_after_the_engine_is_refused():
    model = MLP()
    engine_for(model)
    model.add_module("extra", nn.Linear(2, 2))
    with pytest.raises(PrivacyError, match="extra.weight"):
        model(torch.randn(3, 6))


def test_forward_without_gradients_is_not_checked():
    model = MLP()
    engine_for(model)
    next(model.parameters()).requires_grad_(False)
    with torch.no_grad():
        model(torch.randn(3, 6))  # evaluation releases nothing
