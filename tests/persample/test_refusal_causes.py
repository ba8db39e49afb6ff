"""Refusals that name the true cause and its fix (issue 29, item 8).

- A layer whose weight torch computes from other parameters (``nn.utils.parametrizations.orthogonal``,
  ``weight_norm``, ``spectral_norm``, and the older hook-based ``weight_norm``/``spectral_norm``) was
  refused at its first backward as "a layer called on part of the batch": it is refused at
  ``make_private`` with the reason, and the fix it names (the weight computed in a forward of one's own) is
  exact against the batch-size-1 loop.
- Manual micro-batching (a forward and backward per part of the Poisson batch) was refused as "a statistic
  over the batch": the message says it is a call on part of the batch and names ``physical_batch_size``, on
  the checked steps (the inputs check) and on the others (the engine's example count).
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from support import pop_step
from support.brute_force import clipped_sum, per_example_grads
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.clipping.groups import make_groups
from tunefree.persample.engine import ClippingEngine


def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def private(model: nn.Module, **settings) -> tunefree.DPEngine:
    return tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 DataLoader(data(), batch_size=16), target_delta=1e-3, noise_multiplier=1.0,
                                 steps=4, seed=0, **settings)


def parametrize_with(how: str):
    def make() -> nn.Module:
        torch.manual_seed(0)
        layer = nn.Linear(6, 6)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated
            {"orthogonal": nn.utils.parametrizations.orthogonal,
             "weight_norm": nn.utils.parametrizations.weight_norm,
             "spectral_norm": nn.utils.parametrizations.spectral_norm,
             "old weight_norm": nn.utils.weight_norm,
             "old spectral_norm": nn.utils.spectral_norm}[how](layer)
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), layer, nn.Tanh(), nn.Linear(6, 3))
    return make


@pytest.mark.parametrize("how, words", [
    ("orthogonal", r"a parametrization \(Orthogonal; torch.nn.utils.parametrizations\)"),
    ("weight_norm", r"a parametrization \(WeightNorm; torch.nn.utils.parametrizations\)"),
    ("spectral_norm", r"a parametrization \(SpectralNorm; torch.nn.utils.parametrizations\)"),
    ("old weight_norm", r"a WeightNorm hook \(torch.nn.utils.weight_norm\)"),
    ("old spectral_norm", r"a SpectralNorm hook \(torch.nn.utils.spectral_norm\)")])
def test_a_parametrized_layer_is_refused_at_make_private_with_the_reason_and_the_fix(how, words):
    model = parametrize_with(how)()
    with pytest.raises(tunefree.ModelRefused, match=f"'2' .* computes its 'weight' from other trainable "
                                                    f"parameters through {words}: .*no example's data.*"
                                                    "generic fallback .* exactly.*engine.public_writes"):
        private(model)
    assert not model[0]._forward_pre_hooks  # refused before the engine hooked anything


def test_a_frozen_parametrization_is_a_constant_weight_and_trains():
    model = parametrize_with("orthogonal")()
    model[2].parametrizations.weight.original.requires_grad_(False)
    engine = tunefree.make_private(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                                          lr=0.1), DataLoader(data(), batch_size=16),
                                   target_delta=1e-3, noise_multiplier=1.0, steps=1, seed=0)
    x, y = next(iter(engine.data_loader))
    F.cross_entropy(model(x), y).backward()
    engine.optimizer.step()
    assert engine.ledger.steps == 1


class OrthogonalLinear(nn.Module):
    """The fix for orthogonal: the weight computed in the module's own forward from a raw parameter."""

    def __init__(self, n: int):
        super().__init__()
        self.raw, self.bias = nn.Parameter(torch.randn(n, n) * 0.3), nn.Parameter(torch.randn(n) * 0.1)

    def forward(self, x):
        a = self.raw.triu(1)
        return F.linear(x, torch.linalg.matrix_exp(a - a.T), self.bias)


class WeightNormLinear(nn.Module):
    """The fix for weight norm: W = g · V/‖V‖ (rows) in the module's own forward."""

    def __init__(self, n: int):
        super().__init__()
        self.v, self.g = nn.Parameter(torch.randn(n, n)), nn.Parameter(torch.rand(n, 1) + 0.5)
        self.bias = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return F.linear(x, self.g * self.v / self.v.norm(dim=1, keepdim=True), self.bias)


@pytest.mark.parametrize("layer", [OrthogonalLinear, WeightNormLinear])
def test_the_fix_the_refusal_names_is_exact_against_the_batch_size_1_loop(layer):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), layer(6), nn.Tanh(), nn.Linear(6, 3)).double()
    reference = copy.deepcopy(model)
    groups = make_groups(model, "per-layer", 1.0)
    engine = ClippingEngine(model, groups, tunefree.Abadi(), loss_reduction="sum")
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    F.cross_entropy(model(x), y, reduction="sum").backward()
    sums, examples, _ = pop_step(engine)
    per_example = per_example_grads(reference, lambda out, t: F.cross_entropy(out, t, reduction="sum"), x, y)
    expected, norms = clipped_sum(per_example, make_groups(reference, "per-layer", 1.0), tunefree.Abadi())
    assert examples == 7 and any((n > 1).any() for n in norms.values())  # some examples clipped
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(sums[p], expected[q], rtol=1e-9, atol=1e-12)


