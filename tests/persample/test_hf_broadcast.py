"""Tensors shared by every example (position ids (1, L) from a buffer or ``arange``): the engine expands
the shared layer call's output to one row per example, so each example's gradient is exact; a one-row
input that carries example data is still refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import pop_step
from support.hf_exact import assert_exact
from torch import nn

from tunefree import verify_example_independence
from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.data.poisson import StepSchedule
from tunefree.errors import PrivacyError
from tunefree.persample.engine import ClippingEngine


class Positions(nn.Module):
    """Token and position embeddings; position ids come from a buffer (BERT) or ``arange`` (GPT-2),
    or a shared one-row float input goes through a Linear (a learned bias table)."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source
        self.tok, self.pos, self.table = nn.Embedding(9, 4), nn.Embedding(6, 4), nn.Linear(3, 4)
        self.head = nn.Linear(4, 3)
        self.register_buffer("position_ids", torch.arange(6)[None], persistent=False)
        self.register_buffer("features", torch.randn(1, 5, 3), persistent=False)

    def forward(self, ids, y=None):  # y: the labels, which the independence check passes along
        length = ids.shape[1]
        if self.source == "buffer":
            positions = self.pos(self.position_ids[:, :length])
        else:
            positions = self.pos(torch.arange(length)[None])
        shared = self.table(self.features[:, :length])
        return self.head(self.tok(ids) + positions + shared).mean(1)


def loss(model, batch):
    return F.cross_entropy(model(batch["ids"]), batch["y"], reduction="none")


@pytest.mark.parametrize("source", ["buffer", "arange"])
@pytest.mark.parametrize("grouping", ["all-layer", "per-param"])
def test_shared_position_ids_are_exact(source, grouping):
    g = torch.Generator().manual_seed(0)
    batch = {"ids": torch.randint(0, 9, (4, 5), generator=g), "y": torch.tensor([0, 1, 2, 0])}
    assert_exact(Positions(source), loss, batch, grouping=grouping)


def test_a_batch_of_one_and_an_empty_batch_need_no_expansion():
    model = Positions("buffer")
    schedule = StepSchedule()
    engine = ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("auto-s"),
                            batch_source=schedule)
    for examples in (1, 0):
        schedule.on_batch(True, True, examples)
        loss(model, {"ids": torch.randint(0, 9, (examples, 5)), "y": torch.zeros(examples, dtype=torch.long)}
             ).sum().backward()
        assert pop_step(engine)[1] == examples
        schedule.on_step()


class FirstExampleBroadcast(nn.Module):
    """Reads example 0's ids, without gradients, and shares them with the whole batch: mixing."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(9, 4), nn.Embedding(9, 4), nn.Linear(4, 3)

    def forward(self, ids):
        shared = (ids[:1] * 1).detach()  # new memory, one row, example 0's data
        return self.head(self.tok(ids) + self.pos(shared)).mean(1)


def test_a_one_row_input_holding_an_examples_data_is_refused_by_the_independence_check():
    model = FirstExampleBroadcast()
    engine = ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("auto-s"))
    ids = torch.randint(0, 9, (4, 5))
    with pytest.raises(PrivacyError, match="'pos' mixes examples in its forward"):
        verify_example_independence(model, engine, (ids,))


def test_a_one_row_input_computed_with_gradients_is_still_refused():
    class Mean(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.first(x)
            return self.second(h.mean(0, keepdim=True)) + 0 * h[:, :2]

    wrapper = Mean()
    ClippingEngine(wrapper, make_groups(wrapper, "all-layer", 1.0), clip_function("auto-s"))
    with pytest.raises(PrivacyError, match="layer 'second'.*shows 1 examples"):
        wrapper(torch.randn(4, 3)).sum().backward()
