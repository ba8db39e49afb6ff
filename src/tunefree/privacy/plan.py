"""The planned run as one object: what every step releases, as a function of the run's noise.

A private run is Poisson sampling at rate q for T planned steps over N examples, accounted at δ. Each
step releases the noisy gradient sum and, depending on the run's components:

- adaptive thresholds (``CountShare``): K clip counts, spending a fraction r of the step's budget
  (group-wise clipping paper, Prop. 3.1): the gradient gets ``σ/√(1−r)``, the counts ``σ/√r``, and
  together they are one Gaussian mechanism of multiplier σ;
- ``lr="auto"`` (``LossShare``): every K-th step, three privatised losses (or two loss differences) of
  noise σ_l; the gradient
  noise grows by γ and σ_l is solved so that the whole run spends what the run without them would
  (HyFreeDP, Algorithm 2).

:meth:`Plan.solve` calibrates σ (for a target ε) and then the loss share, once and jointly on the
planned ledger of the whole run; the result does not depend on the order the components were declared
in. The plan's :meth:`Plan.fingerprint` identifies the run for checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import dp_accounting as dpa
import numpy as np
import torch
from torch.utils._pytree import tree_flatten
from torch.utils.data import TensorDataset

from .accounting import epsilon_of
from .calibrate import calibrate

LOSS_RELEASES_PER_UPDATE = 3  # privatised losses at w − Δ, w, w + Δ
EVERY_EXAMPLE = "every-example:"  # the prefix of a data digest that covers every example


@dataclass(frozen=True)
class CountShare:
    """Adaptive thresholds: each step releases ``num_groups`` clip counts (sensitivity ½ each) with a
    fraction ``budget`` (r) of the step's budget — of σ⁻², the share of Rényi-DP at every order."""

    budget: float
    num_groups: int

    def __post_init__(self) -> None:
        if not 0 < self.budget < 1:
            raise ValueError(f"the count budget r must be in (0, 1), got {self.budget}")
        if self.num_groups < 1:
            raise ValueError(f"adaptive thresholds need at least one clip group, got {self.num_groups}")


