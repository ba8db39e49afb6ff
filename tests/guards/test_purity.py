"""The model's function, watched by behaviour (``guards/purity.py``): state a forward pass writes, wherever
it lives, changes what the model computes on the same rows at the same weights, and the step releases
nothing. The cases keep their state where no guard of attributes looks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.training import train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.errors import PrivacyError


def _centred(h: torch.Tensor, kept: dict = {}) -> torch.Tensor:  # noqa: B006 - the state under test
    """Centres by the previous batch's mean, kept in the function's default argument."""
    before = kept.get("mean")
    kept["mean"] = h.detach().mean(0)
    return h if before is None else h - before


class StateInADefaultArgument(nn.Module):
    """State neither on the model, nor on its class, nor in a global name: in a function's defaults."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(_centred(torch.tanh(self.a(x))))


class StateInAClosure(nn.Module):
    """A scalar kept in a closure's cell: the largest activation seen so far, which scales the output."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)
        largest = [1.0]

        def scale(h):
            largest[0] = max(largest[0], float(h.detach().abs().max()))
            return h / largest[0]
        self.scale = scale

    def forward(self, x):
        return self.b(self.scale(torch.tanh(self.a(x)) * 3))


@pytest.mark.parametrize("factory", [StateInADefaultArgument, StateInAClosure])
def test_state_kept_outside_the_model_object_is_refused_before_the_first_release(factory):
    _centred.__defaults__[0].clear()
    torch.manual_seed(0)
    model = factory()
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(TensorDataset(x, y), batch_size=16), noise_multiplier=1.0,
                                   target_delta=1e-3, steps=4, seed=0, loss_reduction="sum")
    with pytest.raises(PrivacyError, match="the model's function changed during the step"):
        train(engine, 4, loss=lambda m, xb, yb: F.cross_entropy(m(xb), yb, reduction="sum"))
    assert engine.steps == 0
    assert engine.optimizer.accumulator.pop().examples == 0  # the step's sums were dropped