def micro_batching(first_split: int, **settings) -> tuple[tunefree.DPEngine, list[int]]:
    """A loop that cuts each Poisson batch into two halves, forward and backward per half, from step
    ``first_split`` on; returns the engine and the steps released before the refusal."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    engine = private(model, loss_reduction="sum", **settings)
    released = []
    with pytest.raises(tunefree.PrivacyError) as refused:
        for step, (x, y) in enumerate(engine.data_loader):
            engine.optimizer.zero_grad()
            half = len(x) // 2
            parts = [(x[:half], y[:half]), (x[half:], y[half:])] if step >= first_split else [(x, y)]
            for xs, ys in parts:
                F.cross_entropy(model(xs), ys, reduction="sum").backward()
            engine.optimizer.step()
            released.append(step)
    return refused.value, released


def test_manual_micro_batching_on_a_checked_step_is_named_with_physical_batch_size():
    refusal, released = micro_batching(0)
    assert released == []
    assert "has no row per example" not in str(refusal)  # the message blaming a statistic over the batch
    pattern = (r"model input argument 0 \(shape \((\d+), 4\)\) holds \1 of the \d+ examples of the loader's "
               r"batch: the model was called on part of the batch \(a forward and backward per part of it: "
               r"manual micro-batching\)\..*To train a batch in parts \(when it does not fit in memory\), "
               r"let tunefree cut it: make_private\(\.\.\., physical_batch_size=\1\) hands out each Poisson "
               r"batch.*")
    assert re.fullmatch(pattern, str(refusal)), str(refusal)


def test_manual_micro_batching_on_an_unchecked_step_is_named_with_physical_batch_size():
    """From step 2 on (the first two steps are checked; verify_every=10**6 checks no other), the engine's
    example count refuses the half at its backward, naming manual micro-batching first."""
    refusal, released = micro_batching(2, verify_every=10 ** 6)
    assert released == [0, 1]
    pattern = (r"shows \d+ examples in dimension 0, where it carries its examples, but the batch holds \d+: "
               r"the model or a layer called on part of the batch cannot be attributed to examples\. If the "
               r"loop cuts the loader's batch into parts \(a forward and backward per part: manual "
               r"micro-batching\), let tunefree cut it: make_private\(\.\.\., physical_batch_size=k\)")
    assert re.search(pattern, str(refusal)), str(refusal)


class Doubled(nn.Module):
    def forward(self, x):
        return x * 2.0  # computed from the batch without gradients on an unchecked step


def test_a_one_example_part_is_not_taken_for_a_call_shared_by_all_examples():
    """Micro-batches of one example, the first layer fed a tensor computed from the part: its one row is
    an example's data, not a value shared by the batch (position ids), so it is not expanded to the
    batch's rows (which made the model return a row per batch example for a part of one, and would book
    that example's gradient once per row); the call is refused naming micro-batching (fuzz seed 24581)."""
    torch.manual_seed(0)
    model = nn.Sequential(Doubled(), nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    engine = private(model, loss_reduction="sum", verify_every=10 ** 6)
    batches = iter(engine.data_loader)
    for _ in range(2):  # the checked first steps
        x, y = next(batches)
        F.cross_entropy(model(x), y, reduction="sum").backward()
        engine.optimizer.step()
    x, y = next(batches)
    out = model(x[:1])
    assert out.shape == (1, 3)
    with pytest.raises(tunefree.PrivacyError, match=r"manual micro-batching"):
        F.cross_entropy(out, y[:1], reduction="sum").backward()
    assert engine.ledger.steps == 2  # before the fix: released, the example booked 15 times (15·R)


def test_a_part_of_a_transformed_batch_gets_both_causes():
    """Rows that are not the loader's own (scaled first, then cut): the message gives both causes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    engine = private(model, loss_reduction="sum")
    x, y = next(iter(engine.data_loader))
    words = (r"has 7 rows where the batch holds \d+ examples: if you cut the batch into parts yourself .*"
             "let tunefree cut it: .*physical_batch_size=7.*Otherwise it carries several examples' data")
    with pytest.raises(tunefree.PrivacyError, match=words):
        F.cross_entropy(model((x * 2.0)[:7]), y[:7], reduction="sum").backward()


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)  # torch's default dropout 0.1
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.enc(x).mean(1))


def test_attention_dropout_is_refused_at_make_private_with_the_one_line_fix():
    """nn.TransformerEncoderLayer's default dropout reaches its self-attention, which the generic fallback
    cannot replay one example at a time: refused before training (it was refused only at the first
    backward, telling the user to move a dropout they cannot reach); the fix it names trains."""
    torch.manual_seed(0)
    model = Encoder()
    data = TensorDataset(torch.randn(32, 5, 8), torch.randint(0, 3, (32,)))

    def private_run():
        return tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     DataLoader(data, batch_size=8), target_delta=1e-3, noise_multiplier=1.0,
                                     steps=2, seed=0)
    with pytest.raises(tunefree.PrivacyError, match=r"'enc\.self_attn' \(MultiheadAttention\) has "
                       r"dropout=0\.1.*model\.get_submodule\('enc\.self_attn'\)\.dropout = 0\.0"):
        private_run()
    model.enc.self_attn.dropout = 0.0
    engine = private_run()
    for _, (x, y) in zip(range(2), engine.data_loader):
        F.cross_entropy(model(x), y).backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    assert engine.ledger.steps == 2
