"""The automatic learning rate of HyFreeDP (GeN-DP): the learning rate is fitted from privatised loss
values along the optimizer's private update, at a small share of the privacy budget.

Every ``interval`` steps, after the noisy gradient is in ``.grad``: the update ``Δ = −η·m`` the wrapped
optimizer would make is computed without advancing its state; the closure's per-sample losses at
``w``, ``w + Δ`` and ``w − Δ`` (the current Poisson batch) are clipped at ``R_l``, summed, noised with
standard deviation ``σ_l·R_l`` and divided by the expected batch size; the quadratic through the three
privatised means gives the GeN learning rate ``b/a`` (Bu & Xu 2024), which sets η for this and the next
steps. The weights and the optimizer state are left exactly as they were. The loss releases share the
gradient's sampled batch and are recorded with it as one event.

Safeguards (each documented in :meth:`AutoLearningRate.propose`): slope and curvature are averaged over
updates by inverse noise variance; a non-finite privatised loss keeps η; a loss that rises significantly
along the update halves η; a fit the loss noise cannot resolve grows η by 1.25 while the averaged slope
is positive and a step moves the weights by less than 5% of their norm, and keeps it otherwise; a
resolved fit is clamped to [η/2, 2η] and averaged geometrically with η. On small data sets (digits) the
noise σ_l·R_l/(q·N) exceeds the loss changes between probes and only the safeguards act
(benchmarks/RESULTS.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dp_accounting as dpa
import torch

from .errors import PrivacyError
from .optim import StepComponent, StepContext, UpdateControl
from .privacy.mechanisms import LOSS_PRIVACY, release_loss_sum
from .privacy.randomness import Randomness

DEFAULT_INTERVAL = 5  # K: see benchmarks/RESULTS.md for the measurement behind it
INITIAL_LR = 1e-4  # the paper's initial η (Section 5)
INITIAL_LOSS_BOUND = 1.0  # the paper's initial loss clipping threshold R_l
SIGNIFICANCE = 2.0  # a fitted slope or curvature counts when it exceeds this many noise deviations
SMOOTHING = 0.5  # weight of the new estimate in the geometric average with the previous η
DECAY = 0.5  # weight of earlier updates in the averaged slope and curvature
GROWTH = 1.25  # factor on η when the fit cannot be resolved but the loss falls along the update
MAX_RELATIVE_UPDATE = 0.05  # no unresolved growth once a step moves the weights by 5% of their norm
LOSS_BOUND_FACTOR = 1.0  # R_l = this × the previous privatised mean loss


@dataclass
class Fit:
    """One learning-rate update: the three privatised losses, the fitted quadratic and the outcome."""

    step: int
    lr_before: float
    losses: tuple[float, float, float]  # privatised mean losses at w − Δ, w, w + Δ
    slope: float  # b = Gᵀm
    curvature: float  # a = mᵀHm
    estimate: float  # b/a, the raw GeN learning rate (nan when undefined)
    lr_after: float
    decision: str
    loss_bound: float


@dataclass
class AutoLRState:
    lr: float = INITIAL_LR
    loss_bound: float = INITIAL_LOSS_BOUND
    steps: int = 0
    averages: dict[str, tuple[float, float]] = field(default_factory=dict)
    history: list[Fit] = field(default_factory=list)


class AutoLearningRate(StepComponent):
    """Sets the learning rate of every parameter group of the wrapped optimizer by GeN-DP.

    Args:
        interval: K, the learning rate is refitted every K steps (the first step included).
        loss_noise: σ_l, the noise of each loss release relative to the clipping threshold R_l
            (Gaussian standard deviation, or Laplace scale for ``loss_privacy="laplace"``).
        expected_batch_size: q·N; the noisy loss sums are divided by it.
        randomness: the run's source of noise.
        loss_privacy: ``"gaussian"`` (L2 clipping, the default) or ``"laplace"`` (L1, Table 1).
    """

    def __init__(self, interval: int, loss_noise: float, expected_batch_size: float,
                 randomness: Randomness, loss_privacy: str = "gaussian",
                 initial_lr: float = INITIAL_LR):
        if int(interval) != interval or interval < 1:
            raise ValueError(f"lr_update_interval must be a positive integer, got {interval}")
        if loss_privacy not in LOSS_PRIVACY:
            raise ValueError(f"loss_privacy must be one of {LOSS_PRIVACY}, got {loss_privacy!r}")
        self.interval, self.loss_noise = int(interval), loss_noise
        self.expected_batch_size, self.randomness = expected_batch_size, randomness
        self.loss_privacy = loss_privacy
        self.state = AutoLRState(lr=initial_lr)
        self._relative_update = 0.0

    @property
    def lr(self) -> float:
        return self.state.lr

    def loss_event(self) -> dpa.DpEvent:
        if self.loss_privacy == "gaussian":
            return dpa.GaussianDpEvent(self.loss_noise)
        return dpa.LaplaceDpEvent(self.loss_noise)

    # ------------------------------------------------------------------ the step
    def before_update(self, step: StepContext) -> list[dpa.DpEvent]:
        self.state.steps += 1
        events: list[dpa.DpEvent] = []
        if (self.state.steps - 1) % self.interval == 0:
            if step.closure is None:
                raise ValueError(
                    "lr='auto' refits the learning rate on this step and needs the batch's per-sample "
                    "losses: call optimizer.step(closure) with a closure returning them as a 1-D tensor "
                    "(e.g. lambda: F.cross_entropy(model(x), y, reduction='none'))")
            losses = self._probe(step.update, step.closure, step.report.examples)
            self._update(losses, step.report.step)
            events = [self.loss_event()] * 3
        step.update.set_lr(self.state.lr)
        return events

    def _probe(self, update: UpdateControl, closure: Callable[[], Any], examples: int) -> list[float]:
        """Privatised mean losses at w − Δ, w and w + Δ (Δ the update at the current η)."""
        params = update.params
        saved = [p.detach().clone() for p in params]
        update.set_lr(self.state.lr)
        delta = update.trial_update()
        self._relative_update = math.sqrt(sum(float(d.pow(2).sum()) for d in delta)) / max(
            math.sqrt(sum(float(w.pow(2).sum()) for w in saved)), 1e-12)
        private = []
        try:
            with torch.no_grad():
                for sign in (-1, 0, +1):  # w − Δ, w, w + Δ: steps −η, 0, +η along −m
                    for p, w, d in zip(params, saved, delta):
                        p.copy_(w + sign * d)
                    private.append(self._privatise(_per_sample_losses(closure, examples)))
        finally:
            with torch.no_grad():
                for p, w in zip(params, saved):
                    p.copy_(w)
        return private

    def _privatise(self, losses: torch.Tensor) -> float:
        """Clip each loss to |Lᵢ| ≤ R_l, sum, add noise σ_l·R_l, divide by q·N (equation 7)."""
        bound = self.state.loss_bound
        losses = losses.detach().to(torch.float64)
        clipped = losses * (bound / losses.abs().clamp_min(bound))
        noisy, _ = release_loss_sum(float(clipped.sum()), bound, self.loss_noise, self.loss_privacy,
                                    self.randomness)
        return noisy / self.expected_batch_size

    # ------------------------------------------------------------------ the fit
    def noise_of_mean(self) -> float:
        """Standard deviation of one privatised mean loss (public: σ_l, R_l and q·N)."""
        factor = 1.0 if self.loss_privacy == "gaussian" else math.sqrt(2.0)
        return factor * self.loss_noise * self.state.loss_bound / self.expected_batch_size

    def propose(self, losses: list[float], lr: float, relative_update: float = 0.0
                ) -> tuple[float, float, float, float, str]:
        """The new η from privatised losses at (w − Δ, w, w + Δ), i.e. at steps x = −η, 0, +η of
        ``L(w − x·m) ≈ L(w) − b·x + a·x²/2`` (Δ = −η·m), with the safeguards:

        - a non-finite loss: keep η;
        - the slope b and curvature a are averaged with those of earlier updates, each weighted by the
          inverse of its noise variance (known from σ_l, R_l, q·N and η) with a decay, so that noise
          averages out while the estimate follows the landscape;
        - slope significantly negative (the loss rises along the update): halve η;
        - slope or curvature not resolved from the noise: the probes are too close to tell, grow η;
        - otherwise η_GeN = b/a, clamped to [η/2, 2η] and averaged geometrically with η.
        """
        back, here, forward = losses
        if not all(math.isfinite(v) for v in losses):
            return math.nan, math.nan, math.nan, lr, "non-finite loss: keep"
        noise = self.noise_of_mean()
        slope = (back - forward) / (2 * lr)
        curvature = (back + forward - 2 * here) / lr ** 2
        slope_var = (noise / (math.sqrt(2) * lr)) ** 2
        curvature_var = (noise * math.sqrt(6) / lr ** 2) ** 2
        slope, slope_sd = self._average("slope", slope, slope_var)
        curvature, curvature_sd = self._average("curvature", curvature, curvature_var)
        estimate = slope / curvature if curvature > 0 and slope > 0 else math.nan
        if slope < -SIGNIFICANCE * slope_sd:
            return slope, curvature, estimate, lr / 2, "loss rises along the update: halve"
        if slope <= SIGNIFICANCE * slope_sd or curvature <= SIGNIFICANCE * curvature_sd:
            if slope > 0 and relative_update < MAX_RELATIVE_UPDATE:
                return slope, curvature, estimate, lr * GROWTH, "not resolved, descending: grow"
            return slope, curvature, estimate, lr, "not resolved: keep"
        target = min(max(estimate, lr / 2), 2 * lr)
        new = lr ** (1 - SMOOTHING) * target ** SMOOTHING
        return slope, curvature, estimate, new, "fit"

    def _average(self, name: str, value: float, variance: float) -> tuple[float, float]:
        """Decayed inverse-variance average of a fitted coefficient, and its standard deviation."""
        if variance <= 0:  # no loss noise (σ = 0, debugging): the fit is exact
            return value, 0.0
        weight_sum, weighted = self.state.averages.get(name, (0.0, 0.0))
        weight_sum = DECAY * weight_sum + 1 / variance
        weighted = DECAY * weighted + value / variance
        self.state.averages[name] = (weight_sum, weighted)
        return weighted / weight_sum, weight_sum ** -0.5

    def _update(self, losses: list[float], step: int) -> None:
        state = self.state
        slope, curvature, estimate, new_lr, decision = self.propose(losses, state.lr,
                                                                    self._relative_update)
        state.history.append(Fit(step, state.lr, tuple(losses), slope, curvature, estimate, new_lr,
                                 decision, state.loss_bound))
        state.lr = new_lr
        # R_l for the next update from this one's privatised loss at w (post-processing, Algorithm 1
        # line 8), kept positive if noise drove it below zero.
        if math.isfinite(losses[1]):
            state.loss_bound = max(LOSS_BOUND_FACTOR * losses[1], 1e-3 * state.loss_bound)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.state.lr, "loss_bound": self.state.loss_bound, "steps": self.state.steps,
                "averages": dict(self.state.averages)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.lr, self.state.loss_bound = state["lr"], state["loss_bound"]
        self.state.steps, self.state.averages = state["steps"], dict(state["averages"])


def _per_sample_losses(closure: Callable[[], Any], examples: int) -> torch.Tensor:
    """The closure's losses, checked: one finite loss per example of the step's batch, or the
    sensitivity R_l of the release would not hold."""
    losses = closure()
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
        raise ValueError(
            "with lr='auto' the closure must return the batch's per-sample losses as a 1-D tensor "
            f"(use reduction='none'); got {type(losses).__name__}"
            f"{'' if not isinstance(losses, torch.Tensor) else ' of shape ' + str(tuple(losses.shape))}")
    if losses.numel() != examples:
        raise ValueError(
            f"the closure returned {losses.numel()} losses for a step of {examples} examples: it must "
            "return one loss per example of the whole logical batch the gradient was computed on")
    if not torch.isfinite(losses).all():
        raise PrivacyError(
            "a per-sample loss is NaN or infinite: its clipped value would be undefined, so nothing "
            "is released; check the inputs or lower the learning rate")
    return losses
