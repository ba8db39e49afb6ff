"""RNN, GRU and LSTM: exact per-sample gradients against a batch-size-1 autograd loop."""

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
from tunefree.clipping.functions import CLIP_FUNCTIONS, clip_function
from tunefree.clipping.groups import make_groups
from tunefree.errors import PrivacyError
from tunefree.persample.engine import ClippingEngine
from tunefree.rules import Capture, rule_for
from tunefree.rules.layout import Dim
from tunefree.rules.recurrent import RecurrentRule

CELLS = {"rnn-tanh": lambda **k: nn.RNN(**k), "rnn-relu": lambda **k: nn.RNN(nonlinearity="relu", **k),
         "gru": lambda **k: nn.GRU(**k), "lstm": lambda **k: nn.LSTM(**k)}


def brute_force(module, x, hx, grad_outputs, batch_first):
    """Each example's gradient from the real module run on that example alone."""
    in_dim = 0 if batch_first else 1
    names = [n for n, _ in module.named_parameters()]
    out = {n: [] for n in names}
    for b in range(x.shape[in_dim]):
        x_b = x.narrow(in_dim, b, 1)
        h_b = None if hx is None else (tuple(h.narrow(1, b, 1) for h in hx) if isinstance(hx, tuple)
                                       else hx.narrow(1, b, 1))
        output, state = module(x_b, h_b)
        outs = [output, *(state if isinstance(state, tuple) else (state,))]
        dims = [in_dim, 1, 1]
        loss = sum((o * g.narrow(d, b, 1)).sum()
                   for o, g, d in zip(outs, grad_outputs, dims) if g is not None)
        grads = torch.autograd.grad(loss, list(module.parameters()))
        for n, g in zip(names, grads):
            out[n].append(g)
    return {n: torch.stack(v) for n, v in out.items()}


@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
def test_rule_matches_brute_force(cell, batch_first, bidirectional, num_layers, bias):
    torch.manual_seed(0)
    module = CELLS[cell](input_size=3, hidden_size=4, num_layers=num_layers, bias=bias,
                         batch_first=batch_first, bidirectional=bidirectional).double()
    B, T = 3, 4
    x = torch.randn((B, T, 3) if batch_first else (T, B, 3), dtype=torch.float64)
    output, state = module(x)
    outs = [output, *(state if isinstance(state, tuple) else (state,))]
    grad_outputs = [torch.randn_like(o) for o in outs]
    rule = rule_for(module, {n for n, _ in module.named_parameters()})
    assert isinstance(rule, RecurrentRule)
    params = dict(module.named_parameters())
    layout = rule.layout(module, (x,), {}, len(outs), declared=0)
    assert layout.outputs == (Dim(0 if batch_first else 1),) + (Dim(1),) * (len(outs) - 1)
    assert layout.inputs == (Dim(0 if batch_first else 1),)
    got = rule.per_sample_grads(module, Capture((x,), {}), batch_first_grads(layout, grad_outputs), params)
    expected = brute_force(copy.deepcopy(module), x, None, grad_outputs, batch_first)
    assert set(got) == set(expected)
    for n in expected:
        torch.testing.assert_close(got[n].materialize(), expected[n], rtol=1e-10, atol=1e-12)


def batch_first_grads(layout, grad_outputs):
    """The output gradients as the engine hands them to a rule: batch-first, by the call's layout."""
    return [None if g is None else axis.batch_first(g) for g, axis in zip(grad_outputs, layout.outputs)]


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_rule_with_initial_state_and_unused_state(cell):
    torch.manual_seed(1)
    module = CELLS[cell](input_size=3, hidden_size=4, num_layers=2, batch_first=True).double()
    B = 3
    h0 = torch.randn(2, B, 4, dtype=torch.float64)
    hx = (h0, torch.randn(2, B, 4, dtype=torch.float64)) if cell == "lstm" else h0
    x = torch.randn(B, 5, 3, dtype=torch.float64)
    output, state = module(x, hx)
    n_states = 2 if cell == "lstm" else 1
    grad_outputs = [torch.randn_like(output)] + [None] * n_states  # h_n (and c_n) unused
    params = dict(module.named_parameters())
    rule = RecurrentRule()
    layout = rule.layout(module, (x, hx), {}, len(grad_outputs), declared=0)
    got = rule.per_sample_grads(module, Capture((x, hx), {}), batch_first_grads(layout, grad_outputs), params)
    expected = brute_force(copy.deepcopy(module), x, hx, grad_outputs, True)
    for n in expected:
        torch.testing.assert_close(got[n].materialize(), expected[n], rtol=1e-10, atol=1e-12)


