"""A complete private training run from a configuration: what ``tunefree train`` does.

``train(config)`` reads and prepares the data (``preprocess.py``: every value learnt from the training rows
declared public or released privately), builds the default model, calls :func:`tunefree.make_private` with
those releases as its ``prior_releases`` (the ledger holds them before the first step, and the training
noise is calibrated so that the whole ledger spends the target ε), trains,
evaluates on the held-out rows and returns the result; the command line is a thin layer over it, and
experiments reuse it.

Nothing computed from the training rows without noise leaves the run: the output, ``metrics.jsonl``, the
plots and ``report.json`` hold public values (declared, or the run's settings), released values (ε, the
learning rate set from released gradients, released thresholds) and the test accuracy on the held-out rows,
which is labelled outside the guarantee wherever it is shown.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from .. import CLIP_FUNCTIONS, GROUPINGS, PSAC, AdaptiveQuantile, AutoS, DoG, DPEngine, HyFreeDP, make_private
from .. import audit as auditing
from ..privacy import MIN_NOISE_MULTIPLIER, NOISE_ALLOCATIONS
from . import datasets, launch, models, preprocess, tables
from .releases import (  # noqa: F401  (default_delta: experiments import the run's δ from here)
    default_delta,
    delta_choice,
    preprocessing_epsilon,
    prior_releases,
)
from .report import OUTSIDE_THE_GUARANTEE, RunDirectory, majority_class_rate

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    "nadam": lambda params, lr: torch.optim.NAdam(params, lr=lr),
    "radam": lambda params, lr: torch.optim.RAdam(params, lr=lr),
    "adagrad": lambda params, lr: torch.optim.Adagrad(params, lr=lr),
}
NUMERIC_SCALINGS = preprocess.NUMERIC_SCALINGS
# The papers' knobs, each a field of a typed option of make_private (flag, option, its field); the
# command line refuses one given where it has no effect.
KNOBS = {"clip_gamma": ("--clip-gamma", "--clipping auto-s", "gamma"),
         "psac_r": ("--psac-r", "--clipping psac", "r"),
         "target_quantile": ("--target-quantile", "--thresholds adaptive", "target"),
         "quantile_lr": ("--quantile-lr", "--thresholds adaptive", "lr"),
         "quantile_budget": ("--quantile-budget", "--thresholds adaptive", "budget")}
# HyFreeDP's knob (--lr hyfreedp): a field of HyFreeDP.
HYFREEDP_KNOBS = {"lr_update_interval": "--lr-update-interval"}


DEFAULT_BATCH_SIZE = 256


def batch_size_for(given: int | None, rows: int) -> int:
    """The expected batch size: ``--batch-size``, else 256, or all ``rows`` of a smaller training set (the
    sampling rate q = 1: every step sees every row) rather than a refusal. N is public."""
    return given if given is not None else min(DEFAULT_BATCH_SIZE, rows)


@dataclass
class TrainConfig:
    """Everything a run depends on. ``delta=None`` means 1/N^1.1 for N training examples. The run's
    length is ``epochs`` (possibly fractional) or ``steps``: the noise is calibrated for, and training
    runs, exactly ``planned_steps(epochs, steps, q)`` logical steps. ``epsilon`` ∞ is a non-private
    reference run (no noise, ε = ∞). ``schema`` is the path of a table's public schema (category sets,
    value ranges) and ``labels`` the public classes (otherwise both are selected privately);
    ``numeric_scaling`` is ``"private"`` (numeric columns with no public range are standardised by an
    accounted private estimate) or ``"none"`` (fed as they are); ``na_values``, ``drop_missing`` and
    ``test_data`` are the data flags of ``preprocess.DataOptions``. ``hidden`` sizes the default MLP's
    hidden layers (``None``: one of 128). The papers' knobs (``KNOBS``) are fields of ``make_private``'s
    typed options (:meth:`options`), ``noise_allocation`` its keyword.
    ``lr`` is ``"auto"`` (the optimizer's step size from the released gradients: ``make_private``'s
    ``lr="auto"``; the model kept is its averaged one), ``"hyfreedp"`` (HyFreeDP's learning rate from
    privatised losses, any optimizer; ``lr_update_interval`` is its knob) or a number."""

    dataset: str = "digits"
    label_column: str = "label"
    model: str = "auto"
    epsilon: float = 3.0
    delta: float | None = None
    epochs: float | None = 40
    steps: int | None = None
    batch_size: int | None = None  # None: DEFAULT_BATCH_SIZE, or every training row where fewer
    clipping: str = "auto-s"
    groups: str = "all-layer"
    thresholds: str = "fixed"
    target_quantile: float | None = None
    quantile_lr: float | None = None
    quantile_budget: float | None = None
    clip_gamma: float | None = None
    psac_r: float | None = None
    noise_allocation: str = "global"
    lr_update_interval: int | None = None
    schema: str | None = None
    labels: tuple[str, ...] | None = None
    numeric_scaling: str = "private"
    na_values: tuple[str, ...] = ()
    drop_missing: bool = False
    test_data: str | None = None
    hidden: tuple[int, ...] | None = None
    optimizer: str = "sgd"
    lr: float | str = "auto"  # a number, "auto" (SGD's automatic step) or "hyfreedp"
    max_grad_norm: float = 1.0
    accountant: str = "pld"
    seed: int | None = None
    audit_canaries: int | None = None
    reference: bool = False  # also train the same run without noise, for comparison (outside the guarantee)
    out: str | None = None
    quiet: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # further make_private keywords

    def options(self) -> dict[str, Any]:
        """``make_private``'s ``clipping`` and ``thresholds``: the names, or their typed options
        (``AutoS``, ``PSAC``, ``AdaptiveQuantile``) where a knob sets one of their fields; a knob given
        where it has no effect is refused, naming its flag."""
        given = {name: getattr(self, name) for name in KNOBS if getattr(self, name) is not None}
        for name in given:
            flag, needs, _ = KNOBS[name]
            if needs != f"--clipping {self.clipping}" and needs != f"--thresholds {self.thresholds}":
                raise ValueError(f"{flag} applies only to {needs}: drop it or add {needs}")

        def fields(option: str) -> dict[str, Any]:
            return {KNOBS[name][2]: value for name, value in given.items() if KNOBS[name][1] == option}

        clipping: Any = self.clipping
        if fields("--clipping auto-s"):
            clipping = AutoS(**fields("--clipping auto-s"))
        elif fields("--clipping psac"):
            clipping = PSAC(**fields("--clipping psac"))
        thresholds: Any = self.thresholds
        if fields("--thresholds adaptive"):
            thresholds = AdaptiveQuantile(**fields("--thresholds adaptive"))
        return {"clipping": clipping, "thresholds": thresholds}

    def resolved_lr(self) -> float:
        """The learning rate the optimizer is built with (an automatic learning rate sets its own)."""
        return 1.0 if self.lr in ("auto", "hyfreedp") else float(self.lr)

    def auto_lr(self, input_rms: float | None = None) -> DoG | HyFreeDP | None:
        """``make_private``'s ``lr``: the automatic learning rate asked for, or ``None`` for a number.
        ``input_rms``: the features' root mean square where the encoding makes it public (it scales the
        automatic rate's noise budget)."""
        if self.lr == "auto":
            return DoG(input_rms=input_rms)
        if self.lr == "hyfreedp":
            return HyFreeDP() if self.lr_update_interval is None else HyFreeDP(self.lr_update_interval)
        return None


