"""The trainable parameter set is fixed when the engine is built (at make_private)."""

from __future__ import annotations

import pytest
import torch
from models import MLP
from torch import nn

from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.errors import PrivacyError
from tunefree.persample.engine import ClippingEngine


def engine_for(model):
    return ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("auto-s"))


def test_freezing_a_parameter_after_the_engine_is_refused_at_the_next_forward():
    model = MLP()
    engine_for(model)
    model(torch.randn(3, 6)).sum().backward()  # trains normally first
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
