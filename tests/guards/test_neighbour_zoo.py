"""Issue 9's zoo: no code a user can write may release more than the accounted sensitivity R.

Clean models must stay within R and match the batch-size-1 brute force. Every case of issue 9's table must
either be refused (PrivacyError / ValueError) or keep the neighbour distance ≤ R — and, where the release
can be wrong without exceeding R, match the brute force (or leave a frozen parameter alone).
"""

import pytest
import torch
from support.mixing_models import CenterMix, FunctionMix, TimeMajorLinear, fallback_mix, hook_mix
from support.neighbour import (
    StepContext,
    brute_force_release,
    loss_step,
    neighbour_distance,
    neighbour_distance_of_step,
    relative_error,
    release_of_step,
)
from torch import nn
from torch.nn import functional as F

import tunefree

R = 1.0
BOUND = R * (1 + 1e-6)
EXACT = 1e-4  # relative error of a float32 release against the brute force


def ce(out, y):
    return F.cross_entropy(out, y, reduction="sum")


def data(shape, seed=2, classes=2, integer=None):
    torch.manual_seed(seed)
    x = torch.randint(0, integer, shape) if integer else torch.randn(*shape) * 5
    return x, torch.randint(0, classes, (shape[0],))


def within_bound_or_refused(factory, x, y, step=None):
    """Refused, or within R (and then the full release is returned for further checks)."""
    step = step or loss_step(ce)
    try:
        distance = neighbour_distance_of_step(factory, step, x, y, R)
        full = release_of_step(factory, step, x, y, R)
    except (tunefree.PrivacyError, ValueError):
        return None
    assert distance <= BOUND, f"{distance / R:.2f}·R released"
    return full


def exact_or_refused(factory, x, y):
    """Refused, or the full batch's release matches the brute force and every neighbour stays within R."""
    try:
        full = release_of_step(factory, loss_step(ce), x, y, R)
    except (tunefree.PrivacyError, ValueError):
        return
    error = relative_error(full, brute_force_release(factory, ce, x, y, R))
    assert error <= EXACT, f"release differs from the brute force (relative error {error:.2f})"
    within_bound_or_refused(factory, x, y)


# ---------------------------------------------------------------------------------------- clean zoo
class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4 * 4 * 4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.conv(x))).flatten(1))


class TransformerBatchFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.TransformerEncoderLayer(6, 2, 8, dropout=0.0, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.block(x).mean(1))


