"""Hugging Face ``Conv1D`` (a linear layer with its weight stored transposed) has a native rule, exact
against brute force on both norm paths, and GPT-2 needs no generic fallback."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers as hf
from support.hf_exact import assert_exact
from torch import nn
from transformers.pytorch_utils import Conv1D

from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.persample.engine import ClippingEngine
from tunefree.rules import rule_for
from tunefree.rules.factored import ghost_is_cheaper
from tunefree.rules.hf_conv1d import HFConv1DRule

pytestmark = pytest.mark.hf


class Conv1DNet(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.proj, self.head = Conv1D(d_out, d_in), nn.Linear(d_out, 3)

    def forward(self, x, y=None):  # y: the labels, which the independence check passes along
        h = self.proj(x).tanh()
        return self.head(h.reshape(h.shape[0], -1, h.shape[-1]).mean(1))


def loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


# (input shape after the batch, d_out): tokens, many tokens (materialised), no token dimension
CASES = [((5, 8), 6), ((40, 4), 5), ((8,), 6), ((2, 3, 8), 6)]


def test_the_cases_exercise_both_norm_paths():
    paths = {ghost_is_cheaper(math.prod(shape[:-1]), shape[-1], d_out) for shape, d_out in CASES}
    assert paths == {True, False}


@pytest.mark.parametrize("shape,d_out", CASES)
@pytest.mark.parametrize("grouping", ["all-layer", "per-param"])
def test_conv1d_matches_brute_force(shape, d_out, grouping):
    g = torch.Generator().manual_seed(3)
    batch = {"x": torch.randn(4, *shape, generator=g), "y": torch.tensor([0, 1, 2, 1])}
    model = Conv1DNet(shape[-1], d_out)
    assert isinstance(rule_for(model.proj, {"weight", "bias"}), HFConv1DRule)
    assert_exact(model, loss, batch, grouping=grouping, clip="abadi")


def test_gpt2_runs_without_the_generic_fallback():
    config = hf.GPT2Config(vocab_size=20, n_embd=8, n_layer=1, n_head=2, n_positions=8)
    model = hf.GPT2LMHeadModel(config).train()
    engine = ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("auto-s"))
    assert [u.name for u in engine.units if u.rule is None] == []
    assert {type(u.rule) for u in engine.units if isinstance(u.module, Conv1D)} == {HFConv1DRule}


def test_a_conv1d_subclass_with_its_own_forward_goes_to_the_fallback():
    class Scaled(Conv1D):
        def forward(self, x):
            return 2 * super().forward(x)

    assert rule_for(Scaled(4, 3), {"weight", "bias"}) is None
