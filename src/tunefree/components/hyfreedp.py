"""The automatic learning rate of HyFreeDP (GeN-DP): the learning rate is fitted from privatised loss
values along the optimizer's private update, at a small share of the privacy budget.

Every ``interval`` steps, after the noisy gradient is in ``.grad``: the update ``Δ = −η·m`` the wrapped
optimizer would make is computed without advancing its state; the per-sample losses at ``w − Δ``, ``w``
and ``w + Δ`` on the current Poisson batch are privatised, and the quadratic through the three values
gives the GeN learning rate ``b/a`` (Bu & Xu 2024). The weights and the optimizer state are left exactly
as they were. The releases share the gradient's sampled batch and are recorded with it as one event.

Two mechanisms (``probes``):

- ``"losses"`` (the paper, equation 7): each point's losses are clipped to ``|Lᵢ| ≤ R_l``, summed,
  noised with standard deviation ``σ_l·R_l`` and divided by q·N: three releases. ``R_l`` for the next
  update is the sum of the three privatised losses (the paper's stated practice, "to avoid the clipping
  bias"), which is post-processing.
- ``"differences"``: the per-sample differences ``Lᵢ(w ± Δ) − Lᵢ(w)`` are clipped to ``R_d`` and
  released the same way: two releases, with a bound R_d far below R_l; ``L(w)`` itself is never
  released. R_d follows the released differences (see :meth:`AutoLearningRate._next_bound`).

Two rules (``mode``): ``"paper"`` sets η to the fitted ``b/a`` (Algorithm 1, line 11) and keeps η only
when that value is undefined (``a ≤ 0``, ``b ≤ 0`` or a non-finite loss — the paper does not say what to
do then); ``"safeguarded"`` adds the safeguards documented in :meth:`AutoLearningRate.propose`.

``L(w)`` is taken from the training forward when the caller hands its per-sample losses over with
:meth:`AutoLearningRate.record_training_losses` (Algorithm 1, line 2); otherwise the closure is
evaluated at ``w`` as well.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import dp_accounting as dpa
import torch

from .._validate import count, one_of, positive
from ..errors import PrivacyError
from ..parallel.base import DDP, ONE_PROCESS
from ..privacy.mechanisms import LOSS_PRIVACY, SINGLE_PROCESS, Reduction, release_loss_sum
from ..privacy.plan import LossShare
from ..privacy.randomness import NoiseSource
from ..step.component import StepComponent, StepContext, UpdateControl

MODES = ("safeguarded", "paper")
PROBES = ("losses", "differences")
INITIAL_LR = 1e-4  # the paper's initial η (Section 5)
INITIAL_LOSS_BOUND = 1.0  # the paper's initial loss clipping threshold R_l (also the first R_d)
SIGNIFICANCE = 2.0  # a fitted slope or curvature counts when it exceeds this many noise deviations
SMOOTHING = 0.5  # weight of the new estimate in the geometric average with the previous η
DECAY = 0.5  # weight of earlier updates in the averaged slope and curvature
GROWTH = 1.25  # factor on η when the fit cannot be resolved but the loss falls along the update
MAX_RELATIVE_UPDATE = 0.05  # no unresolved growth once a step moves the weights by 5% of their norm
DIFFERENCE_BOUND_FACTOR = 4.0  # R_d ≥ this × the larger privatised mean difference (scaled to the new η)
DIFFERENCE_SIGNAL_TO_NOISE = 4.0  # R_d as large as keeps the mean difference this many noise deviations up


@dataclass(frozen=True)
class HyFreeDP:
    """HyFreeDP (GeN-DP) for any optimizer: every ``interval`` steps the learning rate is fitted to
    privatised losses of the current batch (``step(closure)`` must return per-sample losses); the
    gradient noise grows by ``gradient_noise_increase`` (> 1) so that the whole run spends what plain
    DP-SGD would. ``mode="paper"`` sets η to the fitted value (HyFreeDP, Algorithm 1),
    ``"safeguarded"`` adds the safeguards of :meth:`AutoLearningRate.propose`. ``probes``: ``"losses"``
    releases three clipped losses per update (the paper), ``"differences"`` two clipped per-sample loss
    differences Lᵢ(w ± Δ) − Lᵢ(w). ``initial_lr`` is η before the first fit (the paper's 10⁻⁴);
    ``loss_privacy`` is ``"gaussian"`` or ``"laplace"``. None of them changes ε: every release is
    accounted on the plan. On the benchmark tasks it does not match a tuned learning rate
    (benchmarks/RESULTS.md §5)."""

    # under DDP every rank's loss sums are summed and noised once; under FSDP2 its trial update would read
    # norms of sharded parameters
    parallelisms: ClassVar[tuple[str, ...]] = (ONE_PROCESS, DDP)

    interval: int = 5  # K: see benchmarks/RESULTS.md for the measurement behind it
    loss_privacy: str = "gaussian"
    gradient_noise_increase: float = 1.01
    mode: str = "safeguarded"
    probes: str = "losses"
    initial_lr: float = INITIAL_LR

    def __post_init__(self) -> None:
        count("AutoLR.interval", self.interval)
        one_of("AutoLR.loss_privacy", self.loss_privacy, LOSS_PRIVACY)
        if positive("AutoLR.gradient_noise_increase", self.gradient_noise_increase) <= 1:
            raise ValueError("AutoLR.gradient_noise_increase must be > 1 (it pays for the loss releases), "
                             f"got {self.gradient_noise_increase}")
        one_of("AutoLR.mode", self.mode, MODES)
        one_of("AutoLR.probes", self.probes, PROBES)
        positive("AutoLR.initial_lr", self.initial_lr)

    @property
    def releases_per_update(self) -> int:
        """Values released at each learning-rate update: three losses or two differences."""
        return 3 if self.probes == "losses" else 2

    def share(self) -> LossShare:
        """Its share of the budget: the loss releases of every ``interval``-th step."""
        return LossShare(self.interval, self.loss_privacy, self.gradient_noise_increase,
                         self.releases_per_update)


@dataclass
class Fit:
    """One learning-rate update: the privatised values, the fitted quadratic and the outcome."""

    step: int
    lr_before: float
    losses: tuple[float, float, float]  # privatised mean losses at w − Δ, w, w + Δ (differences: L(w) = 0)
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
        settings: the rule (interval K, loss privacy, probes, mode, initial η).
        loss_noise: σ_l, the noise of each release relative to its clipping bound (R_l or R_d)
            (Gaussian standard deviation, or Laplace scale for ``loss_privacy="laplace"``).
        expected_batch_size: q·N; the noisy sums are divided by it.
        randomness: the run's source of noise.
        parallelism: the run's; under several processes each loss sum is every process's, noised once.
    """

    state_key = "AutoLearningRate"
    closure_gives_per_sample_losses = True

    def __init__(self, settings: HyFreeDP, loss_noise: float, expected_batch_size: float,
                 randomness: NoiseSource, parallelism: Reduction = SINGLE_PROCESS):
        self.settings, self.loss_noise = settings, loss_noise
        self.interval, self.loss_privacy = settings.interval, settings.loss_privacy
        self.mode, self.probes = settings.mode, settings.probes
        self.expected_batch_size, self.randomness = expected_batch_size, randomness
        self.parallelism = parallelism
        self.state = AutoLRState(lr=settings.initial_lr)
        self._relative_update = 0.0
        self._training_losses: list[torch.Tensor] = []
        self._events: list[dpa.DpEvent] = []  # the events of the releases of the update in progress

    @property
    def lr(self) -> float:
        return self.state.lr

    @property
    def releases_per_update(self) -> int:
        """Private values released at each learning-rate update: 3 losses or 2 differences."""
        return self.settings.releases_per_update

    def record_training_losses(self, losses: torch.Tensor) -> None:
        """Hand over the per-sample losses of the training forward at ``w`` (of one physical batch;
        call once per micro-batch), so that the update reuses them as ``L(w)`` instead of running the
        closure at ``w`` again. They are released (or used) only as the update's ``L(w)``."""
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
            raise ValueError("record_training_losses takes the per-sample losses as a 1-D tensor "
                             "(use reduction='none')")
        self._training_losses.append(losses.detach())

    # ------------------------------------------------------------------ the step
    def before_update(self, step: StepContext) -> list[dpa.DpEvent]:
        self.state.steps += 1
        events: list[dpa.DpEvent] = []
        training, self._training_losses = self._training_losses, []
        if (self.state.steps - 1) % self.interval == 0:
            if step.closure is None:
                raise ValueError(
                    "HyFreeDP's learning rate refits on this step and needs the batch's per-sample "
                    "losses: call optimizer.step(closure) with a closure returning them as a 1-D tensor "
                    "(e.g. lambda: F.cross_entropy(model(x), y, reduction='none'))")
            here = None
            if training:
                here = _checked(torch.cat(training), step.report.examples, "record_training_losses")
            values, events = self._probe(step.update, step.closure, step.report.examples, here)
            self._update(values, step.report.step)
        step.update.set_lr(self.state.lr)
        return events

    def _probe(self, update: UpdateControl, closure: Callable[[], Any], examples: int,
               here: torch.Tensor | None = None) -> tuple[list[float], list[dpa.DpEvent]]:
        """Privatised mean values at w − Δ, w and w + Δ (Δ the update at the current η): losses, or
        differences to ``L(w)`` (whose own value is then 0 and not released), with the events of their
        releases as the mechanism returned them. ``here`` is ``L(w)`` per sample from the training
        forward, if handed over."""
        params = update.params
        saved = [p.detach().clone() for p in params]
        update.set_lr(self.state.lr)
        delta = update.trial_update()
        self._relative_update = math.sqrt(sum(float(d.pow(2).sum()) for d in delta)) / max(
            math.sqrt(sum(float(w.pow(2).sum()) for w in saved)), 1e-12)
        try:
            with torch.no_grad():
                def losses_at(sign: int) -> torch.Tensor:  # w + sign·Δ
                    for p, w, d in zip(params, saved, delta):
                        p.copy_(w + sign * d)
                    return _checked(closure(), examples, "the closure")

                if here is None:
                    here = losses_at(0)
                back, forward = losses_at(-1), losses_at(+1)
        finally:
            with torch.no_grad():
                for p, w in zip(params, saved):
                    p.copy_(w)
        if self.probes == "differences":
            released = [self._privatise(back - here), None, self._privatise(forward - here)]
        else:
            released = [self._privatise(back), self._privatise(here), self._privatise(forward)]
        values = [0.0 if r is None else r[0] for r in released]
        return values, [r[1] for r in released if r is not None]

    def _privatise(self, values: torch.Tensor) -> tuple[float, dpa.DpEvent]:
        """Clip each value to |vᵢ| ≤ R, sum, add noise σ_l·R, divide by q·N (equation 7); the mean
        and the event of its release."""
        bound = self.state.loss_bound
        values = values.detach().to(torch.float64)
        clipped = values * (bound / values.abs().clamp_min(bound))
        noisy, event = release_loss_sum(float(clipped.sum()), bound, self.loss_noise, self.loss_privacy,
                                        self.randomness, self.parallelism)
        return noisy / self.expected_batch_size, event

    # ------------------------------------------------------------------ the fit
    def noise_of_mean(self) -> float:
        """Standard deviation of one privatised mean value (public: σ_l, the bound and q·N)."""
        factor = 1.0 if self.loss_privacy == "gaussian" else math.sqrt(2.0)
        return factor * self.loss_noise * self.state.loss_bound / self.expected_batch_size

    @staticmethod
    def quadratic(values: list[float], lr: float) -> tuple[float, float]:
        """Slope b and curvature a of ``L(w − x·m) ≈ L(w) − b·x + a·x²/2`` through the values at
        x = −η, 0, +η (w − Δ, w, w + Δ with Δ = −η·m): equation 6 with three points."""
        back, here, forward = values
        return (back - forward) / (2 * lr), (back + forward - 2 * here) / lr ** 2

    def propose_paper(self, values: list[float], lr: float) -> tuple[float, float, float, float, str]:
        """Algorithm 1, lines 9-11: η = b/a. Where b/a is no minimiser (a ≤ 0 or b ≤ 0) or a value is
        not finite, the paper gives no rule and η is kept."""
        if not all(math.isfinite(v) for v in values):
            return math.nan, math.nan, math.nan, lr, "non-finite loss: keep"
        slope, curvature = self.quadratic(values, lr)
        if curvature > 0 and slope > 0:
            return slope, curvature, slope / curvature, slope / curvature, "fit"
        return slope, curvature, math.nan, lr, "no minimiser along the update: keep"

    def propose(self, losses: list[float], lr: float, relative_update: float = 0.0
                ) -> tuple[float, float, float, float, str]:
        """The safeguarded new η from privatised values at (w − Δ, w, w + Δ), i.e. at steps
        x = −η, 0, +η (see :meth:`quadratic`):

        - a non-finite loss: keep η;
        - the slope b and curvature a are averaged with those of earlier updates, each weighted by the
          inverse of its noise variance (known from σ_l, the bound, q·N and η) with a decay, so that
          noise averages out while the estimate follows the landscape;
        - slope significantly negative (the loss rises along the update): halve η;
        - slope or curvature not resolved from the noise: the probes are too close to tell; grow η by
          1.25 while the slope is positive and a step moves the weights by less than 5% of their
          norm, keep it otherwise;
        - otherwise η_GeN = b/a, clamped to [η/2, 2η] and averaged geometrically with η.
        """
        if not all(math.isfinite(v) for v in losses):
            return math.nan, math.nan, math.nan, lr, "non-finite loss: keep"
        noise = self.noise_of_mean()
        slope, curvature = self.quadratic(losses, lr)
        second_difference = 6 if self.probes == "losses" else 2  # var(L₋ + L₊ − 2L₀) / n²; L₀ = 0 exact
        slope_var = (noise / (math.sqrt(2) * lr)) ** 2
        curvature_var = second_difference * (noise / lr ** 2) ** 2
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

    def _update(self, values: list[float], step: int) -> None:
        state = self.state
        if self.mode == "paper":
            slope, curvature, estimate, new_lr, decision = self.propose_paper(values, state.lr)
        else:
            slope, curvature, estimate, new_lr, decision = self.propose(values, state.lr,
                                                                        self._relative_update)
        state.history.append(Fit(step, state.lr, tuple(values), slope, curvature, estimate, new_lr,
                                 decision, state.loss_bound))
        state.loss_bound = self._next_bound(values, state.lr, new_lr)
        state.lr = new_lr

    def _next_bound(self, values: list[float], lr: float, new_lr: float) -> float:
        """The clipping bound of the next update, from this one's released values (post-processing).

        Losses: R_l = Σ_k L̃^(k), the sum of the three privatised mean losses (Section 4.1, "to avoid
        the clipping bias"). Differences: per-sample differences spread far wider than their mean, so
        R_d is the largest bound at which the larger privatised mean difference d stays 4 noise
        deviations above the noise (σ_l·R_d/(q·N) = |d|/4), and at least 4|d|; both scaled by
        new η / η, since differences grow with the step. A bound that is not positive and finite
        (noise) keeps the current one."""
        if self.probes == "losses":
            bound = sum(values)
        else:
            largest = max(abs(values[0]), abs(values[2]))
            factor = DIFFERENCE_BOUND_FACTOR
            if self.loss_noise > 0:
                widest = self.expected_batch_size / (DIFFERENCE_SIGNAL_TO_NOISE * self.loss_noise)
                factor = max(factor, widest)
            bound = factor * largest * new_lr / lr
        return bound if bound > 0 and math.isfinite(bound) else self.state.loss_bound

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.state.lr, "loss_bound": self.state.loss_bound, "steps": self.state.steps,
                "averages": dict(self.state.averages)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.lr, self.state.loss_bound = state["lr"], state["loss_bound"]
        self.state.steps, self.state.averages = state["steps"], dict(state["averages"])


def _checked(losses: Any, examples: int, source: str) -> torch.Tensor:
    """Per-sample losses, checked: one finite loss per example of the step's batch, or the
    sensitivity of the release would not hold."""
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
        raise ValueError(
            f"with HyFreeDP's learning rate {source} must give the batch's per-sample losses as a 1-D tensor "
            f"(use reduction='none'); got {type(losses).__name__}"
            f"{'' if not isinstance(losses, torch.Tensor) else ' of shape ' + str(tuple(losses.shape))}")
    if losses.numel() != examples:
        raise ValueError(
            f"{source} gave {losses.numel()} losses for a step of {examples} examples: it must "
            "give one loss per example of the whole logical batch the gradient was computed on")
    if not torch.isfinite(losses).all():
        raise PrivacyError(
            "a per-sample loss is NaN or infinite: its clipped value would be undefined, so nothing "
            "is released; check the inputs or lower the learning rate")
    return losses.detach()
