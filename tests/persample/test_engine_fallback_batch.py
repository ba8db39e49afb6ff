"""The generic fallback cuts into examples only the inputs derived from the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import pop_step
from support.brute_force import clipped_sum, per_example_grads
from torch import nn

from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.errors import PrivacyError
from tunefree.persample.engine import ClippingEngine

T, D = 4, 3


class MaskedMixer(nn.Module):
    """A fallback unit (bare parameter) given a shared [T, D] table and a [T, T] causal mask."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(D))

    def forward(self, h, table, mask):
        a = (h + table) * self.scale
        scores = (a @ a.transpose(-1, -2)).masked_fill(mask == 0, float("-inf"))
        return scores.softmax(-1) @ a


class Positional(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(2, D)
        self.mixer = MaskedMixer()
        self.head = nn.Linear(D, 3)
        self.register_buffer("table", torch.randn(T, D))

    def forward(self, x):
        mask = torch.tril(torch.ones(T, T))
        return self.head(self.mixer(self.embed(x), self.table, mask).mean(1))


def loss_fn(logits, y):
    return F.cross_entropy(logits, y)


def test_shared_table_and_causal_mask_are_not_cut_when_the_batch_has_t_examples():
    torch.manual_seed(0)
    model = Positional().double()
    x, y = torch.randn(T, T, 2, dtype=torch.float64), torch.tensor([0, 1, 2, 1])  # B == T
    clip = clip_function("abadi")
    groups = make_groups(model, "per-layer", 0.5)
    engine = ClippingEngine(model, groups, clip)
    loss_fn(model(x), y).backward()
    sums, examples, _ = pop_step(engine)
    engine.detach()
    expected, _ = clipped_sum(per_example_grads(model, loss_fn, x, y), groups, clip)
    assert examples == T
    for p in model.parameters():
        torch.testing.assert_close(sums[p], expected[p], rtol=1e-7, atol=1e-10)


class Rescaled(nn.Module):
    """Hands the fallback a per-example tensor computed anew from the input (not provably batch)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(2, D)
        self.mixer = MaskedMixer()

    def forward(self, x):
        weights = x.detach().sum(-1, keepdim=True) * 0 + 1  # [B, T, 1], new storage, no grad
        return self.mixer(self.embed(x), weights, torch.ones(T, T)).mean((1, 2))


def test_an_input_not_derived_from_the_batch_that_changes_the_output_shape_is_refused():
    model = Rescaled()
    ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("auto-s"))
    x = torch.randn(5, T, 2)
    with pytest.raises(PrivacyError, match=r"MaskedMixer computed an output of shape \(5, 4, 3\).*"
                                           r"gradient has shape \(1, 4, 3\).*\(5, 4, 1\)"):
        model(x).sum().backward()
