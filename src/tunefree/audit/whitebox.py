"""A white-box view of a real private run: the released noisy sums on the canary coordinates.

The run is built by :func:`tunefree.make_private` and stepped as any user's loop would; a step post
hook on the private optimizer reads the canary rows of the noisy mean gradient the optimizer wrote into
``.grad`` — what the release made public. Nothing is simulated: sampling, clipping, noise, the step
components and the ledger are the library's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from numpy.random import Generator

from ..api import make_private
from ..config import HyFreeDP
from ..run import DPEngine
from .design import CanaryModel, canary_data, per_example_losses


@dataclass(frozen=True)
class AuditSettings:
    """The configuration audited, with the flag names of ``tunefree train``/``tunefree epsilon``.

    Args:
        canaries: m, gradient canaries, each included independently with probability ½.
        steps: T, the planned (and run) number of steps.
        sample_rate: q, Poisson sampling rate (a fraction with denominator ≤ 10⁴).
        noise_multiplier, target_epsilon: σ, or the ε the noise is calibrated for (one of them).
        delta: δ of the guarantee audited.
        clipping, groups, thresholds: as in ``make_private``.
        lr: the run's SGD learning rate: a number, ``"auto"`` (DoG, no release of its own) or
            ``"hyfreedp"`` (HyFreeDP, whose loss releases the audit then covers too).
        real_examples: at least this many real (non-canary) examples.
        confidence: of ε_LB and of each check.
        seed: seeds membership, data and the run (a reproducible audit); ``None``: secure randomness.
    """

    canaries: int = 1000
    steps: int = 20
    sample_rate: float = 0.5
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    clipping: str = "auto-s"
    groups: str = "all-layer"
    thresholds: str = "fixed"
    lr: float | str = 0.1
    accountant: str = "pld"
    real_examples: int = 256
    confidence: float = 0.95
    seed: int | None = None

    def __post_init__(self) -> None:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("give noise_multiplier or target_epsilon (exactly one)")
        if self.noise_multiplier is not None and not self.noise_multiplier > 0:
            raise ValueError(f"an audit needs noise: noise_multiplier must be > 0 (σ = 0 has ε = ∞), "
                             f"got {self.noise_multiplier}")
        if self.canaries < 1 or self.steps < 1 or self.real_examples < 2:
            raise ValueError("canaries and steps must be at least 1 and real_examples at least 2")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence}")


@dataclass(frozen=True)
class Observation:
    """What the white-box auditor saw of one run.

    ``z[t, j]``: canary j's coordinate of step t's release, in units of the noise standard deviation the
    run claims (positive: towards the canary); ``shift[t]``: μₜ, what one included, sampled canary adds
    to it in those units.
    """

    z: np.ndarray
    shift: np.ndarray
    sample_rate: float
    recorded_steps: int

    def scores(self) -> np.ndarray:
        """Each canary's log-likelihood ratio of "included" over "left out" under the claimed mechanism
        (Poisson-sampled Gaussian): the most powerful score if the run is what it claims, and a valid
        score whatever it is."""
        q, mu = self.sample_rate, self.shift[:, None]
        absent = math.log1p(-q) if q < 1 else -math.inf
        return np.logaddexp(absent, math.log(q) + mu * self.z - mu ** 2 / 2).sum(axis=0)


def build_run(settings: AuditSettings, included: np.ndarray, generator: Generator
              ) -> tuple[DPEngine, CanaryModel]:
    """The private run over the real examples and the included canaries, through ``make_private``."""
    data = canary_data(torch.as_tensor(included), settings.sample_rate, settings.real_examples,
                       generator)
    model = CanaryModel(len(included))
    automatic = {"auto": "auto", "hyfreedp": HyFreeDP()}
    auto = automatic.get(settings.lr) if isinstance(settings.lr, str) else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 if auto else float(settings.lr))
    loader = torch.utils.data.DataLoader(data.dataset, batch_size=data.batch_size)
    engine = make_private(
        model, optimizer, loader, target_delta=settings.delta, target_epsilon=settings.target_epsilon,
        noise_multiplier=settings.noise_multiplier, steps=settings.steps, clipping=settings.clipping,
        groups=settings.groups, thresholds=settings.thresholds, lr=auto,
        loss_reduction="sum", accountant=settings.accountant, seed=settings.seed)
    return engine, model


def observe(engine: DPEngine, model: CanaryModel, steps: int) -> Observation:
    """Train ``steps`` steps, recording the canary coordinates of every release."""
    canary_weight = model.canary.weight
    group = next(g for g in engine.groups if any(p is canary_weight for p in g.params))
    auto = engine.optimizer.closure_gives_per_sample_losses
    z, shift = [], []

    def record(optimizer, *args, **kwargs) -> None:
        thresholds = engine.last_step.thresholds
        std = engine.plan.gradient_noise * math.sqrt(sum(c * c for c in thresholds.values()))
        released = canary_weight.grad[:model.canaries, 0].detach().to(torch.float64)
        z.append((-released * engine.plan.expected_batch_size / std).numpy())
        shift.append(thresholds[group.name] / std)

    handle = engine.optimizer.register_step_post_hook(record)
    try:
        while len(z) < steps:
            for x, ids, y in engine.data_loader:
                engine.optimizer.zero_grad()
                per_example_losses(model, x, ids, y).sum().backward()
                closure = (lambda: per_example_losses(model, x, ids, y)) if auto else None  # noqa: B023
                engine.optimizer.step(closure)
                if len(z) == steps:
                    break
    finally:
        handle.remove()
    return Observation(np.stack(z), np.array(shift), engine.sample_rate, engine.steps)
