"""Typed options of ``make_private``: each validates itself; strings stay as shortcuts.

``resolve_options(**keywords)`` takes ``make_private``'s keyword arguments (legacy and typed forms) and
returns one frozen, validated :class:`RunOptions`, refusing irrelevant or contradictory options.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .clipping.functions import CLIP_FUNCTIONS, ClipFunction
from .clipping.groups import GROUPINGS, GroupSpec
from .components.thresholds import QuantileSettings
from .privacy.accounting import check_accountant
from .privacy.mechanisms import NOISE_ALLOCATIONS


def _positive(option: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{option} must be a number, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{option} must be a positive finite number, got {value}")
    return float(value)


def _non_negative(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and value >= 0 and math.isfinite(value))


def _fraction(option: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{option} must be in (0, 1), got {value!r}")
    return float(value)


def _count(option: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{option} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{option} must be ≥ 1, got {value}")
    return value


@dataclass(frozen=True)
class AutoS:
    """AUTO-S clipping R/(‖g‖ + γ); γ only shapes small gradients, never the privacy guarantee."""

    gamma: float = 0.01

    def __post_init__(self) -> None:
        _positive("AutoS.gamma", self.gamma)


@dataclass(frozen=True)
class AutoV:
    """AUTO-V clipping R/‖g‖: every example contributes norm R."""


@dataclass(frozen=True)
class PSAC:
    """DP-PSAC clipping R/(‖g‖ + r/(‖g‖ + r)); r has no effect on privacy."""

    r: float = 0.1

    def __post_init__(self) -> None:
        _positive("PSAC.r", self.r)


@dataclass(frozen=True)
class Abadi:
    """Abadi et al. clipping min(1, R/‖g‖)."""


@dataclass(frozen=True)
class Fixed:
    """Clip thresholds fixed at ``max_grad_norm`` throughout."""


@dataclass(frozen=True)
class AdaptiveQuantile:
    """Thresholds tracking a private ``target`` quantile of each group's norms; ``budget`` is the
    fraction of the privacy budget spent on the count releases (the total ε is unchanged).

    ``rescale`` (Abadi clipping with several groups): the estimates Qₖ set only the groups' relative
    thresholds, ``C̃ₖ = C·Qₖ/√(Σⱼ Qⱼ²)`` with C the initial total sensitivity (group-wise paper), so
    the total sensitivity, and the noise, stay fixed. The normalising clip functions always do this."""

    target: float = 0.5
    lr: float = 0.3
    budget: float = 0.01
    rescale: bool = False

    def __post_init__(self) -> None:
        _fraction("AdaptiveQuantile.target", self.target)
        _positive("AdaptiveQuantile.lr", self.lr)
        _fraction("AdaptiveQuantile.budget", self.budget)
        if not isinstance(self.rescale, bool):
            raise TypeError(f"AdaptiveQuantile.rescale must be True or False, got {self.rescale!r}")


_DOG_FIELDS = ("initial_distance", "noise_budget")
_HYFREEDP_FIELDS = ("interval", "loss_privacy", "gradient_noise_increase", "probes", "initial_lr")


@dataclass(frozen=True)
class AutoLR:
    """The automatic learning rate (``lr="auto"`` is ``AutoLR()``).

    ``mode="dog"`` (the default) sets the step size of plain SGD from the released gradients alone
    (``tunefree.autolr_dog``): noise-aware DoG, whose step is the distance travelled over the gradient
    energy with the known privacy noise taken out of both, bounded by a noise budget that keeps the
    planned run's noise walk within κ·(1 + ‖x₀‖) (``noise_budget`` κ; ``None`` turns it off). It
    releases nothing: no ε, no extra forward, no closure. ``initial_distance`` is DoG's first move
    relative to 1 + ‖x₀‖. Both constants were chosen on validation splits (benchmarks/RESULTS.md §5c,
    §5e). The other fields do not apply to it.

    ``mode="safeguarded"`` or ``"paper"`` is HyFreeDP (GeN-DP) for any optimizer: every ``interval``
    steps the learning rate is fitted to privatised losses of the current batch (``step(closure)``
    must return per-sample losses); the gradient noise grows by ``gradient_noise_increase`` (> 1) so
    that the whole run spends what plain DP-SGD would. ``"paper"`` sets η to the fitted value
    (HyFreeDP, Algorithm 1), ``"safeguarded"`` adds the safeguards of ``tunefree.autolr``. ``probes``:
    ``"losses"`` releases three clipped losses per update (the paper), ``"differences"`` two clipped
    per-sample loss differences Lᵢ(w ± Δ) − Lᵢ(w). ``initial_lr`` is η before the first fit (the
    paper's 10⁻⁴); ``loss_privacy`` is ``"gaussian"`` or ``"laplace"``. None of them changes ε: every
    release is accounted on the plan. On the benchmark tasks it does not match a tuned learning rate
    (benchmarks/RESULTS.md §5)."""

    interval: int = 5
    loss_privacy: str = "gaussian"
    gradient_noise_increase: float = 1.01
    mode: str = "dog"
    probes: str = "losses"
    initial_lr: float = 1e-4
    initial_distance: float = 0.1  # autolr_dog.INITIAL_DISTANCE
    noise_budget: float | None = 4.0  # autolr_dog.NOISE_BUDGET

    def __post_init__(self) -> None:
        _count("AutoLR.interval", self.interval)
        if self.loss_privacy not in ("gaussian", "laplace"):
            raise ValueError("AutoLR.loss_privacy must be 'gaussian' or 'laplace', "
                             f"got {self.loss_privacy!r}")
        if _positive("AutoLR.gradient_noise_increase", self.gradient_noise_increase) <= 1:
            raise ValueError("AutoLR.gradient_noise_increase must be > 1 (it pays for the loss releases), "
                             f"got {self.gradient_noise_increase}")
        if self.mode not in ("dog", "safeguarded", "paper"):
            raise ValueError(f"AutoLR.mode must be 'dog', 'safeguarded' or 'paper', got {self.mode!r}")
        if self.probes not in ("losses", "differences"):
            raise ValueError(f"AutoLR.probes must be 'losses' or 'differences', got {self.probes!r}")
        _positive("AutoLR.initial_lr", self.initial_lr)
        _positive("AutoLR.initial_distance", self.initial_distance)
        if self.noise_budget is not None:
            _positive("AutoLR.noise_budget", self.noise_budget)
        other_modes = _HYFREEDP_FIELDS if self.mode == "dog" else _DOG_FIELDS
        fields = AutoLR.__dataclass_fields__
        foreign = [name for name in other_modes if getattr(self, name) != fields[name].default]
        if foreign:
            raise ValueError(f"AutoLR({', '.join(foreign)}) has no effect with mode={self.mode!r}: drop "
                             f"them, or choose their mode ('dog': {', '.join(_DOG_FIELDS)}; "
                             f"'safeguarded'/'paper': {', '.join(_HYFREEDP_FIELDS)})")

    @property
    def releases_per_update(self) -> int:
        """Values released at each learning-rate update: three losses, two differences, or none (DoG)."""
        if self.mode == "dog":
            return 0
        return 3 if self.probes == "losses" else 2


Clipping = AutoS | AutoV | PSAC | Abadi
Thresholds = Fixed | AdaptiveQuantile

_CLIP_SHORTCUTS: dict[str, Clipping] = {"auto-s": AutoS(), "auto-v": AutoV(), "psac": PSAC(),
                                         "abadi": Abadi()}
_THRESHOLD_SHORTCUTS: dict[str, Thresholds] = {"fixed": Fixed(), "adaptive": AdaptiveQuantile()}


@dataclass(frozen=True)
class RunOptions:
    """Every setting of a private run, validated. ``quantile`` is ``None`` for fixed thresholds and
    ``auto_lr`` ``None`` when the optimizer's own learning rate is kept."""

    target_delta: float
    target_epsilon: float | None
    noise_multiplier: float | None
    epochs: float | None
    steps: int | None
    clip: ClipFunction
    max_grad_norm: float | Mapping[str, float]
    groups: GroupSpec
    loss_reduction: str
    accountant: str
    seed: int | None
    secure_rng: bool
    poisson_sampling: bool
    physical_batch_size: int | None
    noise_allocation: str
    quantile: QuantileSettings | None
    auto_lr: AutoLR | None
    verify_every: int | None = None
    batch_dim: int | Mapping[str, int] = 0


def _batch_dim(value: Any) -> int | Mapping[str, int]:
    """A dimension (an int ≥ 0), or a mapping from module names to dimensions (names are checked
    against the model when the engine is built)."""
    entries = value.items() if isinstance(value, Mapping) else [("", value)]
    for key, dim in entries:
        if not isinstance(key, str):
            raise TypeError(f"batch_dim's keys must be module names (str), got {key!r}")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"batch_dim must be an int or a mapping of module names to ints, got {value!r}")
        if dim < 0:
            raise ValueError(f"batch_dim must name dimensions ≥ 0, got {value!r}")
    return dict(value) if isinstance(value, Mapping) else value


