"""Invariant: an example's sensitivity never depends on which other examples are in the batch — in 16-bit
precision too.

Under a mean loss each example's gradient is divided by the batch size B before autograd rounds it to
16 bits. With fp16 autocast and a ``GradScaler`` its scaled output gradient is S/B times its own, so
whether it overflows (and is dropped) depends on B: removing one example made the others overflow
(measured 2.2·R, 4.6·R, 15.3·R at B = 5, 16, 64 before the refusal); in bfloat16 how it rounds depends on
B (measured up to 1.019·R at B = 256). The engine refuses 16-bit gradients under a mean loss (and
``attach_grad_scaler`` refuses a mean loss at once); a summed loss makes each example's gradient, its
rounding and its overflow a function of that example alone. Neighbour figures read the released gradient
(``.grad`` × N, noise 0, SGD) directly, not the weights, so that rounding of the weight arithmetic does not
blur them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.marks import slow_case
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.errors import PrivacyError

R = 1.0
BOUND = R * (1 + 1e-6)


class Saturated(nn.Module):
    """Linear → tanh → Linear with a large head: the logits saturate, so every misclassified example has
    an output gradient of ±1 — at a loss scale of 2¹⁶ it overflows float16, below 2¹⁶ it does not."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)
        with torch.no_grad():
            self.b.weight.mul_(100)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 4, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def scaled_release(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """The released clipped sum (noise 0, Abadi at R, q = 1) of one fp16-autocast step under a
    GradScaler of ``scale`` with a summed loss: ``.grad`` × N after ``scaler.step``."""
    torch.manual_seed(0)
    model = Saturated()
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                   DataLoader(TensorDataset(x, y), batch_size=len(x)), target_delta=1e-3,
                                   noise_multiplier=0.0, steps=1, clipping="abadi", max_grad_norm=R,
                                   loss_reduction="sum", seed=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=10**9)
    engine.optimizer.attach_grad_scaler(scaler)
    for xb, yb in engine.data_loader:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(xb).float(), yb, reduction="sum")
        scaler.scale(loss).backward()
        scaler.step(engine.optimizer)
        scaler.update()
    assert engine.steps == 1
    return torch.cat([p.grad.flatten() for p in model.parameters()]) * len(x)


def test_grad_scaler_with_a_mean_loss_is_refused_with_the_fix():
    x, y = batch(8)
    model = Saturated()
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                   DataLoader(TensorDataset(x, y), batch_size=4), target_delta=1e-3,
                                   noise_multiplier=1.0, steps=2)
    with pytest.raises(PrivacyError, match=r"loss_reduction='mean'(.|\n)*depend on how many other "
                                           r"examples(.|\n)*reduction='sum'(.|\n)*loss_reduction='sum'"):
        engine.optimizer.attach_grad_scaler(torch.amp.GradScaler("cpu"))
    assert engine.clipper.loss_scaling.scaler is None  # the one place a scaler is held (persample/amp.py)


@pytest.mark.parametrize("examples", [5, slow_case(16), slow_case(64)])
def test_neighbour_release_under_grad_scaler_is_one_examples_contribution(examples):
    """At scales where no example (2⁸) or some examples (2¹⁶, 2¹⁷: the misclassified ones) overflow, removing
    example j changes the release by exactly j's own contribution (its release alone, to float32
    rounding): no other example's overflow depends on j. So the neighbour distance stays ≤ R."""
    x, y = batch(examples)
    released = {}
    for scale in (2.0 ** 8, 2.0 ** 16, 2.0 ** 17):
        full = released[scale] = scaled_release(x, y, scale)
        keep = torch.ones(examples, dtype=torch.bool)
        worst = worst_residual = 0.0
        for j in range(examples):
            keep[j] = False
            neighbour = scaled_release(x[keep], y[keep], scale)
            own = scaled_release(x[j:j + 1], y[j:j + 1], scale)
            worst = max(worst, (full - neighbour).norm().item())
            worst_residual = max(worst_residual, (full - neighbour - own).norm().item())
            keep[j] = True
        assert worst <= BOUND, f"{worst / R:.3f}·R at B = {examples}, scale {scale:g}"
        assert worst_residual <= 1e-5 * R, f"B = {examples}, scale {scale:g}"
    # The overflow path was exercised: at 2¹⁶ and 2¹⁷ whole contributions were dropped (not roundings).
    for scale in (2.0 ** 16, 2.0 ** 17):
        assert (released[scale] - released[2.0 ** 8]).norm() >= 0.5 * R


def test_why_a_mean_loss_is_refused_one_example_decides_whether_another_overflows():
    """Under a mean loss the float16 output gradient of example 0 is S/B times its own: at S = 2¹⁸ it is
    finite in a batch of 5 and infinite once any other example is removed (B = 4)."""
    x, y = batch(5)
    finite = {}
    for n in (5, 4):
        torch.manual_seed(0)
        model = Saturated()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x[:n])
        logits.retain_grad()
        (F.cross_entropy(logits.float(), y[:n]) * 2.0 ** 18).backward()
        assert logits.grad.dtype == torch.float16
        finite[n] = bool(torch.isfinite(logits.grad[0]).all())
    assert finite == {5: True, 4: False}


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def bf16_release(x: torch.Tensor, y: torch.Tensor, loss_reduction: str) -> torch.Tensor:
    torch.manual_seed(0)
    model = Small()
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                   DataLoader(TensorDataset(x, y), batch_size=len(x)), target_delta=1e-4,
                                   noise_multiplier=0.0, steps=1, clipping="abadi", max_grad_norm=R,
                                   loss_reduction=loss_reduction, seed=0)
    for xb, yb in engine.data_loader:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(xb).float(), yb, reduction=loss_reduction)
        loss.backward()
        engine.optimizer.step()
    return torch.cat([p.grad.flatten() for p in model.parameters()]) * len(x)


def test_bfloat16_gradients_of_a_mean_loss_are_refused_before_anything_is_released():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g), torch.randint(0, 3, (64,), generator=g)
    with pytest.raises(PrivacyError, match=r"loss_reduction='mean' with gradients in float16 or bfloat16"
                                           r"(.|\n)*loss_reduction='sum'"):
        bf16_release(x, y, "mean")
    model = Small().to(torch.bfloat16)  # half-precision parameters, no autocast: the same
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                   DataLoader(TensorDataset(x.to(torch.bfloat16), y), batch_size=8),
                                   target_delta=1e-4, noise_multiplier=1.0, steps=2)
    xb, yb = next(iter(engine.data_loader))
    with pytest.raises(PrivacyError, match="bfloat16"):
        F.cross_entropy(model(xb), yb).backward()
    with pytest.raises(PrivacyError, match="bfloat16"):  # refused again, whatever the step
        F.cross_entropy(model(xb), yb).backward()
    assert engine.optimizer.accumulator.pop().examples == 0 and engine.steps == 0


def test_bfloat16_neighbour_release_of_a_summed_loss_is_exact():
    """With a summed loss each example's bf16 gradient is rounded from its own: removing example j moves
    the release by j's contribution only, ≤ R (a mean loss moved it by 1.005·R here before the refusal)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g) * 0.05, torch.randint(0, 3, (64,), generator=g)
    full = bf16_release(x, y, "sum")
    keep = torch.ones(64, dtype=torch.bool)
    worst = 0.0
    for j in range(0, 64, 4):
        keep[j] = False
        worst = max(worst, (full - bf16_release(x[keep], y[keep], "sum")).norm().item())
        keep[j] = True
    assert worst <= BOUND, f"{worst / R:.4f}·R"
