"""A complete private training run from a configuration: what ``tunefree train`` does.

``train(config)`` loads the data, builds the default model, calls :func:`tunefree.make_private`, trains,
evaluates on the held-out split and returns the result; the command line is a thin layer over it, and
experiments reuse it.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from ..api import DPEngine, make_private
from ..autolr import AutoLearningRate
from ..privacy.calibration import MIN_NOISE_MULTIPLIER
from . import datasets, models
from .report import RunDirectory, norm_statistics

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    "nadam": lambda params, lr: torch.optim.NAdam(params, lr=lr),
    "radam": lambda params, lr: torch.optim.RAdam(params, lr=lr),
    "adagrad": lambda params, lr: torch.optim.Adagrad(params, lr=lr),
}
# The learning rate each optimizer gets when none is given: chosen once, by a sweep on the public
# digits data at ε = 3 with AUTO-S clipping (R = 1) and the default model (docs/cli.md lists the
# sweep). With AUTO-S the threshold R no longer matters, so these carry over to other data as sane
# starting points; SGD's effective step is lr·R.
DEFAULT_LR = {"sgd": 2.0, "momentum": 0.2, "adam": 0.02, "adamw": 0.02, "nadam": 0.02,
              "radam": 0.02, "adagrad": 0.2}


@dataclass
class TrainConfig:
    """Everything a run depends on. ``delta=None`` means 1/N^1.1 for N training examples. The run's
    length is ``epochs`` (possibly fractional) or ``steps``: the noise is calibrated for, and training
    runs, exactly ``planned_steps(epochs, steps, q)`` logical steps."""

    dataset: str = "digits"
    label_column: str = "label"
    model: str = "auto"
    epsilon: float = 3.0
    delta: float | None = None
    epochs: float | None = 40
    steps: int | None = None
    batch_size: int = 256
    clipping: str = "auto-s"
    groups: str = "all-layer"
    thresholds: str = "fixed"
    target_quantile: float | None = None
    optimizer: str = "adam"
    lr: float | str | None = None  # a number, "auto" (GeN-DP), or None for the default
    max_grad_norm: float = 1.0
    accountant: str = "pld"
    seed: int | None = None
    out: str | None = None
    quiet: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # further make_private keywords

    def resolved_lr(self) -> float:
        """The learning rate the optimizer is built with (with "auto", the starting value is set by
        the automatic learning rate itself)."""
        return DEFAULT_LR[self.optimizer] if self.lr in (None, "auto") else float(self.lr)


def default_delta(num_examples: int) -> float:
    return 1.0 / num_examples ** 1.1


def loose_target_note(target_epsilon: float, noise_multiplier: float, spent: float) -> str | None:
    """What to tell a person whose target ε is so loose that calibration stopped at its noise floor."""
    if noise_multiplier > MIN_NOISE_MULTIPLIER:
        return None
    return (f"the target ε = {target_epsilon:g} is looser than any useful noise: calibration stops at "
            f"σ = {MIN_NOISE_MULTIPLIER}, where this run spends ε = {spent:.4g} < {target_epsilon:g}")


def check_config(config: TrainConfig) -> None:
    """Refuse a bad configuration before any data is touched."""
    if not (config.epsilon > 0 and math.isfinite(config.epsilon)):
        raise ValueError(f"--epsilon must be a positive number, got {config.epsilon}")
    if config.delta is not None and not 0 < config.delta < 1:
        raise ValueError(f"--delta must be in (0, 1), got {config.delta}")
    if config.epochs is not None and config.steps is not None:
        raise ValueError("give --epochs or --steps, not both")
    if config.epochs is None and config.steps is None:
        raise ValueError("give the length of the run: --epochs or --steps")
    if config.epochs is not None and not (config.epochs > 0 and math.isfinite(config.epochs)):
        raise ValueError(f"--epochs must be a positive number, got {config.epochs}")
    if config.steps is not None and not (isinstance(config.steps, int) and config.steps >= 1):
        raise ValueError(f"--steps must be at least 1, got {config.steps}")
    if config.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {config.batch_size}")
    if config.target_quantile is not None and config.thresholds != "adaptive":
        raise ValueError("--target-quantile applies only to --thresholds adaptive: drop it or add "
                         "--thresholds adaptive")
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {config.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    if config.lr not in (None, "auto") and not (float(config.lr) > 0 and math.isfinite(config.lr)):
        raise ValueError(f"--lr must be a positive number or 'auto', got {config.lr}")


@torch.no_grad()
def accuracy(model: nn.Module, data, batch_size: int = 1024) -> float:
    """Accuracy of ``model`` on a held-out data set (evaluation mode, no gradients)."""
    was_training = model.training
    model.eval()
    correct = 0
    for x, y in DataLoader(data, batch_size=batch_size):
        correct += int((model(x).argmax(1) == y).sum())
    model.train(was_training)
    return correct / len(data)


class Progress:
    """One line per epoch on stderr: a bar with loss, accuracy and ε spent so far."""

    def __init__(self, epochs: int, steps_per_epoch: int, quiet: bool):
        self.epochs, self.steps, self.quiet = epochs, steps_per_epoch, quiet

    def update(self, epoch: int, step: int, loss: float, acc: float, epsilon: float,
               final: bool = False) -> None:
        if self.quiet:
            return
        filled = int(20 * step / max(self.steps, 1))
        bar = "#" * filled + "." * (20 - filled)
        eps = "   -  " if math.isnan(epsilon) else f"{epsilon:6.3f}"
        sys.stderr.write(f"\repoch {epoch:3d}/{self.epochs} [{bar}] loss {loss:6.4f} "
                         f"acc {acc:5.3f} ε {eps}")
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _step(engine: DPEngine, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
    """One private step; returns the batch's summed loss, correct predictions and size."""
    engine.optimizer.zero_grad()

    def per_sample_losses() -> torch.Tensor:  # for lr="auto": the batch's losses at probe points
        return F.cross_entropy(engine.model(x), y, reduction="none")

    closure = per_sample_losses if engine.optimizer.closure_gives_per_sample_losses else None
    if len(y) == 0:  # an empty Poisson batch: no loss to compute, but the step (noise) happens
        engine.optimizer.step(closure)
        return 0.0, 0, 0
    logits = engine.model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    engine.optimizer.step(closure)
    return float(loss.detach()) * len(y), int((logits.argmax(1) == y).sum()), len(y)


