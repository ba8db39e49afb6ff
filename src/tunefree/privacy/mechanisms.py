"""Mechanisms: each release of private data adds its noise and returns the DpEvent it must be
accounted as. The optimizer records the events of one step in the ledger as one sampled event."""

from __future__ import annotations

import math
from collections.abc import Sequence

import dp_accounting as dpa
import torch
from torch import nn

from ..dtypes import accumulation_dtype
from ..grouping import ClipGroup
from .randomness import Randomness

NOISE_ALLOCATIONS = ("global", "equal-budget", "weighted")


def allocation_weights(groups: Sequence[ClipGroup], allocation: str) -> list[float]:
    """γₖ of the group-wise clipping paper (Algorithm 1, line 13): global γₖ = 1, equal-budget
    γₖ = Cₖ, weighted γₖ = Cₖ/√dₖ."""
    if allocation == "global":
        return [1.0] * len(groups)
    if allocation == "equal-budget":
        return [g.threshold for g in groups]
    if allocation == "weighted":
        return [g.threshold / math.sqrt(g.size) for g in groups]
    raise ValueError(f"unknown noise_allocation {allocation!r}: use one of {NOISE_ALLOCATIONS}")


def group_noise_stds(groups: Sequence[ClipGroup], noise_multiplier: float,
                     allocation: str = "global") -> list[float]:
    """Noise standard deviation σₖ = c·γₖ of each group, with c chosen so that the release is exactly
    a Gaussian mechanism of noise multiplier σ: ``Σₖ (Cₖ/σₖ)² = 1/σ²``. With γₖ = 1 every coordinate
    gets σ·S, S = √(Σₖ Cₖ²)."""
    gammas = allocation_weights(groups, allocation)
    scale = noise_multiplier * math.sqrt(sum((g.threshold / gamma) ** 2
                                             for g, gamma in zip(groups, gammas)))
    return [scale * gamma for gamma in gammas]


class GradientRelease:
    """Releases the clipped gradient sums with Gaussian noise (the Gaussian mechanism of DP-SGD).

    Args:
        groups: the clip groups; their thresholds are the sensitivity of each group's sum.
        noise_multiplier: σ, the noise relative to the total sensitivity.
        randomness: the run's source of noise.
        allocation: how the noise is spread over groups (``"global"``, ``"equal-budget"``,
            ``"weighted"``); the privacy cost is that of σ whatever the choice.
    """

    def __init__(self, groups: Sequence[ClipGroup], noise_multiplier: float,
                 randomness: Randomness, allocation: str = "global"):
        if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"noise_multiplier must be a finite number ≥ 0, got {noise_multiplier}")
        allocation_weights(groups, allocation)  # validates the name
        self.groups, self.noise_multiplier = list(groups), noise_multiplier
        self.randomness, self.allocation = randomness, allocation

    def noise_stds(self) -> list[float]:
        return group_noise_stds(self.groups, self.noise_multiplier, self.allocation)

    def release(self, sums: dict[nn.Parameter, torch.Tensor]
                ) -> tuple[dict[nn.Parameter, torch.Tensor], dpa.DpEvent]:
        """Noisy sums for every parameter of every group (a parameter without a sum gets noise only)."""
        noisy = {}
        for group, std in zip(self.groups, self.noise_stds()):
            for p in group.params:
                total = sums.get(p)
                if total is None:
                    total = torch.zeros(p.shape, device=p.device, dtype=accumulation_dtype(p.dtype))
                if std > 0:
                    total = total + std * self.randomness.normal(p.shape, p.device, total.dtype)
                noisy[p] = total
        return noisy, dpa.GaussianDpEvent(self.noise_multiplier)
