"""Adaptive clip thresholds: each group's threshold tracks a private quantile of its norms.

Group-wise clipping paper, Algorithm 1 (lines 3-4, 10, 15-18) and Proposition 3.1, after Andrew et
al. (2019). At every step each group k releases how many examples of the batch had a norm within
its quantile estimate, ``Σᵢ (1[‖gᵢₖ‖ ≤ Qₖ] − ½)`` (sensitivity ½ per group), with Gaussian noise of
standard deviation σ_b; the noisy fraction ``b̃ₖ`` (divided by the expected batch size q·N, never
the private one) moves the estimate geometrically: ``Qₖ ← Qₖ·exp(−η(b̃ₖ − q))``. The clip
thresholds Cₖ follow the estimates (see ``QuantileEstimator``).

Budget split: the step's releases (gradient, K counts) share one Poisson-sampled batch, so together
they are one Gaussian mechanism of multiplier σ with ``σ⁻² = σ_new⁻² + K/(2σ_b)²``. A fraction r
of the budget — of σ⁻², which is the share of Rényi-DP at every order — goes to the counts:
``σ_new = σ/√(1−r)`` and ``σ_b = σ·√K/(2√r)`` (count release multiplier ``2σ_b/√K = σ/√r``).
The split is solved with the rest of the run's budget in ``privacy.plan``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .._validate import flag, fraction, positive
from ..clipping.groups import ClipGroup
from ..parallel.base import DDP, FSDP2, ONE_PROCESS, STAGES
from ..privacy.mechanisms import SINGLE_PROCESS, Reduction
from ..privacy.plan import CountShare
from ..step.component import StepComponent, StepContext, StepReport


@dataclass(frozen=True)
class Fixed:
    """Clip thresholds fixed at ``max_grad_norm`` throughout: nothing is released for them."""

    parallelisms: ClassVar[tuple[str, ...]] = (ONE_PROCESS, DDP, FSDP2, STAGES)  # the kinds it runs under

    def share(self, num_groups: int) -> None:
        """No share of the budget."""
        return None


@dataclass(frozen=True)
class AdaptiveQuantile:
    """Thresholds tracking a private ``target`` quantile of each group's norms, moved by the geometric
    step ``lr`` (η); ``budget`` (r) is the fraction of the privacy budget spent on the count releases
    (the total ε is unchanged).

    ``rescale`` (Abadi clipping with several groups): the estimates Qₖ set only the groups' relative
    thresholds, ``C̃ₖ = C·Qₖ/√(Σⱼ Qⱼ²)`` with C the initial total sensitivity (group-wise paper), so
    the total sensitivity, and the noise, stay fixed. The normalising clip functions always do this."""

    # its counts are summed over the processes and noised once (Parallelism.noisy_values); under pipeline
    # stages each stage's count is one of the joint release's (Parallelism.all_groups)
    parallelisms: ClassVar[tuple[str, ...]] = (ONE_PROCESS, DDP, FSDP2, STAGES)

    target: float = 0.5
    lr: float = 0.3
    budget: float = 0.01
    rescale: bool = False

    def __post_init__(self) -> None:
        fraction("AdaptiveQuantile.target", self.target)
        positive("AdaptiveQuantile.lr", self.lr)
        fraction("AdaptiveQuantile.budget", self.budget)
        flag("AdaptiveQuantile.rescale", self.rescale)

    def share(self, num_groups: int) -> CountShare:
        """Its share of each step's budget: ``num_groups`` counts at a fraction ``budget`` of it."""
        return CountShare(self.budget, num_groups)