def _refuse_irrelevant(given: dict[str, Any], applies_to: str) -> None:
    named = [name for name, value in given.items() if value is not None]
    if named:
        raise ValueError(f"{', '.join(named)} only apply to {applies_to}; set it or drop them")


def _clip_function(clipping: Any, clip_gamma: Any, psac_r: Any) -> ClipFunction:
    if isinstance(clipping, str):
        if clipping not in _CLIP_SHORTCUTS:
            if clipping in CLIP_FUNCTIONS:  # registered without a typed form
                _refuse_irrelevant({"clip_gamma": clip_gamma, "psac_r": psac_r}, "clipping='auto-s'/'psac'")
                return ClipFunction(clipping)
            raise ValueError(f"unknown clipping {clipping!r}: use one of {', '.join(CLIP_FUNCTIONS)} "
                             "or AutoS(), AutoV(), PSAC(), Abadi()")
        if clipping == "auto-s" and clip_gamma is not None:
            clipping = AutoS(clip_gamma)
            clip_gamma = None
        elif clipping == "psac" and psac_r is not None:
            clipping = PSAC(psac_r)
            psac_r = None
        else:
            clipping = _CLIP_SHORTCUTS[clipping]
    _refuse_irrelevant({"clip_gamma": clip_gamma}, "clipping='auto-s' (or use AutoS(gamma=...))")
    _refuse_irrelevant({"psac_r": psac_r}, "clipping='psac' (or use PSAC(r=...))")
    if isinstance(clipping, AutoS):
        return ClipFunction("auto-s", gamma=clipping.gamma)
    if isinstance(clipping, PSAC):
        return ClipFunction("psac", r=clipping.r)
    if isinstance(clipping, AutoV):
        return ClipFunction("auto-v")
    if isinstance(clipping, Abadi):
        return ClipFunction("abadi")
    raise TypeError(f"clipping must be a name or AutoS/AutoV/PSAC/Abadi, got {clipping!r}")


