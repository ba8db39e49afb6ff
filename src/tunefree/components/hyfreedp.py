"""HyFreeDP's learning rate (GeN-DP): HyFreeDP paper, Algorithm 1 and its end-to-end accounting
(Algorithm 2). Built on the public extension points only (``tunefree.extend``: :class:`StepComponent`,
:class:`StepContext`, :class:`Share`), as a component of your own would be.

Every ``interval`` (K) steps, after the noisy gradient is in ``.grad`` (lines 6-11): the update
``Δ = −η·m`` the wrapped optimizer would make is computed without advancing its state; the batch's
per-sample losses at ``w − Δ``, ``w`` and ``w + Δ`` (the user's closure) are each clipped to
``|Lᵢ| ≤ R_l``, summed, released with Gaussian noise ``σ_l·R_l`` and divided by q·N (equation 7); the
quadratic through the three values gives ``η = b/a`` (equation 6, line 11). The weights and the optimizer
state are left exactly as they were. The next update's ``R_l`` is the sum of the three privatised losses
(Section 4.1, the paper's practice "to avoid the clipping bias"); where ``b/a`` is no minimiser
(``a ≤ 0`` or ``b ≤ 0``), which the paper leaves open, η is kept. Both are post-processing.

Accounting: the three loss releases share the gradient's Poisson-sampled batch and are recorded with it
as one event; the gradient noise grows by γ (``gradient_noise_increase``) and the plan solves σ_l so that
the whole run spends what plain DP-SGD at σ would (Algorithm 2, equation 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import dp_accounting as dpa
import torch

from .._validate import count, positive
from ..errors import PrivacyError
from ..privacy.plan import Share
from ..step.component import StepComponent, StepContext

INITIAL_LR = 1e-4  # the paper's initial η (Section 5)
INITIAL_LOSS_BOUND = 1.0  # the paper's initial loss clipping threshold R_l
NOISE_INCREASE = 1.01  # γ, the paper's gradient noise increase (equation 10)
RELEASES = 3  # privatised losses at w − Δ, w, w + Δ


@dataclass(frozen=True)
class HyFreeDP:
    """``lr=HyFreeDP()``: the learning rate of any optimizer, fitted every ``interval`` steps (K, the
    paper's 5) to privatised losses of the current batch, from ``initial_lr`` (the paper's 10⁻⁴) on;
    ``optimizer.step(closure)`` must return the batch's per-sample losses. The gradient noise grows by
    ``gradient_noise_increase`` (γ > 1) to pay for the losses, so that the whole run spends what plain
    DP-SGD would. None of them changes ε: every release is accounted on the plan. On the benchmark tasks
    it does not match a tuned learning rate (benchmarks/RESULTS.md §5)."""

    interval: int = 5
    gradient_noise_increase: float = NOISE_INCREASE
    initial_lr: float = INITIAL_LR

    def __post_init__(self) -> None:
        count("HyFreeDP.interval", self.interval)
        if positive("HyFreeDP.gradient_noise_increase", self.gradient_noise_increase) <= 1:
            raise ValueError("HyFreeDP.gradient_noise_increase must be > 1 (it pays for the loss releases), "
                             f"got {self.gradient_noise_increase}")
        positive("HyFreeDP.initial_lr", self.initial_lr)

    def share(self) -> LossShare:
        """Its share of the budget: three loss releases on every ``interval``-th step."""
        return LossShare(self.interval, self.gradient_noise_increase)


@dataclass(frozen=True)
class LossShare(Share):
    """Every ``interval``-th step (the first included) releases three losses, each a Gaussian release of
    multiplier ``noise`` (σ_l, solved by the plan); the noise of every step grows by ``increase`` (γ)."""

    before_update: ClassVar[bool] = True  # the learning rate is fitted before the update

    interval: int
    increase: float = NOISE_INCREASE
    noise: float = 0.0

    @property
    def period(self) -> int:
        return self.interval

    def releases(self, step: int, sigma: float) -> list[dpa.DpEvent]:
        return [dpa.GaussianDpEvent(self.noise)] * RELEASES if (step - 1) % self.interval == 0 else []


@dataclass
class Fit:
    """One learning-rate update: the privatised mean losses at w − Δ, w, w + Δ, the fitted slope b = Gᵀm
    and curvature a = mᵀHm, the learning rate set and the loss bound R_l the losses were clipped with."""

    step: int
    losses: tuple[float, float, float]
    slope: float
    curvature: float
    lr: float
    loss_bound: float


def gen_learning_rate(losses: tuple[float, float, float], lr: float) -> tuple[float, float, float]:
    """Slope b and curvature a of ``L(w − x·m) ≈ L(w) − b·x + a·x²/2`` through the losses at x = −η, 0,
    +η (equation 6 with three points), and the new learning rate b/a (line 11), or η where b/a is no
    minimiser (a ≤ 0 or b ≤ 0)."""
    back, here, forward = losses
    slope, curvature = (back - forward) / (2 * lr), (back + forward - 2 * here) / lr ** 2
    return slope, curvature, slope / curvature if slope > 0 and curvature > 0 else lr


class HyFreeDPStep(StepComponent):
    """Sets the learning rate of every parameter group of the wrapped optimizer by GeN-DP.

    Args:
        settings: the interval K and the initial η.
        loss_noise: σ_l, the noise multiplier of each loss release (relative to R_l), from the plan.
    """

    state_key = "HyFreeDP"
    closure_gives_per_sample_losses = True

    def __init__(self, settings: HyFreeDP, loss_noise: float):
        self.interval, self.loss_noise = settings.interval, loss_noise
        self.lr, self.loss_bound, self.steps = settings.initial_lr, INITIAL_LOSS_BOUND, 0
        self.history: list[Fit] = []

    def before_update(self, step: StepContext) -> None:
        self.steps += 1
        if (self.steps - 1) % self.interval == 0:
            losses = self.released_losses(step)
            slope, curvature, lr = gen_learning_rate(losses, self.lr)
            self.history.append(Fit(step.report.step, losses, slope, curvature, lr, self.loss_bound))
            bound = sum(losses)  # R_l = Σ_k L̃^(k) (Section 4.1)
            self.loss_bound = bound if bound > 0 else self.loss_bound
            self.lr = lr
        step.update.set_lr(self.lr)

    def released_losses(self, step: StepContext) -> tuple[float, float, float]:
        """The privatised mean losses at w − Δ, w and w + Δ, Δ the update at the current η (lines 7-8)."""
        if step.closure is None:
            raise ValueError(
                "HyFreeDP's learning rate refits on this step and needs the batch's per-sample losses: "
                "call optimizer.step(closure) with a closure returning them as a 1-D tensor "
                "(e.g. lambda: F.cross_entropy(model(x), y, reduction='none'))")
        params = step.update.params
        saved = [p.detach().clone() for p in params]
        step.update.set_lr(self.lr)
        delta = step.update.trial_update()
        clipped = []
        try:
            with torch.no_grad():
                for sign in (-1, 0, 1):
                    for p, w, d in zip(params, saved, delta):
                        p.copy_(w + sign * d)
                    losses = _checked(step.closure(), step.report.examples).to(torch.float64)
                    clipped.append(losses.clamp(-self.loss_bound, self.loss_bound).sum())
        finally:
            with torch.no_grad():
                for p, w in zip(params, saved):
                    p.copy_(w)
        back, here, forward = (float(step.release(c.reshape(1), self.loss_bound, self.loss_noise)[0])
                               / step.expected_batch_size for c in clipped)
        return back, here, forward

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "loss_bound": self.loss_bound, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr, self.loss_bound, self.steps = state["lr"], state["loss_bound"], state["steps"]


def _checked(losses: Any, examples: int) -> torch.Tensor:
    """Per-sample losses, checked: one finite loss per example of the step's batch, or the sensitivity
    of the release would not hold."""
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
        shape = f" of shape {tuple(losses.shape)}" if isinstance(losses, torch.Tensor) else ""
        raise ValueError("with HyFreeDP's learning rate the closure must give the batch's per-sample losses "
                         f"as a 1-D tensor (use reduction='none'); got {type(losses).__name__}{shape}")
    if losses.numel() != examples:
        raise ValueError(f"the closure gave {losses.numel()} losses for a step of {examples} examples: it "
                         "must give one loss per example of the whole logical batch the gradient was "
                         "computed on")
    if not torch.isfinite(losses).all():
        raise PrivacyError("a per-sample loss is NaN or infinite: its clipped value would be undefined, so "
                           "nothing is released; check the inputs or lower the learning rate")
    return losses.detach()
