"""Mixed precision: bf16/fp16 autocast, full bf16 parameters, and fp16 loss scaling with GradScaler.

Losses are summed (``loss_reduction="sum"``): gradients in 16 bits under a mean loss are refused (each
example's rounding would depend on the batch size; ``tests/persample/test_invariant_amp.py``).

The loss scale never reaches a clip weight (norms are taken of unscaled gradients), an example that
overflows adds nothing where it overflows while the step is released and recorded as planned, and a
release that overflows in the parameters' dtype is recorded and only its update skipped.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support import pop_step
from support.brute_force import clipped_sum, per_example_grads
from support.models import FallbackNet
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.persample.engine import ClippingEngine

BF16_EPS = 2.0 ** -8  # bf16 keeps 8 significant bits: one rounding moves a value by up to 2⁻⁸ relative
FP16_EPS = 2.0 ** -11


class TokenNet(nn.Module):
    """Embedding → Conv1d → LayerNorm → Linear, on token ids [B, T]."""

    def __init__(self, vocab=11, d=6, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        h = self.conv(self.emb(ids).transpose(1, 2)).transpose(1, 2)
        return self.head(torch.tanh(self.norm(h)).mean(1))


class DenseNet(nn.Module):
    """Linear → LayerNorm → Linear on features [B, 4]."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))))


def token_batch(n=6):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 11, (n, 5), generator=g), torch.randint(0, 3, (n,), generator=g)


def dense_data(n=40):
    g = torch.Generator().manual_seed(4)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


# ----------------------------------------------------------------------------- bf16 vs brute force
@pytest.mark.parametrize("clip", ["auto-s", "abadi"])
def test_bf16_autocast_norms_and_clipped_sums_match_brute_force_in_the_same_autocast(clip):
    """Both sides run the same bf16 autocast; they differ by bf16 roundings only (the brute force rounds
    each weight gradient to bf16, and batch-1 kernels round activations differently). A few roundings
    through four layers: norms agree to 4·2⁻⁸ relative, clipped sums to 4·2⁻⁸ of their scale."""
    torch.manual_seed(0)
    model = TokenNet()
    reference = copy.deepcopy(model)
    ids, y = token_batch()
    groups = make_groups(model, "per-param", 1.0)
    engine = ClippingEngine(model, groups, clip_function(clip), loss_reduction="sum")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
        assert logits.dtype == torch.bfloat16
        loss = F.cross_entropy(logits, y, reduction="sum")
    loss.backward()
    sums, examples, norms = pop_step(engine)
    assert examples == len(y)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        grads = per_example_grads(reference, F.cross_entropy, ids, y)
    by_name = dict(zip([n for n, _ in reference.named_parameters()], reference.parameters()))
    ref_groups = make_groups(reference, "per-param", 1.0)
    expected_sums, expected_norms = clipped_sum(grads, ref_groups, clip_function(clip))
    for group in groups:
        torch.testing.assert_close(norms[group.name].double(), expected_norms[group.name],
                                   rtol=4 * BF16_EPS, atol=1e-6)
    for name, p in model.named_parameters():
        got, want = sums[p].double(), expected_sums[by_name[name]].double()
        assert sums[p].dtype == torch.float32  # clipped sums are kept in float32
        assert (got - want).abs().max() <= 4 * BF16_EPS * want.abs().max() + 1e-6, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_generic_fallback_replays_the_autocast_of_the_forward(dtype):
    """nn.MultiheadAttention goes through the torch.func fallback, which re-runs it in the precision its
    forward ran in: per-sample norms match the brute force in the same autocast to 4 roundings."""
    torch.manual_seed(0)
    model = FallbackNet()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(5, 3, 3, generator=g), torch.randint(0, 3, (5,), generator=g)
    groups = make_groups(model, "per-layer", 1.0)
    engine = ClippingEngine(model, groups, clip_function("auto-s"), loss_reduction="sum")
    with torch.autocast("cpu", dtype=dtype):
        loss = F.cross_entropy(model(x), y, reduction="sum")
    loss.backward()
    _, _, norms = pop_step(engine)
    with torch.autocast("cpu", dtype=dtype):
        grads = per_example_grads(reference, F.cross_entropy, x, y)
    _, expected = clipped_sum(grads, make_groups(reference, "per-layer", 1.0), clip_function("auto-s"))
    eps = BF16_EPS if dtype == torch.bfloat16 else FP16_EPS
    for group in groups:
        torch.testing.assert_close(norms[group.name].double(), expected[group.name], rtol=4 * eps, atol=1e-6)