def _quantile(thresholds: Any, target: Any, lr: Any, budget: Any) -> QuantileSettings | None:
    legacy = {"target_quantile": target, "quantile_lr": lr, "quantile_budget": budget}
    if isinstance(thresholds, str):
        if thresholds not in _THRESHOLD_SHORTCUTS:
            raise ValueError(f"unknown thresholds {thresholds!r}: use 'fixed', 'adaptive', Fixed() or "
                             "AdaptiveQuantile(...)")
        if thresholds == "adaptive":
            for option, value, check in (("target_quantile", target, _fraction),
                                         ("quantile_lr", lr, _positive),
                                         ("quantile_budget", budget, _fraction)):
                if value is not None:
                    check(option, value)  # named as the caller gave it
            default = AdaptiveQuantile()
            thresholds = AdaptiveQuantile(default.target if target is None else target,
                                          default.lr if lr is None else lr,
                                          default.budget if budget is None else budget)
            legacy = {}
        else:
            thresholds = Fixed()
    _refuse_irrelevant(legacy, "thresholds='adaptive' (or give them inside AdaptiveQuantile(...))")
    if isinstance(thresholds, Fixed):
        return None
    if isinstance(thresholds, AdaptiveQuantile):
        return QuantileSettings(float(thresholds.target), float(thresholds.lr), float(thresholds.budget),
                                thresholds.rescale)
    raise TypeError("thresholds must be 'fixed', 'adaptive', Fixed() or AdaptiveQuantile(), "
                    f"got {thresholds!r}")


