"""The planned run as one object: what every step releases, as a function of the run's noise.

A private run is Poisson sampling at rate q for T planned steps over N examples, accounted at δ. Each
step releases the noisy gradient sum and whatever the run's step components release, each component's
option declaring its **share** of the budget ahead (:class:`Share`): adaptive thresholds' clip counts
(:class:`CountShare`), HyFreeDP's privatised losses (``components/hyfreedp.py``).

:meth:`Plan.solve` calibrates σ (for a target ε) and then the noise of each share that has its own, once
and jointly on the planned ledger of the whole run; the result does not depend on the order the shares
were declared in. The plan's :meth:`Plan.fingerprint` identifies the run for checkpoints; its
:meth:`Plan.describe` is format 2.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar

import dp_accounting as dpa
import numpy as np
import torch
from torch.utils._pytree import tree_flatten
from torch.utils.data import TensorDataset

from ..errors import SettingsRefused
from .accounting import epsilon_of
from .calibrate import calibrate
from .ledger import to_dict

EVERY_EXAMPLE = "every-example:"  # the prefix of a data digest that covers every example
DESCRIPTION_FORMAT = 2


class Share:
    """A step component's share of the run's budget (public: ``tunefree.extend``): the releases its
    component makes on each step, declared ahead, so that the plan calibrates the run's noise for them.
    ε itself is accounted from the ledger, where each release is recorded as it is made
    (:meth:`~tunefree.extend.StepContext.release`): a component must release what its share declares, or
    the run spends another ε than the one it was calibrated for.

    A frozen dataclass subclass overrides :meth:`releases` and what differs from these defaults:
    ``increase`` multiplies the noise of every release of every step (1: none); ``budget`` is the fraction
    of each step's joint Gaussian release (of σ⁻²) its releases take (0: none; the gradient gets
    ``σ/√(1 − Σ budgets)``); ``period``: its releases repeat every this many steps; ``before_update``: it
    releases before the wrapped optimizer's update (the order of the step's releases in the ledger);
    ``noise``: its own noise multiplier, solved by the plan after σ so that the run spends the target
    (``None``: it has none, its noise follows from σ)."""

    before_update: ClassVar[bool] = False
    increase: float = 1.0
    budget: float = 0.0
    period: int = 1
    noise: float | None = None

    def releases(self, step: int, sigma: float) -> list[dpa.DpEvent]:
        """Its releases on 1-based ``step``, whose joint noise multiplier (σ times every increase) is
        ``sigma``."""
        raise NotImplementedError

    def with_noise(self, noise: float) -> Share:
        """The share with its own noise multiplier set (only for shares whose ``noise`` is not None)."""
        return replace(self, noise=noise)

    def describe(self) -> dict[str, Any]:
        """Its kind and settings, as plain values."""
        return {"kind": type(self).__name__, **asdict(self)}


@dataclass(frozen=True)
class CountShare(Share):
    """Adaptive thresholds: each step releases ``num_groups`` clip counts (sensitivity ½ each) with a
    fraction ``budget`` (r) of the step's budget — of σ⁻², the share of Rényi-DP at every order."""

    budget: float = field()  # a field without default (Share's class default would become one)
    num_groups: int = field()

    def __post_init__(self) -> None:  # made from a validated AdaptiveQuantile
        assert 0 < self.budget < 1 and self.num_groups >= 1, self

    def multiplier(self, sigma: float) -> float:
        """The joint noise multiplier of the K count releases: σ/√r."""
        return sigma / math.sqrt(self.budget)

    def std(self, sigma: float) -> float:
        """σ_b, the noise standard deviation of each count (sensitivity ½): ``multiplier·√K/2``."""
        return self.multiplier(sigma) * math.sqrt(self.num_groups) / 2

    def releases(self, step: int, sigma: float) -> list[dpa.DpEvent]:
        return [dpa.GaussianDpEvent(self.multiplier(sigma))]


