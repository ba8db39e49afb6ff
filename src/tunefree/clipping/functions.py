"""Per-sample clip functions: the typed option *is* the function.

A clip function turns each example's gradient norm ``‖gᵢ‖`` (of one clip group) into a weight ``wᵢ``
such that the clipped gradient ``wᵢ·gᵢ`` has norm at most the group's threshold ``R``. That bound is the
sensitivity the noise is calibrated to, so every function here is tested for it at norm 0, at tiny norms
and at huge norms. Each function is a frozen dataclass whose fields are its constants (none of which
changes the privacy guarantee), with ``weights(norms, threshold)`` and a ``normalising`` flag: whether
every example's clipped norm is (about) ``R`` whatever its gradient, so that a threshold only scales the
update (AUTO-S, AUTO-V, PSAC) rather than deciding which examples are clipped (Abadi).

A new function is one subclass, registered by name with ``@register_clip_function("name")``. Its
``weigh`` runs one example at a time (``torch.vmap``), so each weight is a function of that example's norm
alone; :func:`check_clip_function` refuses, before training, one that cannot run so or breaks the bound.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, TypeVar

import torch

from .._validate import positive
from ..errors import SettingsRefused


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
        be subnormal. Each example's weight depends on its own norm only: ``weigh`` runs one example at a
        time (the built-in functions, elementwise, on the whole batch)."""
        norms = norms.to(torch.float64)
        if type(self) in _ELEMENTWISE:
            return self.weigh(norms, threshold)
        return _one_example_at_a_time(self, norms, threshold)

    @abstractmethod
    def weigh(self, norms: torch.Tensor, threshold: float) -> torch.Tensor:
        """The weights of float64 ``norms`` (of a user's function: one example's norm, a 0-d tensor)."""

    def describe(self) -> dict[str, Any]:
        """The function and its constants as plain values (part of a run's identity)."""
        return {"name": self.name, **asdict(self)}  # type: ignore[call-overload]


# The registry: clip function name → a factory of the function with its default constants (a
# ClipFunction subclass). Add one with ``@register_clip_function("name")``.
CLIP_FUNCTIONS: dict[str, Callable[[], ClipFunction]] = {}

Registered = TypeVar("Registered", bound=type[ClipFunction])


def register_clip_function(name: str) -> Callable[[Registered], Registered]:
    """Decorator: make a ``ClipFunction`` subclass (a frozen dataclass with ``weigh`` and its
    ``normalising`` flag) usable as ``clipping=name``. It must keep ``weights·norms ≤ threshold`` for every
    norm ≥ 0."""
    def register(function: Registered) -> Registered:
        if name in CLIP_FUNCTIONS:
            raise ValueError(f"clip function {name!r} is already registered")
        if not (isinstance(function, type) and issubclass(function, ClipFunction)):
            raise TypeError(f"register_clip_function takes a ClipFunction subclass (a frozen dataclass with "
                            f"weigh(norms, threshold)), got {function!r}")
        function.name = name
        CLIP_FUNCTIONS[name] = function
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


# The built-in functions: elementwise arithmetic on the norms (tests/clipping/test_clipping.py checks each
# weight against its example's norm alone), evaluated on the whole batch in one call. Any other function,
# subclasses of these included, runs one example at a time.
_ELEMENTWISE: frozenset[type[ClipFunction]] = frozenset({AutoS, AutoV, PSAC, Abadi})


def _one_example_at_a_time(clip: ClipFunction, norms: torch.Tensor, threshold: float) -> torch.Tensor:
    """``clip.weigh`` of each norm alone (``torch.vmap`` over the examples), as float64 weights, one per
    norm. The function gets a copy, so that nothing it does in place reaches the norms the step books."""
    if norms.numel() == 0:
        return norms.new_zeros(norms.shape)
    try:
        weights = torch.vmap(lambda norm: torch.as_tensor(clip.weigh(norm, threshold), dtype=torch.float64,
                                                          device=norm.device))(norms.clone())
    except Exception as error:  # whatever the user's code raised: refused with the cause
        raise SettingsRefused(
            f"clip function {clip.name or type(clip).__name__!r} could not compute each example's weight "
            f"from that example's norm alone: tunefree runs its weigh(norms, threshold) one example at a "
            f"time (torch.vmap over the examples), so that no weight can depend on another example's "
            f"norm (a weight such as threshold / norms.max() would let one example move every other "
            f"example's clipped gradient), and it failed so: {type(error).__name__}: "
            f"{str(error).strip().rstrip('.')}. Write weigh "
            "as tensor arithmetic on the norm it is given: torch.where(norms > t, a, b) instead of "
            "if/else on a value, torch.clamp instead of min()/max() of Python numbers, no .item() or "
            "float(norms), no random numbers") from error
    if weights.shape != norms.shape:
        raise SettingsRefused(
            f"clip function {clip.name or type(clip).__name__!r} returned weights of shape "
            f"{tuple(weights.shape)} for {norms.numel()} norms: weigh must return one weight per norm, "
            "of the shape of the norm it is given")
    return weights


# The norms and thresholds a clip function is checked on before a run trains with it: zero, subnormal,
# tiny, ordinary and huge norms (both sides of every threshold), and thresholds of very different sizes.
_CHECKED_NORMS = (0.0, 5e-324, 1e-30, 1e-12, 1e-6, 0.01, 0.5, 1.0, 2.0, 3.0, 10.0, 1e6, 1e30, 1e300)
_CHECKED_THRESHOLDS = (1e-3, 0.1, 1.0, 7.5, 1e4)


def check_clip_function(clip: ClipFunction, thresholds: tuple[float, ...] = ()) -> None:
    """Refuse, before any release, a clip function whose weights are not a function of each example's own
    norm (it cannot run one example at a time) or that breaks ``wᵢ·‖gᵢ‖ ≤ R``, ``wᵢ ≥ 0`` or finiteness at
    a norm of :data:`_CHECKED_NORMS`, under each of ``thresholds`` (the run's) and
    :data:`_CHECKED_THRESHOLDS`. A grid: a function that breaks the bound only between its points is not
    seen (the registering user tests the bound, as ``tests/clipping/test_clipping.py`` does for the built-in
    ones)."""
    name = clip.name or type(clip).__name__
    norms = torch.tensor(_CHECKED_NORMS, dtype=torch.float64)
    for threshold in dict.fromkeys((*thresholds, *_CHECKED_THRESHOLDS)):
        weights = clip.weights(norms, threshold)
        clipped = weights * norms
        bad = ~(torch.isfinite(weights) & (weights >= 0) & (clipped <= threshold * (1 + _BOUND_SLACK)))
        if bad.any():
            i = int(bad.nonzero()[0])
            raise SettingsRefused(
                f"clip function {name!r} gives the weight {weights[i].item():.6g} to a gradient of norm "
                f"{norms[i].item():.6g} under the threshold {threshold:g}: the clipped norm "
                f"{clipped[i].item():.6g} must be finite, at least 0 and at most the threshold, which is the "
                "sensitivity the noise is calibrated to. Make weigh keep weights·norms ≤ threshold for "
                "every norm ≥ 0 (e.g. torch.minimum(w, threshold / norms.clamp_min(1e-30)))")


# A clipped norm may exceed the threshold by a few units in the last place of float64 (the division).
_BOUND_SLACK = 4 * torch.finfo(torch.float64).eps
