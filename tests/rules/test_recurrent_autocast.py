"""Recurrent layers and cells under 16-bit autocast: the per-sample rules recompute the layer from its 16-bit
inputs, states and output gradients (converted to float32, exactly) and match a batch-size-1 loop run in the
same autocast.

How close is close: bfloat16 rounds every activation of every time step, so the batch-1 loop's own result
moves when its precision does. The tolerance is measured, not assumed: the engine's clipped sums and norms
must lie within twice the distance between the loop in bfloat16 and the loop in float32 — as close to the
bfloat16 loop as bfloat16 lets the loop be to itself in another precision (a missing step, state or gate
would be off by the size of the gradient, 100 times more).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support import pop_step
from support.brute_force import clipped_sum, per_example_grads
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.persample.engine import ClippingEngine

LAYERS = {"lstm": lambda: nn.LSTM(4, 6, batch_first=True), "gru": lambda: nn.GRU(4, 6),
          "rnn": lambda: nn.RNN(4, 6, batch_first=True), "lstm-cell": lambda: nn.LSTMCell(4, 6),
          "gru-cell": lambda: nn.GRUCell(4, 6), "rnn-cell": lambda: nn.RNNCell(4, 6, nonlinearity="relu")}


class Recurrent(nn.Module):
    """Linear → a recurrent layer (or a cell stepped over time) → Linear. Under autocast the layer's input
    and its initial state (made from the batch) arrive in 16 bits."""

    def __init__(self, kind: str):
        super().__init__()
        self.inp, self.state, self.layer, self.head = nn.Linear(3, 4), nn.Linear(3, 6), LAYERS[kind](), \
            nn.Linear(6, 3)
        self.kind = kind

    def forward(self, x):  # [B, T, 3]
        e, h0 = torch.tanh(self.inp(x)), torch.tanh(self.state(x[:, 0]))
        if self.kind == "lstm":
            h = self.layer(e, (h0[None], torch.zeros_like(h0)[None]))[0][:, -1]
        elif self.kind == "gru":  # time-major
            h = self.layer(e.transpose(0, 1), h0[None])[0][-1]
        elif self.kind == "rnn":
            h = self.layer(e)[0][:, -1]
        else:
            h = (h0, torch.zeros_like(h0)) if self.kind == "lstm-cell" else h0
            for t in range(e.shape[1]):
                h = self.layer(e[:, t], h)
            h = h[0] if self.kind == "lstm-cell" else h
        return self.head(h)


def summed(out, y):
    return F.cross_entropy(out.float(), y, reduction="sum")


def brute(model, x, y, autocast: bool):
    """The batch-1 loop's clipped sums and norms of the recurrent layer (per-layer groups, AUTO-S)."""
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        grads = per_example_grads(reference, summed, x, y)
    groups = make_groups(reference, "per-layer", 1.0)
    sums, norms = clipped_sum(grads, groups, clip_function("auto-s"))
    group = next(g for g in groups if g.name == "layer")
    return torch.cat([sums[p].double().flatten() for p in group.params]), norms["layer"]


@pytest.mark.parametrize("kind", list(LAYERS))
def test_clipped_sums_under_bf16_autocast_match_the_batch_1_loop_in_the_same_autocast(kind):
    torch.manual_seed(0)
    model = Recurrent(kind)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 5, 3, generator=g), torch.randint(0, 3, (6,), generator=g)
    loop16, norms16 = brute(model, x, y, autocast=True)
    loop32, norms32 = brute(model, x, y, autocast=False)

    groups = make_groups(model, "per-layer", 1.0)
    engine = ClippingEngine(model, groups, clip_function("auto-s"), loss_reduction="sum")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        assert out.dtype == torch.bfloat16
    summed(out, y).backward()
    sums, examples, norms = pop_step(engine)
    engine.detach()
    assert examples == 6
    group = next(g for g in groups if g.name == "layer")
    got = torch.cat([sums[p].double().flatten() for p in group.params])

    precision = (loop16 - loop32).norm()
    assert 0 < precision < 0.05 * loop32.norm()  # bfloat16 moved the loop, by a few roundings
    assert (got - loop16).norm() <= 2 * precision, ((got - loop16).norm() / precision).item()
    norm_precision = (norms16 - norms32).norm()
    assert (norms["layer"].double() - norms16).norm() <= 2 * norm_precision


@pytest.mark.parametrize("kind", list(LAYERS))
def test_a_private_step_under_bf16_autocast_trains_the_recurrent_layer(kind):
    torch.manual_seed(0)
    model = Recurrent(kind)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 5, 3, generator=g), torch.randint(0, 3, (8,), generator=g)
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(TensorDataset(x, y), batch_size=8), noise_multiplier=1.0,
                                   target_delta=1e-3, steps=1, loss_reduction="sum", seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for xb, yb in engine.data_loader:
        engine.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = summed(model(xb), yb)
        loss.backward()
        engine.optimizer.step()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(p, before[name]), name
    assert engine.epsilon() > 0
