"""The backward check's powers of two: base 64 (one scaled pass up to 64 examples), base 8 where float16
could overflow, and again at base 8 before a disproportion found at base 64 is acted on."""

from __future__ import annotations

import pytest
import torch
from support.models import IdentityForward
from support.training import train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.guards import independence


@pytest.mark.parametrize("n", [2, 3, 63, 64, 65, 700, 4096])
@pytest.mark.parametrize("base", [independence.HALF_BASE, independence.WIDE_BASE])
def test_any_two_examples_differ_in_some_scaled_pass(n, base):
    exponents = independence.ratio_exponents(n, base=base)
    assert len(exponents) == independence.ratio_digits(n, base)
    assert int(exponents.max()) < base
    columns = {tuple(column.tolist()) for column in exponents.T}
    assert len(columns) == n


def test_one_scaled_pass_tells_64_examples_apart_and_two_tell_4096():
    assert [independence.ratio_digits(n) for n in (2, 64, 65, 4096, 4097)] == [1, 1, 2, 2, 3]
    assert [independence.ratio_digits(n, independence.HALF_BASE) for n in (8, 9, 64, 65)] == [1, 2, 2, 3]


def test_float16_parameters_take_the_base_whose_scales_fit_in_float16():
    class Unit:
        def __init__(self, dtype):
            self.direct = {"weight": torch.zeros(2, dtype=dtype)}
    assert independence.ratio_base([Unit(torch.float32), Unit(torch.bfloat16)]) == independence.WIDE_BASE
    assert independence.ratio_base([Unit(torch.float32), Unit(torch.float16)]) == independence.HALF_BASE
    largest_weight = 3 * 2.0 ** (independence.HALF_BASE - 1)  # the largest loss factor × the largest scale
    assert largest_weight < torch.finfo(torch.float16).max


class ThroughFloat16(IdentityForward):
    """Identity whose backward passes the gradient through float16 (a half-precision layer inside a float32
    model): exact and linear, but a gradient scaled by 2⁶³ overflows there."""

    @staticmethod
    def backward(ctx, grad):
        return grad.half().float()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.second(ThroughFloat16.apply(torch.tanh(self.first(x))))


def _train_mean_loss(steps: int) -> int:
    torch.manual_seed(0)
    model = Net()
    data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(data, batch_size=32), target_delta=1e-3, noise_multiplier=1.0,
                                   steps=steps, seed=0, verify_every=1)
    return train(engine, steps=steps)


def test_an_overflow_at_base_64_is_checked_again_at_base_8_and_trains():
    assert _train_mean_loss(3) == 3


def test_without_the_second_look_the_overflow_is_refused_as_a_backward_not_linear(monkeypatch):
    """What the second look at base 8 prevents (the mean loss refuses any disproportion)."""
    monkeypatch.setattr(independence, "HALF_BASE", independence.WIDE_BASE)
    with pytest.raises(tunefree.PrivacyError, match="not proportional|linear"):
        _train_mean_loss(1)


def test_mixing_in_the_backward_is_still_refused_after_the_second_look():
    class MixingBackward(IdentityForward):
        """Identity forward; a backward through float16 that adds example i − 1's gradient to example i's."""

        @staticmethod
        def backward(ctx, grad):
            return grad.half().float() + 0.1 * grad.roll(1, 0)

    class Mixing(Net):
        def forward(self, x):
            return self.second(MixingBackward.apply(torch.tanh(self.first(x))))

    torch.manual_seed(0)
    model = Mixing()
    data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(data, batch_size=32), target_delta=1e-3, noise_multiplier=1.0,
                                   steps=1, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(tunefree.PrivacyError, match="mixes examples in its backward"):
        train(engine, steps=1)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert engine.steps == 0