def train(config: TrainConfig, data: datasets.LoadedData | None = None) -> dict[str, Any]:
    """Run private training as configured; returns the result (also written to ``config.out``)."""
    check_config(config)
    data = data or datasets.load(config.dataset, config.label_column)
    delta = config.delta if config.delta is not None else default_delta(data.num_train)
    if data.num_train < config.batch_size:
        raise ValueError(f"--batch-size {config.batch_size} is larger than the {data.num_train} training "
                         f"examples: use --batch-size {data.num_train} or less")
    if config.seed is not None:
        torch.manual_seed(config.seed)  # initialisation only; the release's randomness is make_private's
    model = models.build(config.model, data.kind, data.input_shape, data.num_classes)
    optimizer = OPTIMIZERS[config.optimizer](model.parameters(), config.resolved_lr())
    engine = make_private(
        model, optimizer, DataLoader(data.train, batch_size=config.batch_size),
        target_epsilon=config.epsilon, target_delta=delta, epochs=config.epochs, steps=config.steps,
        clipping=config.clipping, groups=config.groups, max_grad_norm=config.max_grad_norm,
        thresholds=config.thresholds,
        target_quantile=config.target_quantile,
        lr="auto" if config.lr == "auto" else None,
        accountant=config.accountant, seed=config.seed, **config.extra)
    run = RunDirectory(config.out) if config.out else None
    planned = engine.planned_steps
    steps_per_epoch = len(engine.data_loader)
    epochs = math.ceil(planned / steps_per_epoch)  # the last one partial when planned is not a multiple
    progress = Progress(epochs, steps_per_epoch, config.quiet)
    started = time.perf_counter()
    epsilon = float("nan")
    for epoch in range(1, epochs + 1):
        totals = [0.0, 0, 0]
        for i, (x, y) in enumerate(engine.data_loader, start=1):
            loss_sum, correct, size = _step(engine, x, y)
            totals = [totals[0] + loss_sum, totals[1] + correct, totals[2] + size]
            if run:
                run.log(_step_record(engine, epoch, loss_sum, correct, size))
            seen = max(totals[2], 1)
            progress.update(epoch, i, totals[0] / seen, totals[1] / seen, epsilon)
            if engine.steps >= planned:  # the planned run is over, possibly within an epoch
                break
        epsilon = engine.epsilon()
        seen = max(totals[2], 1)
        test_accuracy = accuracy(model, data.test)
        progress.update(epoch, i, totals[0] / seen, totals[1] / seen, epsilon, final=True)
        if run:
            run.log({"kind": "epoch", "epoch": epoch, "step": engine.steps, "epsilon": epsilon,
                     "train_loss": totals[0] / seen, "train_accuracy": totals[1] / seen,
                     "test_accuracy": test_accuracy})
    train_seconds = time.perf_counter() - started
    engine.detach()
    result = {
        "test_accuracy": test_accuracy, "epsilon": epsilon, "delta": delta,
        "noise_multiplier": engine.noise_multiplier, "steps": engine.steps, "planned_steps": planned,
        "sample_rate": engine.sample_rate, "train_seconds": train_seconds,
        "guarantee": str(engine.guarantee()),
        "randomness": engine.randomness.description,
        "note": loose_target_note(config.epsilon, engine.noise_multiplier, epsilon),
        "dataset": {"name": data.name, "train_examples": data.num_train,
                    "test_examples": len(data.test), "classes": data.num_classes},
        "config": {**asdict(config), "delta": delta,
                   "lr": "auto" if config.lr == "auto" else config.resolved_lr()},
        "diagnostics_are_not_private": True,
    }
    if run:
        run.finish(result)
    return result


def _step_record(engine: DPEngine, epoch: int, loss_sum: float, correct: int, size: int
                 ) -> dict[str, Any]:
    report = engine.last_step
    record: dict[str, Any] = {"kind": "step", "epoch": epoch, "step": engine.steps,
                              "batch_size": size,
                              "loss": loss_sum / size if size else None,
                              "train_accuracy": correct / size if size else None}
    if report is not None:
        record["groups"] = norm_statistics(report.group_norms, report.thresholds)
    record["lr"] = engine.optimizer.param_groups[0]["lr"]
    auto = next((c for c in engine.optimizer.components if isinstance(c, AutoLearningRate)), None)
    if auto is not None:
        record["loss_bound"] = auto.state.loss_bound
    return record
