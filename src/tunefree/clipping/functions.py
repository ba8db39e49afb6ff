"""Per-sample clip functions.

A clip function turns each example's gradient norm ``‖gᵢ‖`` (of one parameter group) into a weight
``wᵢ`` such that the clipped gradient ``wᵢ·gᵢ`` has norm at most the group's threshold ``R``. That bound
is the sensitivity the noise is calibrated to, so every function here is tested for it at norm 0, at tiny
norms and at huge norms.

All functions are pure: ``weights = fn(norms, threshold)`` with ``norms`` a 1-D tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

WeightFunction = Callable[[torch.Tensor, float, "ClipFunction"], torch.Tensor]

# The registry: clip function name → ``weights(norms, threshold, clip)``. Add one with
# ``@register_clip_function("name")``; it must keep ``weights·norms ≤ threshold`` for every norm ≥ 0.
CLIP_FUNCTIONS: dict[str, WeightFunction] = {}


def register_clip_function(name: str) -> Callable[[WeightFunction], WeightFunction]:
    """Decorator: make ``fn(norms, threshold, clip)`` usable as ``clipping=name``."""
    def register(fn: WeightFunction) -> WeightFunction:
        if name in CLIP_FUNCTIONS:
            raise ValueError(f"clip function {name!r} is already registered")
        CLIP_FUNCTIONS[name] = fn
        return fn
    return register

# Below this norm AUTO-V treats the gradient as zero-sized: the weight stops growing, so wᵢ·‖gᵢ‖ < R still
# holds and the weight stays finite in float32.
_AUTO_V_NORM_FLOOR = 1e-30


def abadi(norms: torch.Tensor, threshold: float) -> torch.Tensor:
    """Abadi et al.: ``min(1, R/‖g‖)``; gradients inside the ball are left untouched."""
    return (threshold / norms.clamp_min(_AUTO_V_NORM_FLOOR)).clamp_max(1.0)


def auto_v(norms: torch.Tensor, threshold: float) -> torch.Tensor:
    """AUTO-V (vanilla normalisation): ``R/‖g‖``; every example contributes exactly norm R."""
    return threshold / norms.clamp_min(_AUTO_V_NORM_FLOOR)


def auto_s(norms: torch.Tensor, threshold: float, gamma: float = 0.01) -> torch.Tensor:
    """AUTO-S (stable normalisation): ``R/(‖g‖ + γ)``; small gradients are not blown up."""
    return threshold / (norms + gamma)


def psac(norms: torch.Tensor, threshold: float, r: float = 0.1) -> torch.Tensor:
    """DP-PSAC: ``R/(‖g‖ + r/(‖g‖ + r))``, a non-monotonic weight that damps tiny gradients less."""
    return threshold / (norms + r / (norms + r))


@dataclass(frozen=True)
class ClipFunction:
    """A named clip function with its stability constant (γ for AUTO-S, r for PSAC).

    The bound ``‖wᵢ gᵢ‖ ≤ R`` holds for every choice of the constant; the constant only shapes how small
    gradients are weighted, never the privacy guarantee.
    """

    name: str
    gamma: float = 0.01
    r: float = 0.1

    def __post_init__(self) -> None:
        if self.name not in CLIP_FUNCTIONS:
            raise ValueError(
                f"unknown clipping {self.name!r}: choose one of {', '.join(CLIP_FUNCTIONS)}"
            )
        for label, value in (("gamma", self.gamma), ("r", self.r)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"clipping constant {label} must be a positive number, got {value}")

    def weights(self, norms: torch.Tensor, threshold: float) -> torch.Tensor:
        """Clip weights (float64) for per-sample ``norms`` under ``threshold`` (the group's
        sensitivity). Computed in float64 so that ``wᵢ·‖gᵢ‖ ≤ R`` holds to rounding even where a
        float32 weight would be subnormal."""
        return CLIP_FUNCTIONS[self.name](norms.to(torch.float64), threshold, self)


register_clip_function("abadi")(lambda norms, threshold, clip: abadi(norms, threshold))
register_clip_function("auto-v")(lambda norms, threshold, clip: auto_v(norms, threshold))
register_clip_function("auto-s")(lambda norms, threshold, clip: auto_s(norms, threshold, clip.gamma))
register_clip_function("psac")(lambda norms, threshold, clip: psac(norms, threshold, clip.r))
