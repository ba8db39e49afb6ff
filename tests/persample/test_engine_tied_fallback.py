"""A parameter tied across modules and read inside a fallback unit: refused, or exact through modules."""

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


class TiedByRead(nn.Module):
    """A fallback unit (bare parameter) whose GPT-style head reads the embedding's weight directly."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(9, 4)
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, ids):
        return F.linear(self.tok(ids).mean(1) * self.gain, self.tok.weight)


class TiedByModule(TiedByRead):
    """The fix the refusal suggests: the head is an nn.Linear sharing the embedding's weight."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 9, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids):
        return self.head(self.tok(ids).mean(1) * self.gain)


class TiedReadFirst(TiedByRead):
    """The same head, its weight read before the embedding module runs."""

    def forward(self, ids):
        head = self.tok.weight * 1.0
        return F.linear(self.tok(ids).mean(1) * self.gain, head)


class ReadNeverCalled(TiedByRead):
    """The embedding's weight only read directly, its module never called: the fallback owns it."""

    def forward(self, ids):
        h = F.embedding(ids, self.tok.weight).mean(1) * self.gain
        return F.linear(h, self.tok.weight)


def engine_for(model, clip):
    groups = make_groups(model, "all-layer", 0.3)
    return ClippingEngine(model, groups, clip), groups


def assert_tok_and_gain_match_brute_force(model):
    """One step of four examples: the clipped sums of ``tok.weight`` and ``gain`` equal a batch-size-1
    autograd loop (Abadi clipping)."""
    ids, y = torch.randint(0, 9, (4, 5)), torch.tensor([1, 2, 3, 0])
    clip = clip_function("abadi")
    engine, groups = engine_for(model, clip)
    F.cross_entropy(model(ids), y).backward()
    sums, examples, _ = pop_step(engine)
    engine.detach()
    expected, _ = clipped_sum(per_example_grads(model, F.cross_entropy, ids, y), groups, clip)
    assert examples == 4
    for p in (model.tok.weight, model.gain):
        torch.testing.assert_close(sums[p], expected[p], rtol=1e-7, atol=1e-10)


def test_a_tied_head_read_inside_a_fallback_unit_is_refused_with_the_fix():
    model = TiedByRead()
    engine_for(model, clip_function("abadi"))
    ids = torch.randint(0, 9, (3, 5))
    with pytest.raises(PrivacyError, match="'tok.weight'.*outside the forward.*nn.Linear sharing the weight"):
        F.cross_entropy(model(ids), torch.tensor([1, 2, 3])).backward()


def test_the_suggested_tied_module_inside_a_fallback_unit_matches_brute_force():
    torch.manual_seed(0)
    model = TiedByModule().double()
    with torch.no_grad():
        model.gain.copy_(torch.randn(4))
    assert_tok_and_gain_match_brute_force(model)


def test_a_tied_weight_read_before_its_module_runs_is_refused_at_the_forward():
    model = TiedReadFirst()
    engine_for(model, clip_function("abadi"))
    with pytest.raises(PrivacyError, match="'tok.weight'.*outside the forward.*nn.Linear sharing the weight"):
        model(torch.randint(0, 9, (3, 5)))


def test_a_weight_whose_module_never_runs_belongs_to_the_fallback_and_matches_brute_force():
    torch.manual_seed(1)
    model = ReadNeverCalled().double()
    assert_tok_and_gain_match_brute_force(model)