def test_autocast_clipped_contributions_respect_the_bound():
    """Under bf16 autocast with per-layer Abadi clipping at a tiny threshold (every example clipped), each
    group's clipped sum over B examples has norm ≤ B·R, computed in float32."""
    torch.manual_seed(0)
    model = TokenNet()
    ids, y = token_batch()
    groups = make_groups(model, "per-layer", 1e-3)
    engine = ClippingEngine(model, groups, clip_function("abadi"), loss_reduction="sum")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(ids), y, reduction="sum")
    loss.backward()
    sums, _, norms = pop_step(engine)
    for group in groups:
        total = torch.sqrt(sum((sums[p].double() ** 2).sum() for p in group.params))
        assert (norms[group.name] > group.threshold).all()
        assert total <= len(y) * group.threshold * (1 + 1e-6)


# ----------------------------------------------------------------------------- GradScaler
def private_run(*, scale=None, autocast=None, clipping="auto-s", noise=0.0, max_grad_norm=0.05, **kwargs):
    """A private run of summed losses: a GradScaler needs loss_reduction="sum" (a mean would make each
    example's overflow depend on the batch size; see tests/persample/test_invariant_amp.py)."""
    torch.manual_seed(1)
    model = DenseNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = dense_data()
    engine = tunefree.make_private(model, optimizer, DataLoader(TensorDataset(x, y), batch_size=10),
                                   noise_multiplier=noise, target_delta=1e-3, seed=0, steps=4,
                                   clipping=clipping, max_grad_norm=max_grad_norm, loss_reduction="sum",
                                   **kwargs)
    scaler = None
    if scale is not None:
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        engine.optimizer.attach_grad_scaler(scaler)
    return engine, scaler, autocast


def train_step(engine, scaler, autocast, loss_weights=None):
    """One logical step; ``loss_weights`` multiplies each example's loss (to inject an overflow)."""
    for x, y in engine.data_loader:
        engine.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            losses = F.cross_entropy(engine.model(x), y, reduction="none")
        if loss_weights is not None:
            losses = losses * loss_weights[:len(losses)]
        loss = losses.sum()
        if scaler is None:
            loss.backward()
            engine.optimizer.step()
        else:
            scaler.scale(loss).backward()
            if engine.schedule.ends_logical:
                scaler.step(engine.optimizer)
                scaler.update()
        if engine.schedule.ends_logical:
            return [p.grad.detach().clone() for p in engine.model.parameters()]
    raise AssertionError("the loader ended inside a logical batch")


@pytest.mark.parametrize("clipping, threshold", [("auto-s", 0.05), ("abadi", 3.0)])
def test_grad_scaler_release_is_independent_of_the_scale(clipping, threshold):
    """AUTO-S (γ) and Abadi (R, here between the examples' norms) weights are not scale-invariant: were
    the scale left in, 2⁴ and 2¹⁴ would clip differently. Powers of two scale fp16 exactly, so the
    released update is the same bit for bit at every scale (same seed, same noise), and equals the
    float32 run's (no autocast, no scaler) to fp16 precision: 4·2⁻¹¹ of its largest entry."""
    released = {}
    for scale in (2.0 ** 4, 2.0 ** 14):
        engine, scaler, autocast = private_run(scale=scale, autocast=torch.float16, clipping=clipping,
                                               noise=1.0, max_grad_norm=threshold)
        released[scale] = train_step(engine, scaler, autocast)
        assert engine.steps == 1
    engine, scaler, _ = private_run(clipping=clipping, noise=1.0, max_grad_norm=threshold)
    fp32 = train_step(engine, None, None)
    norms = engine.last_step.group_norms["all"]
    if clipping == "abadi":
        assert (norms < threshold).any() and (norms > threshold).any()
    for a, b, c in zip(released[2.0 ** 4], released[2.0 ** 14], fp32):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert (a - c).abs().max() <= 4 * FP16_EPS * c.abs().max()


