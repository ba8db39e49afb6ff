"""Adaptive clip thresholds: each group's threshold tracks a private estimate of a quantile of its
per-sample gradient norms (Andrew et al. 2019, per group as in Algorithm 1 of the group-wise clipping
paper, lines 10 and 15–17).

Each step releases, for every group k, the number of examples whose norm was within the threshold,
centred (``1[‖gᵢ‖ ≤ Cₖ] − ½``, sensitivity ½ per group) plus Gaussian noise of standard deviation σ_b,
and moves the threshold geometrically: ``Cₖ ← Cₖ·exp(−η(b̃ₖ − q))`` with ``b̃ₖ`` the noisy fraction.
The count release shares the gradient's Poisson-sampled batch and is recorded with it as one event.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import dp_accounting as dpa
import torch

from .grouping import ClipGroup
from .optim import DPOptimizer, StepComponent, StepReport
from .privacy.randomness import Randomness


def split_budget(noise_multiplier: float, groups: int, quantile_budget: float
                 ) -> tuple[float, float]:
    """Proposition 3.1: the gradient's noise multiplier σ_new and the count noise σ_b so that the two
    releases on one batch together cost exactly what one release at σ costs, a fraction
    ``quantile_budget`` of it (in the Gaussian's μ² = σ⁻², i.e. in RDP) going to the counts.

    ``σ_b = σ·√K / (2√r)`` and ``σ_new = (σ⁻² − K/(2σ_b)²)^(−1/2) = σ/√(1 − r)``.
    """
    if not 0 < quantile_budget < 1:
        raise ValueError(f"quantile_budget must be in (0, 1), got {quantile_budget}")
    if noise_multiplier == 0:
        return 0.0, 0.0
    count_std = noise_multiplier * math.sqrt(groups) / (2 * math.sqrt(quantile_budget))
    gradient_sigma = (noise_multiplier ** -2 - groups / (2 * count_std) ** 2) ** -0.5
    return gradient_sigma, count_std


def count_event(count_std: float, groups: int) -> dpa.GaussianDpEvent:
    """The count release as a Gaussian mechanism: L2 sensitivity √K/2, noise σ_b per coordinate."""
    return dpa.GaussianDpEvent(2 * count_std / math.sqrt(groups) if count_std > 0 else 0.0)


class QuantileThresholds(StepComponent):
    """Moves every group's threshold towards the ``target_quantile`` of its per-sample norms.

    Args:
        groups: the clip groups; their ``threshold`` is read by the engine at clip time and updated here
            after each step.
        target_quantile: q, the fraction of examples whose norm should fall within the threshold.
        learning_rate: η of the geometric update.
        count_std: σ_b, the noise standard deviation of each group's centred count.
        expected_batch_size: q·N; the noisy count is divided by it (never by the private batch size).
        randomness: the run's source of noise.
    """

    def __init__(self, groups: list[ClipGroup], target_quantile: float, learning_rate: float,
                 count_std: float, expected_batch_size: float, randomness: Randomness):
        if not 0 < target_quantile < 1:
            raise ValueError(f"target_quantile must be in (0, 1), got {target_quantile}")
        if not (learning_rate > 0 and math.isfinite(learning_rate)):
            raise ValueError(f"quantile_lr must be a positive number, got {learning_rate}")
        self.groups, self.target_quantile, self.learning_rate = groups, target_quantile, learning_rate
        self.count_std, self.expected_batch_size = count_std, expected_batch_size
        self.randomness = randomness
        self.last_fractions: dict[str, float] = {}

    def unclipped_counts(self, report: StepReport) -> torch.Tensor:
        """Per group, the examples whose norm is within the threshold (an example that never reached a
        group's parameters has norm 0 there)."""
        counts = []
        for group in self.groups:
            norms = report.group_norms.get(group.name)
            clipped = 0 if norms is None else int((norms > group.threshold).sum())
            counts.append(report.examples - clipped)
        return torch.tensor(counts, dtype=torch.float64)

    def after_update(self, optimizer: DPOptimizer, report: StepReport,
                     closure: Callable[[], Any] | None) -> list[dpa.DpEvent]:
        centred = self.unclipped_counts(report) - report.examples / 2
        noise = self.randomness.normal(centred.shape, torch.device("cpu"), torch.float64)
        fractions = (centred + self.count_std * noise) / self.expected_batch_size + 0.5
        for group, fraction in zip(self.groups, fractions.tolist()):
            group.threshold *= math.exp(-self.learning_rate * (fraction - self.target_quantile))
            self.last_fractions[group.name] = fraction
        return [count_event(self.count_std, len(self.groups))]