class RecurrentClassifier(nn.Module):
    """Embedding → LSTM → Linear on the last step; takes ids batch-first, runs the LSTM in either layout."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(7, 4)
        self.lstm = nn.LSTM(4, 5, num_layers=2, batch_first=batch_first, bidirectional=True)
        self.head = nn.Linear(10, 3)

    def forward(self, ids):
        e = self.embed(ids)
        if not self.batch_first:
            out, _ = self.lstm(e.transpose(0, 1))
            return self.head(out[-1])
        out, _ = self.lstm(e)
        return self.head(out[:, -1])


@pytest.mark.parametrize("clip", CLIP_FUNCTIONS)
@pytest.mark.parametrize("batch_first,T", [(True, 4), (False, 6), (False, 5)])  # T == B time-major
def test_engine_clipped_sums_match_brute_force(clip, batch_first, T):
    torch.manual_seed(2)
    B = 5
    model = RecurrentClassifier(batch_first).double()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 7, (B, T))
    y = torch.randint(0, 3, (B,))
    groups = make_groups(model, "per-layer", 1.3)
    clip = clip_function(clip)
    engine = ClippingEngine(model, groups, clip, loss_reduction="mean")
    F.cross_entropy(model(ids), y).backward()
    sums, examples, norms = pop_step(engine)
    engine.detach()
    assert examples == B
    ref_groups = make_groups(reference, "per-layer", 1.3)
    per_example = per_example_grads(reference, lambda o, t: F.cross_entropy(o, t), ids, y)
    expected, expected_norms = clipped_sum(per_example, ref_groups, clip)
    for g, ref_g in zip(groups, ref_groups):
        torch.testing.assert_close(norms[g.name], expected_norms[ref_g.name], rtol=1e-10, atol=1e-12)
        for p, ref_p in zip(g.params, ref_g.params):
            torch.testing.assert_close(sums[p], expected[ref_p], rtol=1e-10, atol=1e-12)


def test_refuses_dropout_between_layers():
    with pytest.raises(PrivacyError, match="nn.Dropout between single-layer"):
        RecurrentRule().check(nn.LSTM(3, 4, num_layers=2, dropout=0.5), "lstm")
    RecurrentRule().check(nn.GRU(3, 4, num_layers=2), "gru")  # no dropout: accepted
    RecurrentRule().check(nn.LSTM(3, 4, proj_size=2), "lstm")  # a projection: accepted (exact below)


@pytest.mark.parametrize("batch_first", [True, False])
def test_projection_matches_brute_force(batch_first):
    """LSTM(proj_size) was refused; its weight_hr is now part of the rule, exact per example."""
    torch.manual_seed(4)
    module = nn.LSTM(3, 5, num_layers=2, proj_size=2, bidirectional=True, batch_first=batch_first).double()
    x = torch.randn((3, 4, 3) if batch_first else (4, 3, 3), dtype=torch.float64)
    output, (h, c) = module(x)
    grad_outputs = [torch.randn_like(output), torch.randn_like(h), torch.randn_like(c)]
    rule = rule_for(module, {n for n, _ in module.named_parameters()})
    assert isinstance(rule, RecurrentRule)
    layout = rule.layout(module, (x,), {}, 3, declared=0)
    got = rule.per_sample_grads(module, Capture((x,), {}), batch_first_grads(layout, grad_outputs),
                                dict(module.named_parameters()))
    expected = brute_force(copy.deepcopy(module), x, None, grad_outputs, batch_first)
    assert any(n.startswith("weight_hr") for n in expected)
    for n in expected:
        torch.testing.assert_close(got[n].materialize(), expected[n], rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_make_private_trains_a_tiny_lstm():
    torch.manual_seed(3)
    ids = torch.randint(0, 7, (64, 5))
    y = (ids[:, -1] > 3).long()
    model = RecurrentClassifier(batch_first=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine = tunefree.make_private(model, optimizer, DataLoader(TensorDataset(ids, y), batch_size=16),
                                   target_epsilon=5.0, target_delta=1e-3, steps=8, seed=0)
    losses = []
    for _ in range(2):  # 2 epochs of 4 expected steps: the planned 8
        for xb, yb in engine.data_loader:
            engine.optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            engine.optimizer.step()
            losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    eps = engine.epsilon()
    assert 0 < eps <= 5.0 * 1.01