def test_without_the_scaler_attached_the_loss_scale_would_change_the_update():
    """The check above can fail: clipping the scaled gradients (scaler not attached to the engine)
    gives another update (Abadi, R = 100: no example reaches R, every scaled one does) — and
    scaler.step refuses an unattached scaler outright."""
    engine, scaler, autocast = private_run(scale=2.0 ** 14, autocast=torch.float16, clipping="abadi",
                                           max_grad_norm=100.0)
    attached = train_step(engine, scaler, autocast)
    assert (engine.last_step.group_norms["all"] < 100.0).all()
    engine, _, _ = private_run(autocast=torch.float16, clipping="abadi", max_grad_norm=100.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14)
    x, y = next(iter(engine.data_loader))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(engine.model(x), y, reduction="sum")
    scaler.scale(loss).backward()
    engine.optimizer.step()  # the release of sums clipped with the scale left in
    unattached = [p.grad for p in engine.model.parameters()]
    assert (engine.last_step.group_norms["all"] > 100.0).all()
    assert max((a - b).abs().max() / a.abs().max() for a, b in zip(attached, unattached)) > 0.5

    engine, _, _ = private_run(autocast=torch.float16)
    x, y = next(iter(engine.data_loader))
    scaler.scale(F.cross_entropy(engine.model(x), y, reduction="sum")).backward()
    with pytest.raises(ValueError, match="attach_grad_scaler"):
        scaler.step(engine.optimizer)
    assert engine.steps == 0


def test_overflowing_example_adds_nothing_and_the_step_is_released_and_recorded():
    """An example whose fp16 backward overflows (its loss × 10⁶ at scale 2¹⁶) has infinite output
    gradients: it adds nothing, the other examples' clipped sum is released as if its loss weighed 0, the
    ledger records the step exactly as a clean one, and the scaler (seeing only the public release)
    does not back off."""
    boom = torch.ones(40)
    boom[2] = 1e6
    engine, scaler, autocast = private_run(scale=2.0 ** 16, autocast=torch.float16)
    overflowed = train_step(engine, scaler, autocast, loss_weights=boom)
    absent = boom.clone()
    absent[2] = 0.0
    clean_engine, clean_scaler, _ = private_run(scale=2.0 ** 16, autocast=torch.float16)
    without = train_step(clean_engine, clean_scaler, autocast, loss_weights=absent)
    assert engine.last_step.examples == clean_engine.last_step.examples >= 3
    for a, b in zip(overflowed, without):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert engine.steps == clean_engine.steps == 1
    assert engine.ledger.state_dict() == clean_engine.ledger.state_dict()
    assert scaler.get_scale() == 2.0 ** 16


