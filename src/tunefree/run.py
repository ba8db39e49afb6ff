"""A private training run as the user holds it: ``DPEngine`` (model, private optimizer, Poisson loader,
ε and the run's state) and its ``Guarantee``."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from torch import nn

from .clipping.groups import ClipGroup, sensitivity
from .components.dog import DistanceOverGradients
from .components.hyfreedp import HyFreeDPStep
from .components.thresholds import QuantileEstimator
from .data.poisson import PoissonDataLoader, StepSchedule
from .errors import PrivacyError
from .guards.base import Guards
from .guards.state import StateGuard
from .parallel.base import Parallelism
from .persample.engine import ClippingEngine
from .privacy.canaries import GradientCanaries
from .privacy.ledger import Ledger
from .privacy.plan import Plan
from .privacy.randomness import NoiseSource
from .step.component import StepReport
from .step.optimizer import DPOptimizer
from .step.private_step import check_updates_recorded


@dataclass(frozen=True)
class Guarantee:
    """The (ε, δ)-DP guarantee of everything released so far."""

    epsilon: float
    delta: float
    steps: int
    accountant: str
    poisson_approximation: bool
    seeded: bool = False  # a reproducible run: the guarantee holds only while the seed stays secret

    def __str__(self) -> str:
        text = (f"(ε = {self.epsilon:.4g}, δ = {self.delta:.3g})-DP after {self.steps} steps "
                f"({self.accountant.upper()} accountant)")
        if self.poisson_approximation:
            text += (" — assuming Poisson sampling, which the data loader does not do: this is the "
                     "Poisson approximation, not a proof")
        if self.seeded:
            text += (" — seeded run: anyone who knows the seed can remove the noise, and this "
                     "guarantee with it; keep the seed secret")
        return text


class DPEngine:
    """A private training run: the hooked model, the private optimizer and the Poisson loader.

    Built by :func:`make_private`; ``model`` is the very ``nn.Module`` object that was passed in.
    """

    def __init__(self, *, model: nn.Module, optimizer: DPOptimizer, data_loader: Any,
                 clipper: ClippingEngine, ledger: Ledger, randomness: NoiseSource,
                 schedule: StepSchedule, groups: list[ClipGroup], plan: Plan,
                 parallel: Parallelism, guards: Guards, canaries: GradientCanaries | None = None):
        self.model, self.optimizer, self.data_loader = model, optimizer, data_loader
        self.guards = guards  # the invariants each step is checked against (guards/)
        self.clipper, self.ledger, self.randomness = clipper, ledger, randomness
        self.schedule, self.groups, self.plan = schedule, groups, plan
        self.parallel = parallel  # how the run spans processes (its kind, rank and world size)
        # make_private(audit_canaries=m): the canaries' releases, for tunefree.audit.audit_training
        self.canaries = canaries

    @property
    def noise_multiplier(self) -> float:
        """σ of the plan: each step's gradient (and count) release costs what plain DP-SGD at σ would."""
        return self.plan.noise_multiplier

    @property
    def sample_rate(self) -> float:
        return self.plan.sample_rate

    @property
    def planned_steps(self) -> int | None:
        return self.plan.steps

    @property
    def target_delta(self) -> float:
        return self.plan.delta

    @property
    def accountant(self) -> str:
        return self.plan.accountant

    @property
    def steps(self) -> int:
        """Private steps taken (recorded in the ledger)."""
        return self.ledger.steps

    @property
    def last_step(self) -> StepReport | None:
        return self.optimizer.last_step

    @property
    def clip_thresholds(self) -> dict[str, float]:
        """Each clip group's current threshold, by group name (those the next step clips with)."""
        return dict(self.optimizer.thresholds)

    @property
    def quantile_estimator(self) -> QuantileEstimator | None:
        """The private quantile estimator of adaptive thresholds (``None`` if fixed)."""
        components = self.optimizer.components
        return next((c for c in components if isinstance(c, QuantileEstimator)), None)

    @property
    def lr_rule(self) -> HyFreeDPStep | DistanceOverGradients | None:
        """The learning-rate rule of the run (``None`` when the optimizer's own learning rate is kept): DoG
        for ``lr="auto"`` (after training, ``engine.lr_rule.apply_average()`` loads its averaged weights),
        HyFreeDP's for ``lr=HyFreeDP()``."""
        return next((c for c in self.optimizer.components
                     if isinstance(c, (HyFreeDPStep, DistanceOverGradients))), None)

    @property
    def clip_fractions(self) -> dict[str, float] | None:
        """Each group's fraction of examples whose norm exceeded its quantile estimate (the
        clipped fraction, for Abadi clipping) at the last step, as privately released by adaptive
        thresholds (noisy); ``None`` with fixed thresholds or before the first step."""
        estimator = self.quantile_estimator
        if estimator is None or estimator.unclipped_fractions is None:
            return None
        return {name: 1 - f for name, f in estimator.unclipped_fractions.items()}

    @property
    def sensitivity(self) -> float:
        return sensitivity(self.groups)

    def epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta`` (the run's target δ by default), from the ledger."""
        return self.ledger.epsilon(self.target_delta if delta is None else delta, self.accountant)

    def guarantee(self, delta: float | None = None) -> Guarantee:
        delta = self.target_delta if delta is None else delta
        return Guarantee(self.epsilon(delta), delta, self.steps, self.accountant,
                         self.ledger.poisson_approximation, seeded=self.ledger.seeded)

    def public_writes(self) -> AbstractContextManager[None]:
        """A block of writes to the model between private steps that depend on public values only (the
        released weights, public data, the step count), e.g. a weight projection after ``step()``:
        ``with engine.public_writes(): project(model)``. Any other change of the model outside the
        private step is refused (``guards/state.py``); the block itself is refused if the model changed
        before it."""
        return self.guards.of(StateGuard).public_writes()

    def detach(self) -> nn.Module:
        """Remove every hook; the model is a plain module (or DDP model) again and the private optimizer
        is done."""
        self.clipper.detach()
        self.optimizer.private_step.detach()
        self.parallel.release_model()
        return self.model

    def state_dict(self) -> dict[str, Any]:
        """The run's privacy state: ledger, randomness, position of the sampler, the step components'
        state and the plan it belongs to. Save it with the model's and the optimizer's state dicts; a
        resumed run continues the same guarantee. It holds a digest of the data set and, of a seeded
        run, the seed (``["randomness"]["randomness"]`` says so): whoever reads the seed can remove the
        noise, so keep the state as private as the data."""
        return {"ledger": self.ledger.state_dict(), "randomness": self.randomness.state_dict(),
                "schedule": self.schedule.state_dict(),
                "components": self.optimizer.component_states(),
                "plan": self.plan.describe(), "fingerprint": self.plan.fingerprint()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; a state of another plan (other noise, sampling, length, data
        set, groups, clipping, thresholds or learning-rate policy) is refused, naming what differs."""
        self._check_same_plan(state)
        self.optimizer.resume(state["components"])  # checked first: refused as a whole
        self.randomness.load_state_dict(state["randomness"])  # refuses a secret run resuming a seeded one
        self.ledger.load_state_dict(state["ledger"])
        self.schedule.load_state_dict(state["schedule"])
        self._check_resumed_steps()
        # The resumed model (loaded with the checkpoint's weights) is the state the guard compares with.
        self.guards.of(StateGuard).snapshot()

    def _check_same_plan(self, state: Mapping[str, Any]) -> None:
        """The checkpoint's plan is this run's."""
        theirs = state.get("plan", {})
        if state.get("fingerprint") == self.plan.fingerprint() or theirs == self.plan.describe():
            return
        differences = "\n  ".join(self.plan.differences(theirs))
        raise ValueError(
            "this checkpoint belongs to a run with other privacy settings; resume with the same "
            f"settings and the same data set. It differs in:\n  {differences}")

    def _check_resumed_steps(self) -> None:
        """A resumed ledger describes the steps this run took: with the Poisson loader, its position
        (logical batches handed out) equals the ledger's steps, and the wrapped optimizer applied no more
        updates than the ledger records (checked again before every update)."""
        steps, consumed = self.ledger.steps, self.schedule.consumed
        if isinstance(self.data_loader, PoissonDataLoader) and consumed != steps:
            raise PrivacyError(
                f"this checkpoint's ledger records {steps} private steps but its Poisson sampler handed "
                f"out {consumed} batches: the ledger was edited, or the checkpoint was saved in the "
                "middle of a step. Save engine.state_dict() right after optimizer.step(), and resume from "
                "the ledger saved with it")
        check_updates_recorded(self.optimizer.original, steps)