def loose_target_note(target_epsilon: float, noise_multiplier: float, spent: float) -> str | None:
    """What to tell a person whose target ε is so loose that calibration stopped at its noise floor
    (nothing for a reference run without noise, ``--epsilon inf``: its guarantee says it has none)."""
    if noise_multiplier > MIN_NOISE_MULTIPLIER or not math.isfinite(target_epsilon):
        return None
    return (f"the target ε = {target_epsilon:g} is looser than any useful noise: calibration stops at "
            f"σ = {MIN_NOISE_MULTIPLIER}, where this run spends ε = {spent:.4g} < {target_epsilon:g}")


def check_config(config: TrainConfig) -> None:
    """Refuse a bad configuration before any data is touched."""
    if not config.epsilon > 0:  # ∞: a non-private reference run
        raise ValueError(f"--epsilon must be a positive number (or inf, no privacy), got {config.epsilon}")
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
    if config.batch_size is not None and config.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {config.batch_size}")
    if config.numeric_scaling not in NUMERIC_SCALINGS:
        raise ValueError(f"--numeric-scaling must be one of {', '.join(NUMERIC_SCALINGS)}, "
                         f"got {config.numeric_scaling!r}")
    if config.hidden is not None and (not config.hidden or any(
            isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in config.hidden)):
        raise ValueError(f"--hidden takes layer widths of at least 1, e.g. 256,256; got {config.hidden}")
    if config.clipping not in CLIP_FUNCTIONS:
        raise ValueError(f"unknown --clipping {config.clipping!r}: use one of {', '.join(CLIP_FUNCTIONS)}")
    if config.groups not in GROUPINGS:
        raise ValueError(f"unknown --groups {config.groups!r}: use one of {', '.join(GROUPINGS)}")
    if config.thresholds not in ("fixed", "adaptive"):
        raise ValueError(f"--thresholds must be fixed or adaptive, got {config.thresholds!r}")
    if config.noise_allocation not in NOISE_ALLOCATIONS:
        raise ValueError(f"unknown --noise-allocation {config.noise_allocation!r}: use one of "
                         f"{', '.join(NOISE_ALLOCATIONS)}")
    try:  # the options' own checks of the knobs' values, before any data is touched
        config.options()
    except (TypeError, ValueError) as error:
        message = str(error)
        for flag, _, field_name in KNOBS.values():
            for option in ("AutoS", "PSAC", "AdaptiveQuantile"):
                message = message.replace(f"{option}.{field_name}", flag)
        raise ValueError(message) from error
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {config.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    if config.lr not in ("auto", "hyfreedp") and not (
            isinstance(config.lr, (int, float)) and config.lr > 0 and math.isfinite(config.lr)):
        raise ValueError(f"--lr must be a positive number, 'auto' or 'hyfreedp', got {config.lr}")
    given = [flag for name, flag in HYFREEDP_KNOBS.items() if getattr(config, name) is not None]
    if given and config.lr != "hyfreedp":
        raise ValueError(f"{', '.join(given)} only apply to --lr hyfreedp: drop them or add --lr hyfreedp")
    config.auto_lr()  # its fields' own checks


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
    """Progress of the run on ``stream`` (stderr): on a terminal, a bar redrawn in place with the ε spent
    so far and the last test accuracy (of the weights the run keeps), one line per epoch; anywhere else
    (a log file, a pipe) plain lines, one every tenth of the run or every 10 seconds, whichever comes
    first, and one at the end. The test accuracy is labelled: it is outside the guarantee."""

    PARTS = 10  # a line every tenth of the run
    EVERY_SECONDS = 10.0

    def __init__(self, epochs: int, steps_per_epoch: int, total_steps: int, quiet: bool,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.epochs, self.steps, self.total, self.quiet = epochs, steps_per_epoch, total_steps, quiet
        self.stream = sys.stderr if stream is None else stream
        self.interactive = self.stream.isatty()
        self.clock = clock
        self.last_line = clock()
        self.next_part = 1

    def update(self, epoch: int, step_in_epoch: int, step: int, epsilon: float, test_accuracy: float,
               final: bool = False) -> None:
        """Report after logical step ``step`` (``step_in_epoch`` within ``epoch``); ``final`` at the end
        of an epoch, once ε and the test accuracy are known (NaN before)."""
        if self.quiet:
            return
        eps = "   -  " if math.isnan(epsilon) else f"{epsilon:6.3f}"
        tested = "  -  " if math.isnan(test_accuracy) else f"{test_accuracy:5.3f}"
        figures = f"ε {eps} | test acc {tested} (held-out rows, outside the guarantee)"
        if self.interactive:
            filled = int(20 * step_in_epoch / max(self.steps, 1))
            bar = "#" * filled + "." * (20 - filled)
            self.stream.write(f"\repoch {epoch:3d}/{self.epochs} [{bar}] {figures}" + ("\n" if final else ""))
            self.stream.flush()
            return
        now = self.clock()
        if step >= self.total:
            due = final  # the last line waits for the last ε
        else:
            due = (step * self.PARTS >= self.next_part * self.total
                   or now - self.last_line >= self.EVERY_SECONDS)
        if not due:
            return
        self.stream.write(f"step {step}/{self.total} ({100 * step / max(self.total, 1):3.0f}%) "
                          f"epoch {epoch:3d}/{self.epochs} {figures}\n")
        self.stream.flush()
        self.last_line = now
        while self.next_part * self.total <= step * self.PARTS:
            self.next_part += 1


def _step(engine: DPEngine, x: torch.Tensor, y: torch.Tensor) -> None:
    """One private step (nothing computed from the batch is returned: it would be unnoised)."""
    engine.optimizer.zero_grad()

    def per_sample_losses() -> torch.Tensor:  # for HyFreeDP: the batch's losses at probe points
        return F.cross_entropy(engine.model(x), y, reduction="none")

    closure = per_sample_losses if engine.optimizer.closure_gives_per_sample_losses else None
    if len(y) > 0:  # an empty Poisson batch: no loss to compute, but the step (noise) happens
        F.cross_entropy(engine.model(x), y).backward()
    engine.optimizer.step(closure)


def _prepared(config: TrainConfig) -> datasets.LoadedData:
    """The data read and prepared as configured, with the model's refusals made before any release."""
    schema = tables.Schema.load(config.schema) if config.schema else None
    options = preprocess.DataOptions(
        label_column=config.label_column, schema=schema, labels=config.labels, na_values=config.na_values,
        drop_missing=config.drop_missing, test_data=config.test_data, numeric_scaling=config.numeric_scaling)
    raw = datasets.read(config.dataset, options.label_column, options.test_data)
    shape = tuple(raw.x.shape[1:]) if raw.kind == "image" else (1,)
    models.resolve(config.model, raw.kind, shape, config.hidden)
    return preprocess.prepare(raw, options, config.epsilon, config.delta, config.accountant, config.seed)


def _make_private(config: TrainConfig, model: nn.Module, data: datasets.LoadedData, delta: float
                  ) -> DPEngine:
    """The private run: its noise calibrated so that the whole ledger — the preprocessing releases
    (recorded before the first step) and the planned steps — spends ``config.epsilon`` at δ."""
    optimizer = OPTIMIZERS[config.optimizer](model.parameters(), config.resolved_lr())
    budget = ({"target_epsilon": config.epsilon} if math.isfinite(config.epsilon)
              else {"noise_multiplier": 0.0})  # --epsilon inf: the reference run without noise
    return make_private(
        launch.data_parallel(model), optimizer, DataLoader(data.train, batch_size=config.batch_size),
        target_delta=delta, epochs=config.epochs, steps=config.steps, groups=config.groups,
        max_grad_norm=config.max_grad_norm, lr=config.auto_lr(public_input_rms(data)), **config.options(),
        prior_releases=prior_releases(data.releases),
        accountant=config.accountant, seed=config.seed, audit_canaries=config.audit_canaries,
        noise_allocation=config.noise_allocation, **budget, **config.extra)


def public_input_rms(data: datasets.LoadedData) -> float | None:
    """The root mean square of a table's features where its encoding fixes it (standardised and one-hot
    columns, :meth:`TableEncoder.public_input_rms`); ``None`` for images and other tables."""
    return None if data.encoder is None else data.encoder.public_input_rms()


def train(config: TrainConfig, data: datasets.LoadedData | None = None) -> dict[str, Any]:
    """Run private training as configured; returns the result (also written to ``config.out``). ``data``:
    data prepared already (its releases go into this run's ledger). In a process group of several
    processes (torchrun, ``cli/launch.py``), each process is one rank of one data-parallel run: rank 0
    reads and prepares the data (its releases are made once) and alone writes ``config.out``."""
    check_config(config)
    data = data or launch.once_on_rank_zero(lambda: _prepared(config))
    config = replace(config, batch_size=batch_size_for(config.batch_size, data.num_train))
    delta, delta_text = delta_choice(config.delta, data.num_train)
    if data.num_train < config.batch_size:
        raise ValueError(f"--batch-size {config.batch_size} is larger than the {data.num_train} training "
                         f"examples: use --batch-size {data.num_train} or less")
    if config.seed is not None:
        torch.manual_seed(config.seed)  # initialisation only; the release's randomness is make_private's
    model = models.build(config.model, data.kind, data.input_shape, data.num_classes, config.hidden)
    engine = _make_private(config, model, data, delta)
    writes = launch.is_main_process()  # under torchrun, rank 0 writes the run's outputs
    run = RunDirectory(config.out) if config.out and writes else None
    majority = majority_class_rate(data.test.tensors[1], data.classes)
    if run:
        run.baseline(f"majority class {majority['class']!r}", majority["rate"])
    planned = engine.planned_steps
    steps_per_epoch = len(engine.data_loader)
    epochs = math.ceil(planned / steps_per_epoch)  # the last one partial when planned is not a multiple
    progress = Progress(epochs, steps_per_epoch, planned, config.quiet or not writes)
    started = time.perf_counter()
    epsilon, test_accuracy = float("nan"), float("nan")
    for epoch in range(1, epochs + 1):
        for i, (x, y) in enumerate(engine.data_loader, start=1):
            _step(engine, x, y)
            if run:
                run.log(_step_record(engine, config, epoch))
            progress.update(epoch, i, engine.steps, epsilon, test_accuracy)
            if engine.steps >= planned:  # the planned run is over, possibly within an epoch
                break
        epsilon = engine.epsilon(delta)
        with _model_kept(engine, config):
            test_accuracy = accuracy(model, data.test)
        progress.update(epoch, i, engine.steps, epsilon, test_accuracy, final=True)
        if run:
            run.log({"kind": "epoch", "epoch": epoch, "step": engine.steps, "epsilon": epsilon,
                     "test_accuracy": test_accuracy})
    train_seconds = time.perf_counter() - started
    engine.detach()
    if config.lr == "auto":  # the model kept is the automatic learning rate's averaged one
        engine.lr_rule.apply_average()
    audit = None if config.audit_canaries is None else auditing.audit_training(engine)
    reference = None
    if config.reference:  # the same data and run without noise; its model is not kept
        reference = train(replace(config, epsilon=math.inf, reference=False, out=None, quiet=True,
                                  audit_canaries=None), data)["test_accuracy"]
        if run:
            run.baseline("the same run without noise", reference)
    result = {
        "test_accuracy": test_accuracy, "test_majority_class": majority,
        "reference_test_accuracy": reference, "epsilon": epsilon, "delta": delta, "delta_choice": delta_text,
        "noise_multiplier": engine.noise_multiplier, "steps": engine.steps, "planned_steps": planned,
        "sample_rate": engine.sample_rate, "train_seconds": train_seconds,
        "processes": launch.world()[1],
        "guarantee": guarantee_text(engine, delta, data.num_train),
        "randomness": engine.randomness.description,
        "note": loose_target_note(config.epsilon, engine.noise_multiplier, epsilon),
        "data_notes": list(data.notes),
        "preprocessing": [release.report() for release in data.releases],
        "preprocessing_epsilon": preprocessing_epsilon(data.releases, delta, config.accountant),
        "dataset": {"name": data.name, "kind": data.kind, "train_examples": data.num_train,
                    "test_examples": len(data.test), "classes": list(data.classes)},
        "config": {**asdict(config), "delta": delta, "lr": config.lr},
        "learning_rate": _learning_rate_text(config, engine),
        "model_file": run.save_model(model, model_description(config, data)) if run else None,
        "audit": None if audit is None else {
            "epsilon_lower_bound": audit.epsilon_lower_bound, "confidence": audit.confidence,
            "canaries": audit.canaries, "verdict": audit.verdict},
        "public_by_declaration": public_by_declaration(config),
        "outside_the_guarantee": OUTSIDE_THE_GUARANTEE,
    }
    if run:
        run.finish(result)
    return result


def guarantee_text(engine: DPEngine, delta: float, rows: int) -> str:
    """The guarantee, with what it covers (the training rows) or, for a reference run, that it is none."""
    if engine.noise_multiplier == 0:
        return "no privacy: a non-private reference run (--epsilon inf), ε = ∞"
    return f"covers the {rows} training rows: {engine.guarantee(delta)}"


def public_by_declaration(config: TrainConfig) -> list[str]:
    """What the run reads from the data and treats as public because the user (or the format) says so."""
    declared = ["the number of training rows N (the sampling rate is batch size / N)",
                "the file's column names and each column's kind (numeric or text), read from its cells"]
    if config.schema:
        declared.append(f"the category sets and value ranges in --schema {config.schema}")
    if config.labels is not None:
        declared.append(f"the classes given by --labels {list(config.labels)}")
    return declared


def model_description(config: TrainConfig, data: datasets.LoadedData) -> dict[str, Any]:
    """What ``tunefree predict`` needs to rebuild the model and prepare new rows (all public or released)."""
    return {"model": models.resolve(config.model, data.kind, data.input_shape, config.hidden),
            "hidden": list(config.hidden) if config.hidden else None, "kind": data.kind,
            "input_shape": list(data.input_shape), "classes": list(data.classes),
            "pixel_scale": data.pixel_scale,
            "table": None if data.encoder is None else data.encoder.to_dict()}


def _learning_rate_text(config: TrainConfig, engine: DPEngine) -> str:
    """How the run's learning rate was set, as the output states it."""
    last = engine.optimizer.param_groups[0]["lr"]
    if config.lr == "auto":  # DoG's rule
        rule = engine.lr_rule
        first = rule.history[0] if rule.history else last
        scaled = ("" if rule.input_scale == 1 else
                  f"; its noise budget × {rule.input_scale:.3g} for the features' public scale")
        return (f"automatic ({config.optimizer}, --lr auto): {first:.3g} at the first step and {last:.3g} at "
                "the last, set from the released gradients (no ε); the model kept is the average of its "
                f"weights{scaled}")
    if config.lr == "hyfreedp":
        return (f"HyFreeDP ({config.optimizer}, --lr hyfreedp): from privatised losses, accounted in ε; "
                f"η = {last:.3g} at the last step")
    return f"{config.optimizer} at lr = {config.lr:g}, given by --lr"


def _model_kept(engine: DPEngine, config: TrainConfig) -> contextlib.AbstractContextManager:
    """The weights of the model the run would keep if it ended now: the averaged ones with the
    automatic learning rate (post-processing of the releases), else the current ones."""
    if config.lr != "auto":
        return contextlib.nullcontext()
    return engine.lr_rule.averaged()


def _step_record(engine: DPEngine, config: TrainConfig, epoch: int) -> dict[str, Any]:
    """What ``metrics.jsonl`` says of a step: public or released values only (the learning rate, set from
    released values or given; the clip thresholds, given or released; HyFreeDP's loss bound R_l)."""
    record: dict[str, Any] = {"kind": "step", "epoch": epoch, "step": engine.steps,
                              "lr": engine.optimizer.param_groups[0]["lr"]}
    if engine.last_step is not None:
        record["thresholds"] = dict(engine.last_step.thresholds)
    if config.lr == "hyfreedp":
        record["loss_bound"] = engine.lr_rule.loss_bound
    return record