def _auto_lr(lr: Any) -> AutoLR | None:
    if lr == "auto":
        return AutoLR()
    if isinstance(lr, str):
        raise ValueError(f"unknown lr {lr!r}: use None (the optimizer's own), 'auto' or AutoLR(...)")
    if lr is None or isinstance(lr, AutoLR):
        return lr
    raise TypeError(f"lr must be None, 'auto' or AutoLR(...), got {lr!r}")


def _choice(option: str, value: Any, choices: tuple[str, ...] | Mapping[str, Any]) -> str:
    if value not in choices:
        raise ValueError(f"unknown {option} {value!r}: use one of {', '.join(choices)}")
    return value


def resolve_options(
    *,
    target_delta: float,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    clipping: str | Clipping = "auto-s",
    max_grad_norm: float | Mapping[str, float] = 1.0,
    groups: GroupSpec = "all-layer",
    loss_reduction: str = "mean",
    accountant: str = "pld",
    seed: int | None = None,
    secure_rng: bool = False,
    poisson_sampling: bool = True,
    max_physical_batch_size: int | None = None,
    physical_batch_size: int | None = None,
    clip_gamma: float | None = None,
    psac_r: float | None = None,
    noise_allocation: str = "global",
    thresholds: str | Thresholds = "fixed",
    target_quantile: float | None = None,
    quantile_lr: float | None = None,
    quantile_budget: float | None = None,
    lr: str | AutoLR | None = None,
    verify_every: int | None = None,
    batch_dim: int | Mapping[str, int] = 0,
) -> RunOptions:
    """Validate ``make_private``'s keyword arguments into one :class:`RunOptions`.

    Legacy keywords (``clip_gamma``, ``target_quantile``...) keep their meaning;
    given with a setting they do not apply to, or beside the typed form of the same setting, they are
    refused. ``max_physical_batch_size`` is an alias of ``physical_batch_size``.
    """
    if (target_epsilon is None) == (noise_multiplier is None):
        raise ValueError("give exactly one of target_epsilon and noise_multiplier")
    if target_epsilon is not None:
        _positive("target_epsilon", target_epsilon)
    if noise_multiplier is not None and not _non_negative(noise_multiplier):
        raise ValueError(f"noise_multiplier must be a finite number ≥ 0, got {noise_multiplier!r}")
    _fraction("target_delta", target_delta)
    if epochs is not None:
        _positive("epochs", epochs)
    if steps is not None:
        _count("steps", steps)
    if max_physical_batch_size is not None and physical_batch_size is not None:
        raise ValueError("give physical_batch_size only (max_physical_batch_size is its old name)")
    batch = physical_batch_size if max_physical_batch_size is None else max_physical_batch_size
    if batch is not None:
        _count("physical_batch_size" if physical_batch_size is not None else "max_physical_batch_size",
               batch)
    if batch is not None and not poisson_sampling:
        raise ValueError("physical_batch_size needs the Poisson loader (poisson_sampling=True)")
    for option, flag in (("secure_rng", secure_rng), ("poisson_sampling", poisson_sampling)):
        if not isinstance(flag, bool):
            raise TypeError(f"{option} must be True or False, got {flag!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if verify_every is not None:
        _count("verify_every", verify_every)
    check_accountant(accountant)
    if isinstance(groups, str):
        _choice("groups", groups, GROUPINGS)
    return RunOptions(
        target_delta=float(target_delta), target_epsilon=target_epsilon, noise_multiplier=noise_multiplier,
        epochs=epochs, steps=steps, clip=_clip_function(clipping, clip_gamma, psac_r),
        max_grad_norm=max_grad_norm, groups=groups,
        loss_reduction=_choice("loss_reduction", loss_reduction, ("mean", "sum")),
        accountant=accountant, seed=seed, secure_rng=secure_rng, poisson_sampling=poisson_sampling,
        physical_batch_size=batch,
        noise_allocation=_choice("noise_allocation", noise_allocation, NOISE_ALLOCATIONS),
        quantile=_quantile(thresholds, target_quantile, quantile_lr, quantile_budget),
        auto_lr=_auto_lr(lr),
        verify_every=verify_every,
        batch_dim=_batch_dim(batch_dim),
    )
