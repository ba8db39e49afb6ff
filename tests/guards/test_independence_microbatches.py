"""The independence check reads every physical batch of a checked step (issue 21, item 2): mixing that
some data values trigger in a later micro-batch only is refused before the step's release."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree


class MixesWhenTriggered(nn.Module):
    """Adds the next example's hidden state to each example's when an example of the batch has a first
    feature above 4 (ordinary data-dependent code, invisible on batches without such an example)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if bool((x[:, 0] > 4).any()):
            h = h + h.roll(1, 0)
        return self.b(h)


def _train_one_step(trigger_at: int | None) -> tunefree.DPEngine:
    """One step of batch 6 in micro-batches of 2, every step checked; the example at ``trigger_at`` (if
    any) switches the mixing on."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    if trigger_at is not None:
        x[trigger_at, 0] = 5.0  # tanh unsaturated: the trigger example moves the others
    model = MixesWhenTriggered()
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(TensorDataset(x, y), batch_size=6), target_delta=1e-2,
                                   noise_multiplier=1.0, steps=1, seed=0, physical_batch_size=2,
                                   loss_reduction="sum", verify_every=1)
    for xb, yb in engine.data_loader:
        nn.functional.cross_entropy(model(xb), yb, reduction="sum").backward()
        engine.optimizer.step()
    return engine


@pytest.mark.parametrize("trigger_at", [0, 3, 5])
def test_mixing_in_any_micro_batch_is_refused_before_the_release(trigger_at):
    with pytest.raises(tunefree.PrivacyError, match="mixes examples"):
        _train_one_step(trigger_at)


def test_a_step_without_mixing_is_released_once():
    assert _train_one_step(None).ledger.steps == 1


class MixesInPairs(nn.Module):
    """Mixes only when called on exactly two examples: a code path chosen by the micro-batch's shape."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h + h.flip(0) if len(x) == 2 else h)


def test_mixing_chosen_by_a_later_micro_batchs_size_is_refused_before_the_release():
    torch.manual_seed(0)
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    model = MixesInPairs()
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(TensorDataset(x, y), batch_size=5), target_delta=1e-2,
                                   noise_multiplier=1.0, steps=1, seed=0, physical_batch_size=3,
                                   loss_reduction="sum", verify_every=1)
    sizes = []
    with pytest.raises(tunefree.PrivacyError, match="mixes examples"):
        for xb, yb in engine.data_loader:
            sizes.append(len(xb))
            nn.functional.cross_entropy(model(xb), yb, reduction="sum").backward()
            engine.optimizer.step()
    assert sizes == [3, 2] and engine.ledger.steps == 0  # the mixing micro-batch came second; no release