@dataclass(frozen=True)
class LossShare:
    """``lr="auto"``: every ``interval``-th step (the first included) releases ``releases`` values
    (three losses, or two loss differences) with ``privacy`` noise (``"gaussian"`` or ``"laplace"``);
    the gradient noise is multiplied by ``increase`` (γ > 1) to leave room for them in the budget."""

    interval: int
    privacy: str = "gaussian"
    increase: float = 1.01
    releases: int = LOSS_RELEASES_PER_UPDATE

    def __post_init__(self) -> None:
        if isinstance(self.interval, bool) or int(self.interval) != self.interval or self.interval < 1:
            raise ValueError(f"lr_update_interval must be a positive integer, got {self.interval}")
        if self.privacy not in ("gaussian", "laplace"):
            raise ValueError(f"loss_privacy must be 'gaussian' or 'laplace', got {self.privacy!r}")
        if not (self.increase > 1 and math.isfinite(self.increase)):
            raise ValueError(f"gradient_noise_increase must be a number above 1, got {self.increase}")
        if isinstance(self.releases, bool) or not isinstance(self.releases, int) or self.releases < 1:
            raise ValueError(f"releases per learning-rate update must be a positive int, got {self.releases}")

    def updates(self, steps: int) -> int:
        """Steps among the first ``steps`` that release losses: ⌈T/K⌉."""
        return math.ceil(steps / self.interval)

    def releases_on(self, step: int) -> bool:
        """Whether 1-based ``step`` refits the learning rate (and so releases losses)."""
        return (step - 1) % self.interval == 0


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
            the loss share; what a plain DP-SGD step of the same cost would use.
        loss_noise: σ_l of each loss release (0 without ``losses``).
        counts, losses: the components' shares of the budget (``None``: not in this run).
        settings: the rest of what identifies the run (clip function, groups and their initial
            thresholds, quantile and learning-rate settings, a digest of the data); it is part of the
            fingerprint and changes no noise.
    """

    sample_rate: float
    steps: int | None
    num_examples: int
    delta: float
    accountant: str = "pld"
    noise_multiplier: float = 0.0
    loss_noise: float = 0.0
    counts: CountShare | None = None
    losses: LossShare | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ the noise of each release
    @property
    def gradient_noise(self) -> float:
        """The gradient release's noise multiplier: γ·σ/√(1−r)."""
        sigma = self.noise_multiplier * (self.losses.increase if self.losses else 1.0)
        return sigma / math.sqrt(1 - self.counts.budget) if self.counts else sigma

    @property
    def count_noise(self) -> float:
        """The joint noise multiplier of the K count releases: γ·σ/√r (0 without adaptive thresholds)."""
        if self.counts is None:
            return 0.0
        sigma = self.noise_multiplier * (self.losses.increase if self.losses else 1.0)
        return sigma / math.sqrt(self.counts.budget)

    @property
    def count_std(self) -> float:
        """σ_b, the noise standard deviation of each count (sensitivity ½): ``count_noise·√K/2``."""
        if self.counts is None:
            return 0.0
        return self.count_noise * math.sqrt(self.counts.num_groups) / 2

    @property
    def expected_batch_size(self) -> float:
        """q·N: noisy sums are divided by it, never by the private batch size."""
        return self.sample_rate * self.num_examples

    def loss_event(self) -> dpa.DpEvent:
        if self.losses is not None and self.losses.privacy == "laplace":
            return dpa.LaplaceDpEvent(self.loss_noise)
        return dpa.GaussianDpEvent(self.loss_noise)

    def step_releases(self, step: int) -> list[dpa.DpEvent]:
        """The releases of 1-based ``step``, in the order the optimizer records them: the gradient,
        the losses (on a learning-rate update step), the counts."""
        releases = [dpa.GaussianDpEvent(self.gradient_noise)]
        if self.losses is not None and self.losses.releases_on(step):
            releases += [self.loss_event()] * self.losses.releases
        if self.counts is not None:
            releases.append(dpa.GaussianDpEvent(self.count_noise))
        return releases

    # ------------------------------------------------------------------ the planned ledger
    def event(self, steps: int | None = None) -> dpa.DpEvent:
        """The ledger of the first ``steps`` steps (the planned T by default), as one event."""
        steps = self.steps if steps is None else steps
        if steps is None:
            raise ValueError("the plan has no planned length: give epochs or steps")
        kinds: list[tuple[list[dpa.DpEvent], int]] = []
        if self.losses is None:
            kinds.append((self.step_releases(1), steps))
        else:
            updates = self.losses.updates(steps)
            kinds.append((self.step_releases(1), updates))
            if self.losses.interval > 1:
                kinds.append((self.step_releases(2), steps - updates))
        parts = []
        for releases, count in kinds:
            if count > 0:
                inner = releases[0] if len(releases) == 1 else dpa.ComposedDpEvent(releases)
                parts.append(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(self.sample_rate, inner),
                                                     count))
        return dpa.ComposedDpEvent(parts)

    def epsilon(self, steps: int | None = None) -> float:
        """ε at δ that the planned run (or its first ``steps`` steps) spends."""
        return epsilon_of(self.event(steps), self.delta, self.accountant)

    # ------------------------------------------------------------------ calibration and budget splits
    def solve(self, target_epsilon: float | None = None) -> Plan:
        """The plan with its noise solved, jointly on the planned run: σ for ``target_epsilon`` (with
        the count share inside each step), then σ_l so that the run with the loss share spends the
        target (by default what the run at σ without it would). Without a target, σ is kept."""
        plan = replace(self, loss_noise=0.0)
        if target_epsilon is not None:
            if self.steps is None:
                raise ValueError("target_epsilon needs the planned length of training: give epochs or steps")
            sigma = calibrate(lambda s: replace(plan, noise_multiplier=s, losses=None).event(),
                              target_epsilon, self.delta, self.accountant)
            plan = replace(plan, noise_multiplier=sigma)
        if plan.losses is not None and plan.steps is None:
            raise ValueError("HyFreeDP's learning rate (AutoLR(mode='safeguarded'/'paper')) splits the "
                             "budget over the planned run: give epochs or steps")
        if plan.losses is None or plan.noise_multiplier == 0:
            return plan
        target = replace(plan, losses=None).epsilon() if target_epsilon is None else target_epsilon
        loss_noise = calibrate(lambda s: replace(plan, loss_noise=s).event(), target, self.delta,
                               self.accountant)
        return replace(plan, loss_noise=loss_noise)

    # ------------------------------------------------------------------ identity, for checkpoints
    def describe(self) -> dict[str, Any]:
        """Everything that identifies the run, as plain JSON values."""
        return json.loads(json.dumps({
            "sample_rate": self.sample_rate, "steps": self.steps, "num_examples": self.num_examples,
            "delta": self.delta, "accountant": self.accountant,
            "noise_multiplier": self.noise_multiplier, "gradient_noise": self.gradient_noise,
            "count_noise": self.count_noise, "loss_noise": self.loss_noise,
            "counts": None if self.counts is None else vars(self.counts),
            "losses": None if self.losses is None else vars(self.losses),
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


def is_digest_of_0_1(recorded: Any, dataset: Any, num_examples: int) -> bool:
    """Whether ``recorded`` is the data digest a checkpoint of tunefree 0.1 holds for this data set: that
    version hashed the first, middle and last example only (no ``EVERY_EXAMPLE`` prefix), so its
    checkpoints are recognised by those three examples."""
    if not isinstance(recorded, str) or recorded.startswith(EVERY_EXAMPLE):
        return False
    digest = hashlib.sha256(str(num_examples).encode())
    for index in sorted({0, num_examples // 2, num_examples - 1}):
        for leaf in tree_flatten(dataset[index])[0]:
            if isinstance(leaf, torch.Tensor):
                leaf = leaf.detach().cpu().contiguous()
                digest.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
                digest.update(leaf.reshape(-1).view(torch.uint8).numpy().tobytes())
            elif hasattr(leaf, "tobytes"):
                digest.update(leaf.tobytes())
            else:
                digest.update(repr(leaf).encode() if isinstance(leaf, (int, float, str, bytes))
                              else type(leaf).__name__.encode())
    return recorded == digest.hexdigest()[:16]


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