@dataclass(frozen=True)
class Plan:
    """The planned private run.

    Args:
        sample_rate: q, the Poisson sampling rate of every step.
        steps: T, the planned number of steps (``None``: no plan of length; only with a given σ).
        num_examples: N, the size of the private data set.
        delta: δ of the guarantee.
        accountant: ``"pld"`` or ``"rdp"``.
        noise_multiplier: σ, the multiplier of each step's joint gradient (and count) release before
            the shares' increases; what a plain DP-SGD step of the same cost would use.
        shares: the components' shares of the budget, in the order their components record their
            releases within a step's phase (before / after the update).
        settings: the rest of what identifies the run (clip function, groups and their initial
            thresholds, threshold and learning-rate rules, a digest of the data); it is part of the
            fingerprint and changes no noise.
        prior: releases of the same private data made before the first step at their own, fixed noise
            (e.g. a command line's preprocessing: category sets, scaling, text lengths). They are part of
            the planned ledger, so σ is calibrated for the ε of the whole run, them included.
    """

    sample_rate: float
    steps: int | None
    num_examples: int
    delta: float
    accountant: str = "pld"
    noise_multiplier: float = 0.0
    shares: tuple[Share, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    prior: tuple[dpa.DpEvent, ...] = ()

    # ------------------------------------------------------------------ the noise of each release
    @property
    def step_noise(self) -> float:
        """σ times every share's increase: the multiplier of each step's joint release."""
        sigma = self.noise_multiplier
        for share in self.shares:
            sigma *= share.increase
        return sigma

    @property
    def gradient_noise(self) -> float:
        """The gradient release's noise multiplier: γ·σ/√(1 − Σ r)."""
        return self.step_noise / math.sqrt(1 - sum(share.budget for share in self.shares))

    @property
    def expected_batch_size(self) -> float:
        """q·N: noisy sums are divided by it, never by the private batch size."""
        return self.sample_rate * self.num_examples

    def share(self, kind: type) -> Any:
        """The share of type ``kind`` (``None``: not in this run)."""
        return next((s for s in self.shares if isinstance(s, kind)), None)

    @property
    def counts(self) -> CountShare | None:
        return self.share(CountShare)

    @property
    def count_noise(self) -> float:
        """The joint noise multiplier of the K count releases (0 without adaptive thresholds)."""
        return 0.0 if self.counts is None else self.counts.multiplier(self.step_noise)

    @property
    def count_std(self) -> float:
        """σ_b, the noise standard deviation of each count (0 without adaptive thresholds)."""
        return 0.0 if self.counts is None else self.counts.std(self.step_noise)

    def step_releases(self, step: int) -> list[dpa.DpEvent]:
        """The releases of 1-based ``step``, in the order the optimizer records them: the gradient, then
        the shares released before the update, then those released after it."""
        sigma = self.step_noise
        releases: list[dpa.DpEvent] = [dpa.GaussianDpEvent(self.gradient_noise)]
        for share in sorted(self.shares, key=lambda s: not s.before_update):
            releases += share.releases(step, sigma)
        return releases

    # ------------------------------------------------------------------ the planned ledger
    def event(self, steps: int | None = None) -> dpa.DpEvent:
        """The ledger of the prior releases and the first ``steps`` steps (the planned T by default), as
        one event: each kind of step (steps repeat with the shares' periods) once, with its count."""
        steps = self.steps if steps is None else steps
        if steps is None:
            raise ValueError("the plan has no planned length: give epochs or steps")
        period = math.lcm(1, *(share.period for share in self.shares))
        kinds: list[list[Any]] = []  # [releases, count], in order of first occurrence
        for step in range(1, min(period, steps) + 1):
            releases = self.step_releases(step)
            count = (steps - step) // period + 1
            same = next((kind for kind in kinds if kind[0] == releases), None)
            if same is None:
                kinds.append([releases, count])
            else:
                same[1] += count
        parts = []
        for releases, count in kinds:
            inner = releases[0] if len(releases) == 1 else dpa.ComposedDpEvent(releases)
            sampled = dpa.PoissonSampledDpEvent(self.sample_rate, inner)
            parts.append(dpa.SelfComposedDpEvent(sampled, count))
        return dpa.ComposedDpEvent([*self.prior, *parts])

    def epsilon(self, steps: int | None = None) -> float:
        """ε at δ that the planned run (or its first ``steps`` steps) spends."""
        return epsilon_of(self.event(steps), self.delta, self.accountant)

    # ------------------------------------------------------------------ calibration and budget splits
    def solve(self, target_epsilon: float | None = None) -> Plan:
        """The plan with its noise solved, jointly on the planned run: σ for ``target_epsilon`` (with
        the shares whose noise follows from σ inside each step), then the noise of each share that has
        its own, so that the run with it spends the target (by default what the run at σ without it
        would). Without a target, σ is kept."""
        own = [index for index, share in enumerate(self.shares) if share.noise is not None]
        plan = self
        for index in own:
            plan = plan._with_share_noise(index, 0.0)
        if target_epsilon is not None:
            if self.steps is None:
                raise ValueError("target_epsilon needs the planned length of training: give epochs or steps")
            self._check_prior_leaves_room(target_epsilon)
            without = tuple(s for s in plan.shares if s.noise is None)
            sigma = calibrate(lambda s: replace(plan, noise_multiplier=s, shares=without).event(),
                              target_epsilon, self.delta, self.accountant)
            plan = replace(plan, noise_multiplier=sigma)
        if own and plan.steps is None:
            name = type(self.shares[own[0]]).__name__
            raise ValueError(f"{name} has its own noise, solved over the planned run: give epochs or steps")
        if plan.noise_multiplier == 0:
            return plan
        for index in own:
            plan = plan._solve_share(index, target_epsilon)
        return plan

    def _check_prior_leaves_room(self, target_epsilon: float) -> None:
        """The releases made before training must leave some of ``target_epsilon`` for it."""
        if not self.prior:
            return
        spent = epsilon_of(dpa.ComposedDpEvent(list(self.prior)), self.delta, self.accountant)
        if spent >= target_epsilon:
            raise SettingsRefused(
                f"the {len(self.prior)} release(s) made before training (prior_releases) already spend "
                f"ε = {spent:.4g} at δ = {self.delta:.3g}, at least the target ε = {target_epsilon:g}: "
                "nothing is left for training. Give them more noise (a smaller share of the budget) or a "
                "larger target_epsilon")

    def _with_share_noise(self, index: int, noise: float) -> Plan:
        shares = list(self.shares)
        shares[index] = shares[index].with_noise(noise)
        return replace(self, shares=tuple(shares))

    def _solve_share(self, index: int, target_epsilon: float | None) -> Plan:
        """The plan with share ``index``'s own noise solved so that the run spends ``target_epsilon``
        (``None``: what it spends without that share)."""
        if target_epsilon is None:
            target_epsilon = replace(self, shares=self.shares[:index] + self.shares[index + 1:]).epsilon()
        noise = calibrate(lambda s: self._with_share_noise(index, s).event(), target_epsilon, self.delta,
                          self.accountant)
        return self._with_share_noise(index, noise)

    # ------------------------------------------------------------------ identity, for checkpoints
    def describe(self) -> dict[str, Any]:
        """Everything that identifies the run, as plain JSON values (description format 2; ``prior`` only
        when releases were made before training, so that the descriptions of other runs are unchanged)."""
        prior = {"prior": [to_dict(event) for event in self.prior]} if self.prior else {}
        return json.loads(json.dumps({**prior,
            "format": DESCRIPTION_FORMAT, "sample_rate": self.sample_rate, "steps": self.steps,
            "num_examples": self.num_examples, "delta": self.delta, "accountant": self.accountant,
            "noise_multiplier": self.noise_multiplier, "gradient_noise": self.gradient_noise,
            "shares": [share.describe() for share in self.shares],
            **{f"settings.{key}": value for key, value in sorted(self.settings.items())},
        }, sort_keys=True))

    def fingerprint(self) -> str:
        """A hash of :meth:`describe`."""
        text = json.dumps(self.describe(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def differences(self, description: Mapping[str, Any]) -> list[str]:
        """What differs between the run ``description`` describes and this one, one line each."""
        mine = self.describe()
        return [f"{key}: {description.get(key)!r} in the checkpoint, {mine.get(key)!r} here"
                for key in sorted(set(mine) | set(description)) if mine.get(key) != description.get(key)]


def data_digest(dataset: Any, num_examples: int) -> str:
    """A digest of every example of the private data set, in order: a streaming SHA-256 of each tensor of
    a ``TensorDataset`` (its dtype, shape and bytes), or of every ``dataset[i]``'s leaves for any other
    data set (tensors and NumPy arrays by their bytes, numbers and strings by ``repr``, objects with
    ``tobytes()`` by their bytes, anything else by its type only). Checkpoints cannot resume onto other
    data, and data-parallel ranks must hold the same data set, example for example. It reads the whole
    data set once (other data sets: one pass of ``__getitem__``); it is computed from private data, like
    the rest of a checkpoint's privacy state (which holds the noise seed): keep checkpoints private."""
    digest = hashlib.sha256(str(num_examples).encode())
    if isinstance(dataset, TensorDataset):
        for tensor in dataset.tensors:
            _digest_leaf(digest, tensor)
    else:
        for index in range(num_examples):
            for leaf in tree_flatten(dataset[index])[0]:
                _digest_leaf(digest, leaf)
    return EVERY_EXAMPLE + digest.hexdigest()[:32]


def _digest_leaf(digest: Any, leaf: Any) -> None:
    if isinstance(leaf, torch.Tensor):
        leaf = leaf.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
        digest.update(leaf.view(torch.uint8).numpy())
    elif isinstance(leaf, np.ndarray):
        digest.update(f"{leaf.dtype}{leaf.shape}".encode())
        digest.update(np.ascontiguousarray(leaf).view(np.uint8))
    elif isinstance(leaf, (int, float, complex, str, bytes, bool, type(None))):
        digest.update(repr(leaf).encode())
    elif hasattr(leaf, "tobytes"):  # e.g. a PIL image
        digest.update(leaf.tobytes())
    else:
        digest.update(type(leaf).__name__.encode())