class TiedEmbedding(nn.Module):
    """Embedding with an output head that is an nn.Linear sharing the embedding's weight."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, x):
        return self.head(torch.tanh(self.tok(x)).mean(1))


class LSTMBatchFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def mlp():
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 2))


@pytest.mark.parametrize(("factory", "shape", "integer", "classes"), [
    (mlp, (5, 3), None, 2),
    (SmallCNN, (4, 1, 6, 6), None, 2),
    (TransformerBatchFirst, (4, 3, 6), None, 2),
    (TiedEmbedding, (4, 3), 7, 7),
    (LSTMBatchFirst, (4, 3, 3), None, 2),
], ids=["mlp", "cnn-groupnorm", "transformer-batch-first", "tied-embedding", "lstm-batch-first"])
def test_clean_model_stays_within_R_and_matches_brute_force(factory, shape, integer, classes):
    x, y = data(shape, integer=integer, classes=classes)
    assert neighbour_distance(factory, ce, x, y, R) <= BOUND
    full = release_of_step(factory, loss_step(ce), x, y, R)
    assert relative_error(full, brute_force_release(factory, ce, x, y, R)) <= EXACT


# --------------------------------------------------------------------- example-mixing computations
@pytest.mark.parametrize(("factory", "shape"), [(CenterMix, (5, 3)), (TimeMajorLinear, (4, 4, 3))])
def test_example_mixing_is_refused_or_bounded(factory, shape):
    x, y = data(shape)
    within_bound_or_refused(factory, x, y)


class TimeMajorAttention(nn.Module):
    """A correct user model: x [B, T, F] is handed to batch_first=False attention as [T, B, F]."""

    def __init__(self, encoder_layer):
        super().__init__()
        self.encoder_layer = encoder_layer
        self.attn = (nn.TransformerEncoderLayer(6, 2, 8, dropout=0.0) if encoder_layer
                     else nn.MultiheadAttention(6, 2))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        h = x.transpose(0, 1)
        h = self.attn(h) if self.encoder_layer else self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.transpose(0, 1).mean(1))


@pytest.mark.parametrize("encoder_layer", [False, True], ids=["multihead-attention", "encoder-layer"])
@pytest.mark.parametrize("steps", [4, 3], ids=["T==B", "T!=B"])
def test_batch_second_attention_is_exact_or_refused(encoder_layer, steps):
    x, y = data((4, steps, 6))
    exact_or_refused(lambda: TimeMajorAttention(encoder_layer), x, y)


@pytest.mark.parametrize("factory", [fallback_mix, FunctionMix, hook_mix],
                         ids=["fallback-forward", "function-backward", "full-backward-hook"])
def test_mixing_module_function_or_hook_is_refused_or_bounded(factory):
    x, y = data((4, 3))
    within_bound_or_refused(factory, x, y)


# ------------------------------------------------------------------ several backward passes per step
def two_losses(ctx: StepContext):
    out = ctx.model(ctx.x)
    ce(out, ctx.y).backward()
    ce(ctx.model(ctx.x), ctx.y).backward()


def fgsm(ctx: StepContext):
    x = ctx.x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ce(ctx.model(x), ctx.y), x)
    ce(ctx.model(ctx.x + 0.5 * g.sign()), ctx.y).backward()


def pgd3(ctx: StepContext):
    x = ctx.x.clone()
    for _ in range(3):
        x.requires_grad_(True)
        (g,) = torch.autograd.grad(ce(ctx.model(x), ctx.y), x)
        x = (x + 0.5 * g.sign()).detach()
    ce(ctx.model(x), ctx.y).backward()


def accumulation(ctx: StepContext):
    for half in (ctx.x, ctx.x):
        ce(ctx.model(half), ctx.y).backward()


@pytest.mark.parametrize("step", [two_losses, fgsm, pgd3, accumulation],
                         ids=["two-losses", "fgsm", "pgd-3", "accumulation"])
def test_several_backward_passes_are_refused_or_bounded(step):
    x, y = data((4, 3))
    within_bound_or_refused(lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), x, y, step)


def test_fgsm_inside_no_capture_stays_within_R():
    def step(ctx: StepContext):
        with ctx.engine.clipper.no_capture():
            x = ctx.x.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(ce(ctx.model(x), ctx.y), x)
        ce(ctx.model(ctx.x + 0.5 * g.sign()), ctx.y).backward()
    x, y = data((4, 3))
    factory = lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))  # noqa: E731
    assert neighbour_distance_of_step(factory, step, x, y, R) <= BOUND


# ------------------------------------------------------ the trainable set changes after make_private
def frozen_first_layer():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    return model


def unfreeze_into_original_optimizer(ctx: StepContext):
    ctx.model[0].requires_grad_(True)
    ctx.optimizer.add_param_group({"params": list(ctx.model[0].parameters())})
    ce(ctx.model(ctx.x), ctx.y).backward()


def unfreeze_into_param_groups(ctx: StepContext):
    ctx.model[0].requires_grad_(True)
    ctx.engine.optimizer.param_groups.append({**ctx.engine.optimizer.param_groups[0],
                                              "params": list(ctx.model[0].parameters())})
    ce(ctx.model(ctx.x), ctx.y).backward()


def append_module(ctx: StepContext):
    ctx.model.append(nn.Linear(2, 2))
    ctx.optimizer.add_param_group({"params": list(ctx.model[-1].parameters())})
    ce(ctx.model(ctx.x), ctx.y).backward()


@pytest.mark.parametrize(("factory", "step"), [
    (frozen_first_layer, unfreeze_into_original_optimizer),
    (frozen_first_layer, unfreeze_into_param_groups),
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), append_module),
], ids=["original-optimizer", "param-groups-append", "module-appended"])
def test_parameters_added_after_make_private_are_refused_or_bounded(factory, step):
    x, y = data((4, 3))
    within_bound_or_refused(factory, x, y, step)


def test_requires_grad_false_after_make_private_is_refused_or_respected():
    def freeze(ctx: StepContext):
        ctx.model[0].requires_grad_(False)
        ce(ctx.model(ctx.x), ctx.y).backward()
    x, y = data((4, 3))
    full = within_bound_or_refused(lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
                                   x, y, freeze)
    if full is not None:
        assert full["0.weight"].abs().max() == 0 and full["0.bias"].abs().max() == 0, \
            "a parameter frozen after make_private was still updated"


# ------------------------------------------------------------------------ fallback units and hooks
class PositionalBlock(nn.Module):
    """A fallback unit (bare nn.Parameter) that receives a shared [T, F] table and a [T, T] mask."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Parameter(torch.eye(4) + 0.1 * torch.randn(4, 4))

    def forward(self, h, pos, mask):
        h = (h + pos) @ self.mix
        scores = (h @ h.transpose(1, 2)).masked_fill(mask, -1e4)
        return scores.softmax(-1) @ h


