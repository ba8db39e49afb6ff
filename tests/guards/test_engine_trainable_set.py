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
                                 target_delta=1e-3, steps=4, loss_reduction="sum")  # model(x).sum()


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


def _one_backward(engine, model):
    x, _ = next(iter(engine.data_loader))
    model(x).sum().backward()
    return x


def test_a_gradient_assigned_by_hand_before_the_step_is_refused_with_nothing_released():
    """Only the private step writes .grad: a hand-set gradient (here computed from the batch, unclipped)
    would be replaced unseen by the release. The step is refused and releases nothing."""
    model = MLP()
    engine = engine_for(model)
    before = [p.detach().clone() for p in model.parameters()]
    x = _one_backward(engine, model)
    first = next(model.parameters())
    first.grad = x.mean() * torch.ones_like(first)
    with pytest.raises(PrivacyError, match=r"hold a \.grad that tunefree did not write.*weight_decay"):
        engine.optimizer.step()
    assert engine.ledger.steps == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_gradients_the_private_step_wrote_pass_the_next_step(set_to_none):
    """The released gradients left in .grad (set to None, or zeroed in place) are the step's own."""
    model = MLP()
    engine = engine_for(model)
    for _ in range(3):
        _one_backward(engine, model)
        engine.optimizer.step()
        if set_to_none:
            engine.optimizer.zero_grad()
        else:
            engine.optimizer.zero_grad(set_to_none=False)
    assert engine.ledger.steps == 3


def test_a_weight_penalty_in_the_loss_is_refused_naming_weight_decay():
    model = MLP()
    engine = engine_for(model)
    x, _ = next(iter(engine.data_loader))
    penalty = sum((p ** 2).sum() for p in model.parameters())
    with pytest.raises(PrivacyError, match=r"a penalty on the weights.*weight_decay=2λ"):
        (model(x).sum() + 0.01 * penalty).backward()


def test_grad_is_empty_between_backward_and_step_so_clip_grad_norm_clips_nothing():
    """What docs/refusals.md says of the usual idioms between backward and step: .grad is None there,
    clip_grad_norm_ returns 0, and a parameter's own gradient hooks never run (the engine computes the
    per-example gradients); after the step .grad holds the release."""
    model = MLP()
    engine = engine_for(model)
    ran = []
    for p in model.parameters():
        p.register_hook(lambda g: ran.append("hook"))
        p.register_post_accumulate_grad_hook(lambda p: ran.append("post"))
    _one_backward(engine, model)
    assert all(p.grad is None for p in model.parameters())
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) == 0
    engine.optimizer.step()
    assert ran == []
    assert all(p.grad is not None for p in model.parameters())