def test_non_finite_input_of_one_example_is_zeroed_where_it_enters():
    """An inf in one example's features overflows the forward (its loss is NaN): every layer call sees a
    non-finite input or output gradient for it and it adds nothing; the rest is released as if it
    were absent. (A step that checks example independence refuses such a batch: NaN rows never
    compare equal, so the check fails closed.)"""
    grads = {}
    for name, poison in (("inf", True), ("absent", False)):
        engine, scaler, autocast = private_run(scale=2.0 ** 8, autocast=torch.float16)
        train_step(engine, scaler, autocast)  # the first step checks example independence, on clean data
        x, y = next(iter(engine.data_loader))  # the same batch in both runs (same seed)
        assert len(y) >= 3
        x = x.clone()
        x[1, 0] = float("inf")
        keep = torch.ones(len(y))
        keep[1] = 0.0
        engine.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            losses = F.cross_entropy(engine.model(x if poison else x.nan_to_num(posinf=0.0)), y,
                                     reduction="none")
        loss = losses.sum() if poison else (losses * keep).sum()
        assert torch.isfinite(loss).item() is not poison
        scaler.scale(loss).backward()
        scaler.step(engine.optimizer)
        scaler.update()
        grads[name] = [p.grad for p in engine.model.parameters()]
        assert engine.steps == 2
    for a, b in zip(grads["inf"], grads["absent"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_release_overflowing_the_parameter_dtype_is_recorded_and_the_update_skipped():
    """Full float16 parameters and a release beyond float16's range (σ huge): the release is in the
    ledger, the parameters are unchanged and the scaler backs off — a decision on public values."""
    torch.manual_seed(1)
    model = DenseNet().half()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = dense_data()
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(TensorDataset(x.half(), y), batch_size=10),
                                   noise_multiplier=1e9, target_delta=1e-3, seed=0, steps=4,
                                   loss_reduction="sum")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    engine.optimizer.attach_grad_scaler(scaler)
    xb, yb = next(iter(engine.data_loader))
    scaler.scale(F.cross_entropy(model(xb), yb, reduction="sum")).backward()
    scaler.step(engine.optimizer)
    scaler.update()
    assert engine.steps == 1
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.get_scale() == 2.0 ** 3


def test_grad_scaler_with_physical_micro_batches():
    """With micro-batches the scaler steps once per logical batch; a step in the middle is refused."""
    engine, scaler, autocast = private_run(scale=2.0 ** 10, autocast=torch.float16, physical_batch_size=3)
    reference, _, _ = private_run(physical_batch_size=3)
    for _ in range(2):
        got = train_step(engine, scaler, autocast)
        want = train_step(reference, None, None)
        for a, b in zip(got, want):
            assert (a - b).abs().max() <= 4 * FP16_EPS * b.abs().max() + 1e-7
    assert engine.steps == reference.steps == 2
    batches = iter(engine.data_loader)
    while True:
        x, y = next(batches)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(engine.model(x), y, reduction="sum")
        scaler.scale(loss).backward()
        if not engine.schedule.ends_logical:
            break
        scaler.step(engine.optimizer)
        scaler.update()
    with pytest.raises(ValueError, match="ends_logical"):
        scaler.step(engine.optimizer)


def test_attach_grad_scaler_refuses_other_objects():
    engine, _, _ = private_run()
    with pytest.raises(TypeError, match="GradScaler"):
        engine.optimizer.attach_grad_scaler(object())


# ----------------------------------------------------------------------------- full bf16 parameters
def test_full_bf16_parameters_train_in_bf16_with_float32_release():
    """bf16 parameters without autocast: per-sample norms match a bf16 brute force to bf16 precision,
    the release is accumulated in float32 and the parameters are updated in bf16."""
    torch.manual_seed(0)
    model = DenseNet().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    x, y = dense_data(6)
    x = x.to(torch.bfloat16)
    groups = make_groups(model, "per-layer", 1.0)
    engine = ClippingEngine(model, groups, clip_function("auto-s"), loss_reduction="sum")
    F.cross_entropy(model(x), y, reduction="sum").backward()
    sums, _, norms = pop_step(engine)
    grads = per_example_grads(reference, F.cross_entropy, x, y)
    _, expected_norms = clipped_sum(grads, make_groups(reference, "per-layer", 1.0), clip_function("auto-s"))
    for group in groups:
        torch.testing.assert_close(norms[group.name].double(), expected_norms[group.name],
                                   rtol=4 * BF16_EPS, atol=1e-6)
    assert all(s.dtype == torch.float32 for s in sums.values())

    model = DenseNet().to(torch.bfloat16)
    xs, ys = dense_data()
    private = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    DataLoader(TensorDataset(xs.to(torch.bfloat16), ys), batch_size=10),
                                    noise_multiplier=1.0, target_delta=1e-3, seed=0, steps=4,
                                    loss_reduction="sum")  # train_step sums the losses
    before = [p.detach().clone() for p in model.parameters()]
    train_step(private, None, None)
    assert private.steps == 1
    assert all(p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16 for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