class QuantileEstimator(StepComponent):
    """Releases each group's count of examples below its quantile estimate Qₖ and moves Qₖ towards
    the target quantile of the group's per-sample norms; returns the groups' next thresholds, made
    from Qₖ (the groups themselves are never changed).

    With Abadi clipping the thresholds are the estimates, ``Cₖ = Qₖ`` (Algorithm 1); with ``scale`` (the
    normalising clip functions, or ``rescale``) ``Cₖ = scale·Qₖ/‖Q‖``: the estimates set the groups'
    relative thresholds at a constant total sensitivity, so the noise stays fixed (automatic clipping
    paper, Appendix B.3).

    Args:
        groups: the clip groups; each one's configured ``threshold`` is its initial estimate Qₖ.
        settings: target quantile q, learning rate η and budget fraction r (``rescale`` is decided by
            ``scale``).
        count_noise: σ_c, the noise multiplier of the joint release of the groups' counts (each count
            gets noise of standard deviation σ_b = σ_c·√K/2; 0 only when privacy is off, for debugging).
        scale: ``None`` for ``Cₖ = Qₖ``; otherwise the constant total sensitivity ``√(Σₖ Cₖ²)``.
        parallelism: the run's. Where other processes hold other clip groups of the run (pipeline
            stages), this estimator's counts are some of the run's joint release of one count per group,
            and the common scale is over every group's estimate. (Under data parallelism the step's
            release sums every process's counts and noises them once: the norms never leave their
            process.)
    """

    state_key = "QuantileEstimator"

    def __init__(self, groups: Sequence[ClipGroup], settings: AdaptiveQuantile, count_noise: float,
                 scale: float | None = None, parallelism: Reduction = SINGLE_PROCESS):
        assert count_noise >= 0 and (scale is None or scale > 0), (count_noise, scale)  # from the plan
        self.groups, self.settings, self.count_noise = list(groups), settings, count_noise
        self.scale, self.parallelism = scale, parallelism
        self.quantiles = {g.name: g.threshold for g in self.groups}
        self._sizes = {g.name: g.size for g in self.groups}
        # Every clip group's estimate in the run: this estimator's and (pipeline stages) the other
        # processes', exchanged at each update where the common scale needs them.
        self.estimates = self._every_estimate()
        self.unclipped_fractions: dict[str, float] | None = None

    @property
    def joint_counts(self) -> int:
        """K, the counts of the run's joint count release: one per clip group of the run."""
        return len(self.estimates)

    @property
    def count_std(self) -> float:
        """σ_b, the noise standard deviation of each count: σ_c·√K/2 for K counts released jointly."""
        return self.count_noise * math.sqrt(self.joint_counts) / 2

    def thresholds(self) -> dict[str, float]:
        """The clip threshold of each group (by name) that follows from the current estimates."""
        if self.scale is None:
            return dict(self.quantiles)
        norm = math.sqrt(sum(v ** 2 for v in self.estimates.values()))
        return {name: self.scale * estimate / norm for name, estimate in self.quantiles.items()}

    def _every_estimate(self) -> dict[str, float]:
        """Every clip group's current estimate in the run (a collective under pipeline stages)."""
        own = {name: (q, self._sizes[name]) for name, q in self.quantiles.items()}
        return {name: value for name, (value, _) in self.parallelism.all_groups(own).items()}

    def centred_counts(self, report: StepReport) -> torch.Tensor:
        """``Σᵢ (1[‖gᵢₖ‖ ≤ Qₖ] − ½)`` of each group (a group without gradient this step has
        norm 0 for every example)."""
        below: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        counts = torch.full((len(self.groups),), report.examples / 2, dtype=torch.float64)
        for k, g in enumerate(self.groups):
            norms = report.group_norms.get(g.name)
            if norms is not None:
                count = (norms <= self.quantiles[g.name]).sum()
                below.setdefault(norms.device, []).append((k, count))
                counts[k] = -norms.numel() / 2
        for pairs in below.values():  # one transfer per device, not one per group
            values = torch.stack([v for _, v in pairs]).cpu().to(torch.float64)
            counts[[k for k, _ in pairs]] += values
        return counts

    def after_update(self, step: StepContext) -> None:
        """Release the counts against the estimates this step clipped with, as this process's part of the
        joint release of K counts (sensitivity √K/2), and move the estimates (the next step's thresholds
        follow from them: :meth:`thresholds`)."""
        counts = step.release(self.centred_counts(step.report), math.sqrt(self.joint_counts) / 2,
                              self.count_noise)
        fractions = (counts / step.expected_batch_size + 0.5).tolist()
        q, eta = self.settings.target, self.settings.lr
        for g, below in zip(self.groups, fractions, strict=True):
            self.quantiles[g.name] *= math.exp(-eta * (below - q))
        self.unclipped_fractions = {g.name: f for g, f in zip(self.groups, fractions, strict=True)}
        if self.scale is not None:  # the common scale is over every group's estimate
            self.estimates = self._every_estimate()
        else:
            self.estimates.update(self.quantiles)

    def state_dict(self) -> dict[str, Any]:
        state = {"quantiles": dict(self.quantiles), "unclipped_fractions": self.unclipped_fractions}
        if len(self.estimates) > len(self.quantiles):  # with the other processes' groups' estimates
            state["estimates"] = dict(self.estimates)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state["quantiles"]) != set(self.quantiles):
            raise ValueError("the checkpoint's quantile estimates are for other clip groups")
        elsewhere = len(self.estimates) > len(self.quantiles)
        if elsewhere and set(state.get("estimates", ())) != set(self.estimates):
            raise ValueError(f"this checkpoint holds no estimates of the run's {len(self.estimates)} clip "
                             "groups: resume a pipeline stage from its own checkpoint")
        self.quantiles = {name: float(state["quantiles"][name]) for name in self.quantiles}
        saved = state["estimates"] if elsewhere else self.quantiles
        self.estimates = {name: float(saved[name]) for name in self.estimates}
        self.unclipped_fractions = state["unclipped_fractions"]
