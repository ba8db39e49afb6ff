"""Per-sample clip functions: the typed option *is* the function.

A clip function turns each example's gradient norm ``‖gᵢ‖`` (of one clip group) into a weight ``wᵢ``
such that the clipped gradient ``wᵢ·gᵢ`` has norm at most the group's threshold ``R``. That bound is the
sensitivity the noise is calibrated to, so every function here is tested for it at norm 0, at tiny norms
and at huge norms. Each function is a frozen dataclass whose fields are its constants (none of which
changes the privacy guarantee), with ``weights(norms, threshold)`` and a ``normalising`` flag: whether
every example's clipped norm is (about) ``R`` whatever its gradient, so that a threshold only scales the
update (AUTO-S, AUTO-V, PSAC) rather than deciding which examples are clipped (Abadi).

A new function is one subclass, registered by name with ``@register_clip_function("name")``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, TypeVar

import torch

from .._validate import positive

WeightFunction = Callable[[torch.Tensor, float, "ClipFunction"], torch.Tensor]


class ClipFunction(ABC):
    """A clip function: ``weights(norms, threshold)`` with ``weights·norms ≤ threshold`` for every norm
    ≥ 0. Subclasses are frozen dataclasses (their fields are the function's constants)."""

    name: ClassVar[str] = ""
    # True: a threshold only scales the group's update (every example contributes about R), so adaptive
    # thresholds keep the total sensitivity fixed and set the groups' relative scales.
    normalising: ClassVar[bool] = True

    def weights(self, norms: torch.Tensor, threshold: float) -> torch.Tensor:
        """Clip weights (float64) for per-sample ``norms`` under ``threshold`` (the group's sensitivity).
        Computed in float64 so that ``wᵢ·‖gᵢ‖ ≤ R`` holds to rounding even where a float32 weight would
        be subnormal."""
        return self.weigh(norms.to(torch.float64), threshold)

    @abstractmethod
    def weigh(self, norms: torch.Tensor, threshold: float) -> torch.Tensor:
        """The weights of float64 ``norms``."""

    def describe(self) -> dict[str, Any]:
        """The function and its constants as plain values (part of a run's identity)."""
        return {"name": self.name, **asdict(self)}  # type: ignore[call-overload]


# The registry: clip function name → a factory of the function with its default constants (a
# ClipFunction subclass). Add one with ``@register_clip_function("name")``.
CLIP_FUNCTIONS: dict[str, Callable[[], ClipFunction]] = {}

Registered = TypeVar("Registered", type[ClipFunction], WeightFunction)


def register_clip_function(name: str, *, normalising: bool = True) -> Callable[[Registered], Registered]:
    """Decorator: make a clip function usable as ``clipping=name``.

    Decorate a ``ClipFunction`` subclass (a frozen dataclass with ``weigh`` and its ``normalising``
    flag), or, the older form, a plain ``fn(norms, threshold, clip)`` with ``normalising`` given here.
    Either must keep ``weights·norms ≤ threshold`` for every norm ≥ 0."""
    def register(function: Registered) -> Registered:
        if name in CLIP_FUNCTIONS:
            raise ValueError(f"clip function {name!r} is already registered")
        if isinstance(function, type) and issubclass(function, ClipFunction):
            function.name = name
            CLIP_FUNCTIONS[name] = function
        elif callable(function):
            CLIP_FUNCTIONS[name] = lambda: _Registered(name, function, normalising)
        else:
            raise TypeError(f"register_clip_function takes a ClipFunction subclass or a function, "
                            f"got {function!r}")
        return function
    return register


def clip_function(name: str) -> ClipFunction:
    """The registered clip function ``name`` with its default constants."""
    if name not in CLIP_FUNCTIONS:
        raise ValueError(f"unknown clipping {name!r}: use one of {', '.join(CLIP_FUNCTIONS)} "
                         "or AutoS(), AutoV(), PSAC(), Abadi()")
    return CLIP_FUNCTIONS[name]()


# Below this norm AUTO-V treats the gradient as zero-sized: the weight stops growing, so wᵢ·‖gᵢ‖ < R still
# holds and the weight stays finite in float32.
_AUTO_V_NORM_FLOOR = 1e-30


@register_clip_function("auto-s")
@dataclass(frozen=True)
class AutoS(ClipFunction):
    """AUTO-S clipping ``R/(‖g‖ + γ)``: small gradients are not blown up; γ only shapes small gradients,
    never the privacy guarantee."""

    gamma: float = 0.01

    def __post_init__(self) -> None:
        positive("AutoS.gamma", self.gamma)

    def weigh(self, norms: torch.Tensor, threshold: float) -> torch.Tensor:
        return threshold / (norms + self.gamma)


@register_clip_function("auto-v")
@dataclass(frozen=True)
class AutoV(ClipFunction):
    """AUTO-V clipping ``R/‖g‖``: every example contributes exactly norm R."""

    def weigh(self, norms: torch.Tensor, threshold: float) -> torch.Tensor:
        return threshold / norms.clamp_min(_AUTO_V_NORM_FLOOR)


@register_clip_function("psac")
@dataclass(frozen=True)
class PSAC(ClipFunction):
    """DP-PSAC clipping ``R/(‖g‖ + r/(‖g‖ + r))``: a non-monotonic weight that damps tiny gradients less;
    r has no effect on privacy."""

    r: float = 0.1

    def __post_init__(self) -> None:
        positive("PSAC.r", self.r)

    def weigh(self, norms: torch.Tensor, threshold: float) -> torch.Tensor:
        return threshold / (norms + self.r / (norms + self.r))


@register_clip_function("abadi")
@dataclass(frozen=True)
class Abadi(ClipFunction):
    """Abadi et al. clipping ``min(1, R/‖g‖)``: gradients inside the ball are left untouched."""

    normalising: ClassVar[bool] = False

    def weigh(self, norms: torch.Tensor, threshold: float) -> torch.Tensor:
        return (threshold / norms.clamp_min(_AUTO_V_NORM_FLOOR)).clamp_max(1.0)


@dataclass(frozen=True)
class _Registered(ClipFunction):
    """A clip function registered as a plain ``fn(norms, threshold, clip)``."""

    registered_name: str
    function: WeightFunction
    is_normalising: bool = True

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.registered_name

    @property
    def normalising(self) -> bool:  # type: ignore[override]
        return self.is_normalising

    def weigh(self, norms: torch.Tensor, threshold: float) -> torch.Tensor:
        return self.function(norms, threshold, self)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}