class PositionalModel(nn.Module):
    def __init__(self, steps=4):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.register_buffer("pos", torch.randn(steps, 4))
        self.register_buffer("mask", torch.triu(torch.ones(steps, steps, dtype=torch.bool), 1))
        self.block = PositionalBlock()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(self.inp(x), self.pos, self.mask).mean(1))


def test_shared_table_and_mask_in_fallback_unit_when_batch_equals_steps():
    x, y = data((4, 4, 3))  # B == T == 4
    exact_or_refused(PositionalModel, x, y)


class TiedInFallback(nn.Module):
    """GPT-style: a fallback unit (bare positional nn.Parameter) whose head reads its child's weight."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(7, 4)
        self.pos = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        return F.linear(torch.tanh(self.tok(x) + self.pos).mean(1), self.tok.weight)


class TiedInSiblingFallback(nn.Module):
    """The tied weight read by a sibling fallback unit: F.linear(h, tok.weight) next to a bare Parameter."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(7, 4)
        self.lm = TiedHead(self.tok)

    def forward(self, x):
        return self.lm(torch.tanh(self.tok(x)).mean(1))


class TiedHead(nn.Module):
    def __init__(self, tok):
        super().__init__()
        self.tok = [tok]  # not registered: the weight is read, not owned
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, h):
        return F.linear(h * self.scale, self.tok[0].weight)


@pytest.mark.parametrize("factory", [TiedInFallback, TiedInSiblingFallback], ids=["parent", "sibling"])
def test_tied_head_read_inside_fallback_unit_is_exact_or_refused(factory):
    x, y = data((4, 3), integer=7, classes=7)
    exact_or_refused(factory, x, y)


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4) + 0.3)

    def forward(self, h):
        return h * self.scale


def hooked_linear():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].register_forward_hook(lambda m, i, out: torch.sin(out) * 2)
    return model


def hooked_fallback():
    model = nn.Sequential(nn.Linear(3, 4), Scale(), nn.Tanh(), nn.Linear(4, 2))
    model[1].register_forward_hook(lambda m, i, out: torch.sin(out) * 2)
    return model


@pytest.mark.parametrize("factory", [hooked_linear, hooked_fallback], ids=["rule-unit", "fallback-unit"])
def test_user_forward_hook_that_changes_an_output_is_exact_or_refused(factory):
    x, y = data((4, 3))
    exact_or_refused(factory, x, y)
