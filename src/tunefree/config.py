"""One definition of a run's settings: :class:`RunConfig` (what the guarantee depends on) and
:class:`Performance` (what changes only speed or memory).

Every ``make_private`` setting is a field here, defined and validated once; ``make_private`` keeps its
explicit signature, and a test checks that the two agree. Options are typed strategies: the clip
function (``AutoS``, ``AutoV``, ``PSAC``, ``Abadi``), the threshold rule (``Fixed``,
``AdaptiveQuantile``) and the learning-rate rule (``DoG``, ``HyFreeDP``). :meth:`RunConfig.from_keywords`
maps the string shortcuts onto them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import dp_accounting as dpa

from ._validate import count, flag, non_negative, one_of, positive
from .clipping.functions import PSAC, Abadi, AutoS, AutoV, ClipFunction, clip_function
from .clipping.groups import GROUPINGS, GroupSpec
from .components.dog import DoG
from .components.hyfreedp import HyFreeDP
from .components.thresholds import AdaptiveQuantile, Fixed
from .errors import SettingsRefused
from .privacy.accounting import ACCOUNTANTS, check_delta
from .privacy.ledger import to_dict
from .privacy.mechanisms import NOISE_ALLOCATIONS
from .rules.paths import NORM_PATHS

__all__ = ["PSAC", "Abadi", "AdaptiveQuantile", "AutoS", "AutoV", "DoG", "Fixed", "HyFreeDP", "Performance",
           "RunConfig"]

Thresholds = Fixed | AdaptiveQuantile
LearningRateRule = DoG | HyFreeDP


@dataclass(frozen=True)
class Performance:
    """Knobs that change speed or memory, never what is released or what it costs (they are not part
    of a run's identity: a checkpoint resumes under other values); documented at :func:`make_private`."""

    physical_batch_size: int | None = None
    verify_every: int | None = None
    norm_path: str = "auto"

    def __post_init__(self) -> None:
        if self.physical_batch_size is not None:
            count("physical_batch_size", self.physical_batch_size)
        if self.verify_every is not None:
            count("verify_every", self.verify_every)
        one_of("norm_path", self.norm_path, NORM_PATHS)


@dataclass(frozen=True)
class RunConfig:
    """Every setting of a private run, validated; the arguments of :func:`tunefree.make_private`
    (documented there) in their typed form."""

    target_delta: float
    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    epochs: float | None = None
    steps: int | None = None
    clipping: ClipFunction = field(default_factory=AutoS)
    max_grad_norm: float | Mapping[str, float] = 1.0
    groups: GroupSpec = "all-layer"
    loss_reduction: str = "mean"
    accountant: str = "pld"
    seed: int | None = None
    poisson_sampling: bool = True
    noise_allocation: str = "global"
    thresholds: Thresholds = field(default_factory=Fixed)
    lr: LearningRateRule | None = None
    audit_canaries: int | None = None
    batch_dim: int | Mapping[str, int] = 0
    public_buffers: tuple[str, ...] = ()
    prior_releases: tuple[dpa.DpEvent, ...] = ()
    performance: Performance = field(default_factory=Performance)

    def __post_init__(self) -> None:
        # one check per field
        check_delta(self.target_delta, option="target_delta")  # and below 1/N, once N is known (build)
        if self.target_epsilon is not None:
            positive("target_epsilon", self.target_epsilon)
        if self.noise_multiplier is not None:
            non_negative("noise_multiplier", self.noise_multiplier)
        if self.epochs is not None:
            positive("epochs", self.epochs)
        if self.steps is not None:
            count("steps", self.steps)
        _typed("clipping", self.clipping, ClipFunction, "a name or AutoS/AutoV/PSAC/Abadi")
        _check_max_grad_norm(self.max_grad_norm)
        if isinstance(self.groups, str):
            one_of("groups", self.groups, GROUPINGS)
        one_of("loss_reduction", self.loss_reduction, ("mean", "sum"))
        one_of("accountant", self.accountant, ACCOUNTANTS)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        flag("poisson_sampling", self.poisson_sampling)
        one_of("noise_allocation", self.noise_allocation, NOISE_ALLOCATIONS)
        _typed("thresholds", self.thresholds, (Fixed, AdaptiveQuantile),
               "'fixed', 'adaptive', Fixed() or AdaptiveQuantile()")
        if self.lr is not None:
            _typed("lr", self.lr, (DoG, HyFreeDP), "None, 'auto', DoG(...) or HyFreeDP(...)")
        if self.audit_canaries is not None and count("audit_canaries", self.audit_canaries) < 2:
            raise ValueError(f"audit_canaries must be at least 2 (half are members, half not), "
                             f"got {self.audit_canaries}")
        _check_batch_dim(self.batch_dim)
        if isinstance(self.public_buffers, list):  # validated against the model by the state guard
            object.__setattr__(self, "public_buffers", tuple(self.public_buffers))
        _check_prior_releases(self)
        _typed("performance", self.performance, Performance, "Performance(...)")
        # what the fields must agree on
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise SettingsRefused("give exactly one of target_epsilon and noise_multiplier")
        if self.epochs is not None and self.steps is not None:
            raise SettingsRefused("give epochs or steps, not both")
        if self.target_epsilon is not None and self.epochs is None and self.steps is None:
            raise SettingsRefused("target_epsilon needs the planned length of training: give epochs or steps")
        if self.performance.physical_batch_size is not None and not self.poisson_sampling:
            raise SettingsRefused("physical_batch_size needs the Poisson loader (poisson_sampling=True)")
        if self.audit_canaries is not None and self.noise_allocation == "weighted":
            raise SettingsRefused(
                "audit_canaries cannot be used with noise_allocation='weighted': its noise scales depend on "
                "the group sizes, which the canary block would change; use 'global' or 'equal-budget'")
        if self.audit_canaries is not None and self.noise_multiplier == 0:
            raise SettingsRefused("audit_canaries needs a noisy run: with noise_multiplier=0 everything is "
                                  "released exactly (ε = ∞) and there is nothing to audit")

    @classmethod
    def from_keywords(cls, **keywords: Any) -> RunConfig:
        """The config of ``make_private``'s keyword arguments: string shortcuts (``clipping="psac"``,
        ``thresholds="adaptive"``, ``lr="auto"``) become their typed options, and the speed knobs go into
        :class:`Performance`. ``None`` stands for a keyword not given."""
        keywords = {name: value for name, value in keywords.items() if value is not None}
        if isinstance(keywords.get("clipping"), str):
            keywords["clipping"] = clip_function(keywords["clipping"])
        if isinstance(keywords.get("thresholds"), str):
            keywords["thresholds"] = _named("thresholds", keywords["thresholds"], THRESHOLD_SHORTCUTS)
        if isinstance(keywords.get("lr"), str):
            keywords["lr"] = _named("lr", keywords["lr"], {"auto": DoG()})
        performance = {f.name: keywords.pop(f.name) for f in fields(Performance) if f.name in keywords}
        return cls(**keywords, performance=Performance(**performance))

    def identity(self) -> dict[str, Any]:
        """The settings that identify the run beyond its plan (clip function, threshold rule,
        learning-rate rule, allocation, loss reduction), as plain values."""
        return {"clipping": self.clipping.describe(), "thresholds": _describe(self.thresholds),
                "lr": None if self.lr is None else _describe(self.lr),
                "noise_allocation": self.noise_allocation, "loss_reduction": self.loss_reduction}


THRESHOLD_SHORTCUTS: dict[str, Thresholds] = {"fixed": Fixed(), "adaptive": AdaptiveQuantile()}


def _named(option: str, name: str, shortcuts: Mapping[str, Any]) -> Any:
    if name not in shortcuts:
        raise ValueError(f"unknown {option} {name!r}: use one of {', '.join(map(repr, shortcuts))} or the "
                         "typed form (e.g. AdaptiveQuantile(...), DoG(...), HyFreeDP(...))")
    return shortcuts[name]


def _typed(option: str, value: Any, kinds: type | tuple[type, ...], expected: str) -> None:
    if not isinstance(value, kinds):
        raise TypeError(f"{option} must be {expected}, got {value!r}")


def _check_prior_releases(config: RunConfig) -> None:
    """A tuple of DpEvents the ledger can store (a list is taken as a tuple)."""
    releases = config.prior_releases
    if isinstance(releases, dpa.DpEvent) or not isinstance(releases, (list, tuple)):
        raise TypeError(f"prior_releases must be a list of dp_accounting DpEvents, got {releases!r}")
    for event in releases:
        if not isinstance(event, dpa.DpEvent):
            raise TypeError(f"prior_releases must hold dp_accounting DpEvents, got {event!r}")
        to_dict(event)  # refuses an event the ledger cannot store
        if isinstance(event, dpa.PoissonSampledDpEvent):  # the ledger counts those as training steps
            raise ValueError(f"prior_releases holds a Poisson-sampled event {event!r}, which the ledger "
                             "would count as a training step: give it as dpa.ComposedDpEvent([event])")
    object.__setattr__(config, "prior_releases", tuple(releases))


def _check_max_grad_norm(value: Any) -> None:
    """The total sensitivity (a positive number), or a mapping from group names to positive thresholds
    (the names are checked against the groups when they are made)."""
    if not isinstance(value, Mapping):
        positive("max_grad_norm", value)
        return
    for name, threshold in value.items():
        if not isinstance(name, str):
            raise TypeError(f"max_grad_norm's keys must be clip group names (str), got {name!r}")
        positive(f"max_grad_norm[{name!r}]", threshold)


def _check_batch_dim(value: Any) -> None:
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


def _describe(option: Any) -> dict[str, Any]:
    """A typed option as plain values: its kind and its fields."""
    return {"kind": type(option).__name__, **{f.name: getattr(option, f.name) for f in fields(option)}}
