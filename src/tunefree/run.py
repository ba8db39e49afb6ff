"""A private training run as the user holds it: ``DPEngine`` (model, private optimizer, Poisson loader,
ε and the run's state) and its ``Guarantee``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from .clipping.groups import ClipGroup, sensitivity
from .components.dog import DistanceOverGradients
from .components.hyfreedp import AutoLearningRate
from .components.thresholds import QuantileEstimator
from .data.poisson import StepSchedule
from .parallel.ddp import DataParallel
from .parallel.fsdp import ShardedDataParallel
from .persample.engine import ClippingEngine
from .privacy.canaries import GradientCanaries
from .privacy.ledger import Ledger
from .privacy.plan import Plan
from .privacy.randomness import NoiseSource
from .step.component import StepReport
from .step.optimizer import DPOptimizer


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
                 clipping_engine: ClippingEngine, ledger: Ledger, randomness: NoiseSource,
                 schedule: StepSchedule, groups: list[ClipGroup], plan: Plan,
                 parallel: DataParallel | ShardedDataParallel | None = None,
                 canaries: GradientCanaries | None = None):
        self.model, self.optimizer, self.data_loader = model, optimizer, data_loader
        self.clipping_engine, self.ledger, self.randomness = clipping_engine, ledger, randomness
        self.schedule, self.groups, self.plan = schedule, groups, plan
        self.parallel = parallel  # the data-parallel rank and world size (None: one process)
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
        """Each clip group's current threshold, by group name."""
        return dict(self.clipping_engine.thresholds)

    @property
    def quantile_estimator(self) -> QuantileEstimator | None:
        """The private quantile estimator of adaptive thresholds (``None`` if fixed)."""
        components = self.optimizer.components
        return next((c for c in components if isinstance(c, QuantileEstimator)), None)

    @property
    def auto_lr(self) -> AutoLearningRate | None:
        """The automatic learning rate of ``lr="auto"`` (``None`` with a fixed learning rate); e.g.
        ``engine.auto_lr.record_training_losses(losses)`` hands it L(w) from the training forward."""
        return next((c for c in self.optimizer.components if isinstance(c, AutoLearningRate)), None)

    @property
    def dog_lr(self) -> DistanceOverGradients | None:
        """The DoG learning rate of ``AutoLR(mode="dog")`` (``None`` otherwise); after training,
        ``engine.dog_lr.apply_average()`` loads its averaged weights into the optimizer's parameters."""
        return next((c for c in self.optimizer.components if isinstance(c, DistanceOverGradients)), None)

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
                         self.ledger.poisson_approximation, seeded=not self.randomness.secret)

    def detach(self) -> nn.Module:
        """Remove every hook; the model is a plain module (or DDP model) again and the private optimizer
        is done."""
        self.clipping_engine.detach()
        if self.parallel is not None:
            self.parallel.release_model()
        return self.model

    def state_dict(self) -> dict[str, Any]:
        """The run's privacy state: ledger, randomness, position of the sampler, the step components'
        state and the plan it belongs to. Save it with the model's and the optimizer's state dicts; a
        resumed run continues the same guarantee. It holds a digest of a few examples and, of a seeded
        run, the seed (``["randomness"]["randomness"]`` says so): whoever reads the seed can remove the
        noise, so keep the state as private as the data."""
        return {"ledger": self.ledger.state_dict(), "randomness": self.randomness.state_dict(),
                "schedule": self.schedule.state_dict(),
                "components": {name: c.state_dict() for name, c in self._components().items()},
                "plan": self.plan.describe(), "fingerprint": self.plan.fingerprint()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; a state of another plan (other noise, sampling, length, data
        set, groups, clipping, thresholds or learning-rate policy) is refused, naming what differs."""
        if state.get("fingerprint") != self.plan.fingerprint():
            differences = self.plan.differences(state.get("plan", {}))
            raise ValueError(
                "this checkpoint belongs to a run with other privacy settings; resume with the same "
                "settings and the same data set. It differs in:\n  " + "\n  ".join(differences))
        components = self._components()
        if set(state["components"]) != set(components):
            raise ValueError(
                f"this checkpoint holds the state of the step components {sorted(state['components'])}, "
                f"this run has {sorted(components)}; resume with the same settings")
        self.ledger.load_state_dict(state["ledger"])
        self.randomness.load_state_dict(state["randomness"])
        self.schedule.load_state_dict(state["schedule"])
        for name, component in components.items():
            component.load_state_dict(state["components"][name])
        estimator = self.quantile_estimator
        if estimator is not None:
            self.clipping_engine.set_thresholds(estimator.thresholds())

    def _components(self) -> dict[str, Any]:
        return {type(c).__name__: c for c in self.optimizer.components}
