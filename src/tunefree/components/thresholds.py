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
from typing import Any

import dp_accounting as dpa
import torch

from ..clipping.groups import ClipGroup
from ..privacy.mechanisms import release_counts
from ..privacy.randomness import NoiseSource
from ..step.component import StepComponent, StepContext, StepReport

DEFAULT_TARGET_QUANTILE = 0.5
DEFAULT_QUANTILE_LR = 0.3
DEFAULT_QUANTILE_BUDGET = 0.01


@dataclass(frozen=True)
class QuantileSettings:
    """Private quantile estimation: target quantile q, learning rate η, budget fraction r; ``rescale``
    keeps Abadi clipping's total sensitivity fixed (``C̃ₖ = C·Qₖ/‖Q‖``, see ``QuantileEstimator``)."""

    target_quantile: float = DEFAULT_TARGET_QUANTILE
    learning_rate: float = DEFAULT_QUANTILE_LR
    budget: float = DEFAULT_QUANTILE_BUDGET
    rescale: bool = False


class QuantileEstimator(StepComponent):
    """Releases each group's count of examples below its quantile estimate Qₖ and moves Qₖ towards
    the target quantile of the group's per-sample norms; returns the groups' next thresholds, made
    from Qₖ (the groups themselves are never changed).

    With Abadi clipping the thresholds are the estimates, ``Cₖ = Qₖ`` (Algorithm 1), or with
    ``settings.rescale`` the group-wise paper's rescaling ``C̃ₖ = C·Qₖ/‖Q‖`` (C the initial total
    sensitivity), which keeps the noise fixed while the groups' shares adapt. With the
    normalising clip functions (AUTO-S, AUTO-V, PSAC) a threshold only scales its group's update,
    and the overall scale is the learning rate's business (automatic clipping paper, Appendix
    B.3): there the estimates set the groups' relative scales at a constant total sensitivity,
    ``Cₖ = scale·Qₖ/‖Q‖``, so the learning rate keeps its meaning while the norms drift.

    Args:
        groups: the clip groups; each one's configured ``threshold`` is its initial estimate Qₖ.
        settings: target quantile q, learning rate η and budget fraction r.
        count_std: σ_b, the noise standard deviation of each group's count (0 only when privacy is
            off, for debugging).
        randomness: the run's source of noise.
        expected_batch_size: q·N; the noisy count is divided by it, never by the private batch size.
        scale: ``None`` for ``Cₖ = Qₖ``; otherwise the constant total sensitivity ``√(Σₖ Cₖ²)``.
    """

    def __init__(self, groups: Sequence[ClipGroup], settings: QuantileSettings, count_std: float,
                 randomness: NoiseSource, expected_batch_size: float, scale: float | None = None):
        if not (count_std >= 0 and math.isfinite(count_std)):
            raise ValueError(f"count_std must be a finite number ≥ 0, got {count_std}")
        if scale is not None and not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"scale must be a positive number or None, got {scale}")
        self.groups, self.settings, self.count_std = list(groups), settings, count_std
        self.randomness, self.expected_batch_size = randomness, expected_batch_size
        self.scale = scale
        self.quantiles = {g.name: g.threshold for g in self.groups}
        self.unclipped_fractions: dict[str, float] | None = None

    def thresholds(self) -> dict[str, float]:
        """The clip threshold of each group (by name) that follows from the current estimates."""
        if self.scale is None:
            return dict(self.quantiles)
        norm = math.sqrt(sum(v ** 2 for v in self.quantiles.values()))
        return {name: self.scale * estimate / norm for name, estimate in self.quantiles.items()}

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

    def after_update(self, step: StepContext) -> list[dpa.DpEvent]:
        """Release the counts against the estimates this step clipped with, update them, and set the
        step's ``next_thresholds``."""
        events = self.update(step.report)
        step.next_thresholds = self.thresholds()
        return events

    def update(self, report: StepReport) -> list[dpa.DpEvent]:
        """Release the counts of ``report``'s norms against the current estimates and move them."""
        counts, event = release_counts(self.centred_counts(report), self.count_std, self.randomness)
        fractions = (counts / self.expected_batch_size + 0.5).tolist()
        q, eta = self.settings.target_quantile, self.settings.learning_rate
        for g, fraction in zip(self.groups, fractions, strict=True):
            self.quantiles[g.name] *= math.exp(-eta * (fraction - q))
        self.unclipped_fractions = {g.name: f for g, f in zip(self.groups, fractions, strict=True)}
        return [event]

    def state_dict(self) -> dict[str, Any]:
        return {"quantiles": dict(self.quantiles), "unclipped_fractions": self.unclipped_fractions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state["quantiles"]) != set(self.quantiles):
            raise ValueError("the checkpoint's quantile estimates are for other clip groups")
        self.quantiles = {name: float(state["quantiles"][name]) for name in self.quantiles}
        self.unclipped_fractions = state["unclipped_fractions"]
