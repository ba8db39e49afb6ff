"""Private fine-tuning of a local Hugging Face model on a text table: what ``tunefree train --model PATH``
does (classification or causal LM; every weight, LoRA, or a head on the frozen model's mean-pooled states,
``text_head.py``), and ``tunefree predict`` of such a run.

``train_text(config)`` reads the table (and ``--test-data``), splits it by a keyed hash of each row
(``split.py``) unless the test rows are given, selects the classes privately unless ``--labels`` declares
them, loads the model, chooses what to train and for how long from N and ε (``text_defaults.py``) unless the
flags say, sets the token length from ``--max-length`` or a private quantile of the training texts' lengths,
tokenises, for a head releases the centre of the pooled states (``text_head.py``), calls
:func:`tunefree.make_private` with those releases as its prior releases (the ledger holds them first, and the
training noise is calibrated so that the whole ledger spends ε), trains with the chosen optimizer (AdamW by
default), evaluates on the held-out rows (outside the guarantee, and labelled so,
beside the majority rate of those rows) and saves the model in ``<out>/model`` (``save_pretrained``; the
adapter alone for LoRA; the encoder and ``tunefree_head.pt`` for a head) with ``tunefree_text.json``, which
``text_models.load_classifier`` and ``tunefree predict`` read; ``report.json`` beside it holds ε from the
run's ledger.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from .. import DPEngine, make_private
from . import report, text_data, text_defaults, text_head, text_models
from .preprocess import _check_two_classes
from .releases import (
    OTHER,
    Budget,
    Release,
    delta_choice,
    preprocessing_epsilon,
    prior_releases,
    private_length,
    select_sets,
)
from .report import OUTSIDE_THE_GUARANTEE, RunDirectory, write_json
from .split import held_out, split_key, table_rows
from .tables import class_indices
from .training import OPTIMIZERS, Progress, check_config, guarantee_text, loose_target_note

# The learning rate when --lr is not given: "auto", make_private's lr="auto" (DoG's step within its noise
# budget, translated to the optimizer's learning rate; no ε), benchmarks/RESULTS.md §5f.
DEFAULT_TEXT_LR = "auto"
DEFAULT_TEXT_OPTIMIZER = "adamw"
DEFAULT_TEXT_EPOCHS = text_defaults.ALL_EPOCHS  # every weight trained, no length given
LENGTH_EDGES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # candidate token lengths (public)


@dataclass
class TextConfig:
    """A text run. ``model``: a local HF model or LoRA adapter directory; ``data``: a .csv, .jsonl or
    .parquet table. ``task`` None infers it (a label column → classification, else causal LM).
    ``lora_rank`` None fine-tunes every parameter. ``labels``: the classes, declared public (None:
    selected privately); ``max_length``: the token length, declared (None: a private quantile).
    ``epsilon`` ∞ is a non-private reference run. ``train_weights``: ``"all"`` (every parameter, or the
    LoRA adapters), ``"head"`` (a linear head on the frozen model's mean-pooled token states,
    classification only) or ``"auto"`` (chosen from N and ε: ``text_defaults.choose_weights``);
    ``batch_size`` and the length (``epochs``/``steps``) None: ``text_defaults.schedule``'s. ``test_data``:
    a table of the same columns to test on (every row of ``data`` then trains; None: the keyed 80/20 split of
    ``data``). The other privacy fields are ``TrainConfig``'s."""

    model: str
    data: str
    out: str
    test_data: str | None = None
    text_column: str = "text"
    label_column: str | None = None
    task: str | None = None
    labels: tuple[str, ...] | None = None
    max_length: int | None = None
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] | None = None
    epsilon: float = 3.0
    delta: float | None = None
    epochs: float | None = None
    steps: int | None = None
    batch_size: int | None = None
    train_weights: str = "auto"
    optimizer: str = DEFAULT_TEXT_OPTIMIZER
    lr: float | str | None = None  # a number or "auto"; None: DEFAULT_TEXT_LR
    clipping: str = "auto-s"
    groups: str = "all-layer"
    accountant: str = "pld"
    seed: int | None = None
    quiet: bool = False

    def resolved_lr(self) -> float | str:
        """The learning rate asked for: a number or ``"auto"``."""
        return DEFAULT_TEXT_LR if self.lr is None else self.lr if self.lr == "auto" else float(self.lr)


def _check(config: TextConfig) -> None:
    """Refuse a bad configuration before any data is read."""
    from .training import TrainConfig

    if config.lr == "hyfreedp":
        raise ValueError("--lr hyfreedp is not available for text models yet: use --lr auto (the default) "
                         "or give a number")
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {config.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    if config.train_weights not in text_defaults.TRAIN_WEIGHTS:
        raise ValueError(f"--train-weights must be one of {', '.join(text_defaults.TRAIN_WEIGHTS)}, got "
                         f"{config.train_weights!r}")
    if config.train_weights == "head" and (config.lora_rank is not None or config.task == "causal-lm"):
        raise ValueError("--train-weights head trains a classification head on the frozen model: drop it "
                         "with --lora-rank or --task causal-lm")
    length = (config.epochs, config.steps) if config.epochs or config.steps else (DEFAULT_TEXT_EPOCHS, None)
    check_config(TrainConfig(epsilon=config.epsilon, delta=config.delta, epochs=length[0],
                             steps=length[1], batch_size=config.batch_size or 1, clipping=config.clipping,
                             groups=config.groups, lr=config.resolved_lr(), accountant=config.accountant,
                             optimizer=config.optimizer))
    if config.task is not None and config.task not in text_data.TASKS:
        raise ValueError(f"unknown task {config.task!r}: use one of {', '.join(text_data.TASKS)}")
    if config.max_length is not None and config.max_length < 2:
        raise ValueError(f"--max-length must be at least 2, got {config.max_length}")
    if config.lora_rank is not None and config.lora_rank < 1:
        raise ValueError(f"--lora-rank must be at least 1, got {config.lora_rank}")
    if config.lora_targets is not None and config.lora_rank is None:
        raise ValueError("--lora-targets chooses where LoRA adapters go: add --lora-rank")
    if config.labels is not None and config.task == "causal-lm":
        raise ValueError("--labels names the classes of --task classification: drop it")
    if not config.out:
        raise ValueError("a text model run needs --out DIR: the run directory where the fine-tuned model "
                         "is saved")


def _losses(model: nn.Module, batch: dict[str, torch.Tensor], task: str) -> torch.Tensor:
    """Per-example losses: of the head on pooled states (a batch of ``features``), or of the model."""
    if "features" in batch:
        return F.cross_entropy(model(batch["features"]), batch["labels"], reduction="none")
    return text_models.per_example_losses(model, batch, task)


def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if "features" in batch:
        return model(batch["features"])
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def _step(engine: DPEngine, batch: dict[str, torch.Tensor], task: str) -> None:
    """One private step (nothing computed from the batch is returned: it would be unnoised)."""
    engine.optimizer.zero_grad()
    if len(batch["labels"]) > 0:  # an empty Poisson batch: the model cannot run it, but the step happens
        _losses(engine.model, batch, task).mean().backward()  # loss_reduction="mean"
    engine.optimizer.step()


@torch.no_grad()
def evaluate(model: torch.nn.Module, examples: text_data.TextExamples, task: str,
             batch_size: int = 64) -> dict[str, float]:
    """Held-out accuracy (classification) or mean per-example loss and its exponential (causal LM)."""
    model.eval()
    correct, loss_sum = 0, 0.0
    for batch in DataLoader(examples, batch_size=batch_size):
        loss_sum += float(_losses(model, batch, task).sum())
        if task == "classification":
            correct += int((_logits(model, batch).argmax(-1) == batch["labels"]).sum())
    model.train()
    loss = loss_sum / len(examples)
    if task == "classification":
        return {"test_accuracy": correct / len(examples), "test_loss": loss}
    return {"test_loss": loss, "test_perplexity": math.exp(min(loss, 700.0))}


MAJORITY_KEYS = ["test_majority_class", "test_majority_rate"]


def majority(examples: text_data.TextExamples, names: list[str]) -> dict[str, Any]:
    """The test rows' most frequent class and its share: the accuracy of always predicting it, against
    which the test accuracy says whether the model learnt anything (computed from the held-out rows
    without noise, like the test accuracy: outside the guarantee)."""
    rate = report.majority_class_rate(examples.tensors["labels"], names)
    return {"test_majority_class": rate["class"], "test_majority_rate": rate["rate"]}


def _split_rows(table: text_data.TextTable, label_column: str | None, seed: int | None):
    """Training and test row indices by the keyed hash of each row's text (and label)."""
    import numpy as np

    cells = [table.texts] + ([list(table.labels(label_column))] if label_column else [])
    test = held_out(table_rows(cells), split_key(seed))
    if test.all() or not test.any():
        raise text_data.DataError(f"{table.name}: the 80/20 split of its {len(test)} rows put none in the "
                                  f"{'training' if test.all() else 'test'} split: add rows")
    return np.flatnonzero(~test), np.flatnonzero(test)


def _with_test_rows(table: text_data.TextTable, test_data: str, text_column: str, label_column: str | None):
    """``table`` with the rows of ``test_data`` after its own: every row of ``table`` trains, the others
    test; the training and test row indices."""
    import numpy as np
    import pandas as pd

    test = text_data.read_table(test_data, text_column)
    columns = [text_column] + ([label_column] if label_column else [])
    if label_column:
        test.labels(label_column)  # a missing column or empty cell is refused, naming the test file
    frame = pd.concat([table.frame[columns], test.frame[columns]], ignore_index=True)
    both = text_data.TextTable(table.name, table.texts + test.texts, frame)
    return both, np.arange(len(table.texts)), np.arange(len(table.texts), len(both.texts))


def _classes(labels, train_rows, config: TextConfig, budget: Budget, name: str
             ) -> tuple[list[str], bool, Release | None]:
    """The classes (declared, or selected privately from the training rows) and whether '(other)' follows;
    training rows of a single class are refused first, declared or not, as for tables (before any release)."""
    _check_two_classes(labels[train_rows], config.labels, name)
    if config.labels is not None:
        classes, other, release = list(config.labels), False, None
    else:
        sets, release = select_sets({"label": labels[train_rows]}, budget, config.seed)
        classes, other = sets["label"], True
    if len(classes) < 2:
        threshold = release.released["threshold"] if release else 0
        raise text_data.DataError(
            f"only {len(classes)} class label(s) {classes} had enough training rows to be selected privately "
            f"(about {threshold:.0f} rows each at this ε): declare the classes with --labels, or train with "
            "more rows or a larger ε" if release else "the labels take a single value; classification "
            "needs at least two")
    return classes, other, release


def train_text(config: TextConfig) -> dict[str, Any]:
    """Run private fine-tuning as configured; returns the result, also written to ``<out>/report.json``,
    and saves the model in ``<out>/model``."""
    _check(config)
    text_models.check_model_directory(config.model)
    table = text_data.read_table(config.data, config.text_column)
    task, label_column = text_data.infer_task(config.task, config.label_column, table.columns)
    if config.labels is not None and task != "classification":
        raise ValueError("--labels names the classes of a classification task, and this table has no label "
                         "column: drop --labels or pass --label-column")
    if config.test_data is None:
        train_rows, test_rows = _split_rows(table, label_column, config.seed)
    else:
        table, train_rows, test_rows = _with_test_rows(table, config.test_data, config.text_column,
                                                       label_column)
    delta, delta_text = delta_choice(config.delta, len(train_rows))
    if config.batch_size is not None and len(train_rows) < config.batch_size:
        raise ValueError(f"--batch-size {config.batch_size} is larger than the {len(train_rows)} training "
                         f"examples: use --batch-size {len(train_rows)} or less")
    budget = Budget(config.epsilon, delta, config.accountant)
    releases: list[Release] = []
    classes, other, tensors = None, False, {}
    if task == "classification":
        labels = table.labels(label_column)
        classes, other, release = _classes(labels, train_rows, config, budget, table.name)
        releases += [release] if release else []
        tensors["labels"] = torch.as_tensor(class_indices(labels, classes, other, table.name))
    if config.seed is not None:
        torch.manual_seed(config.seed)  # initialisation only; the release's randomness is make_private's
    names = None if classes is None else [*classes, *((OTHER,) if other else ())]
    model, tokenizer, notes = text_models.load(config.model, task, names, config.quiet)
    if config.lora_rank is not None:
        if hasattr(model, "peft_config"):
            raise ValueError(f"--model {config.model} is already a LoRA adapter, trained as it is: drop "
                             "--lora-rank")
        model = text_models.add_lora(model, task, config.lora_rank, config.lora_targets)
    weights, weights_text = _weights(config, model, task, len(train_rows), delta)
    run_plan = text_defaults.schedule(weights, len(train_rows), config.batch_size, config.epochs,
                                      config.steps)
    length, release = _token_length(config, model, tokenizer, table.texts, train_rows, budget)
    releases += [release] if release else []
    tensors.update(text_data.tokenize(tokenizer, table.texts, length, task))
    text_models.share_padding(model, tokenizer)
    notes += _notes(classes, other, releases, length, config)
    notes.append(f"trained: {weights_text}; batch size {run_plan.batch_size}, "
                 f"{run_plan.planned_steps(len(train_rows))} steps")
    encoder = centre = None
    if weights == "head":  # the frozen encoder's states, once: each a function of its own text alone
        encoder = text_models.encoder_of(model)
        states = text_models.mean_pooled(encoder, tensors["input_ids"], tensors["attention_mask"])
        centre, release = text_head.release_centre(states, train_rows, budget, config.seed)
        releases.append(release)
        notes.append(f"the head reads each text's mean-pooled state scaled to unit length, centred on their "
                     f"mean over the training rows (released privately: {release.share:.0%} of the budget's "
                     f"μ², in the ledger) and multiplied by √{states.shape[1]}")
        tensors = {"features": text_head.head_inputs(states, centre), "labels": tensors["labels"]}
        model = nn.Linear(states.shape[1], len(names))
    train_set = text_data.TextExamples(tensors, train_rows)
    test_set = text_data.TextExamples(tensors, test_rows)
    trainable = [p for p in model.parameters() if p.requires_grad]
    auto = config.resolved_lr() == "auto"
    optimizer = OPTIMIZERS[config.optimizer](trainable, 1.0 if auto else config.resolved_lr())
    noise = ({"target_epsilon": config.epsilon} if math.isfinite(config.epsilon)
             else {"noise_multiplier": 0.0})
    # the ledger holds the preprocessing releases before the first step; the whole ledger spends ε
    engine = make_private(model, optimizer, DataLoader(train_set, batch_size=run_plan.batch_size),
                          target_delta=delta, epochs=run_plan.epochs, steps=run_plan.steps,
                          clipping=config.clipping, groups=config.groups, accountant=config.accountant,
                          seed=config.seed, lr="auto" if auto else None,
                          prior_releases=prior_releases(releases), **noise)
    run, started = RunDirectory(config.out), time.perf_counter()
    epsilon = _train_loop(engine, task, config, delta, run)
    train_seconds = time.perf_counter() - started
    engine.detach()
    if hasattr(engine.lr_rule, "apply_average"):  # the model kept is lr="auto"'s averaged one
        engine.lr_rule.apply_average()
    description = {"task": task, "trained": weights, "lora": hasattr(model, "peft_config"),
                   "text_column": config.text_column, "max_length": length, "classes": names}
    if encoder is not None:  # the head as it reads the unit-length states: the centre folded into its bias
        with torch.no_grad():
            saved = nn.Linear(model.in_features, model.out_features)
            saved.weight[:], saved.bias[:] = text_head.fold(model.weight, model.bias, centre)
        text_models.save_head(encoder, saved, tokenizer, run.path / "model", description)
    else:
        text_models.save(model, tokenizer, run.path / "model")
        text_models.save_description(run.path / "model", description)
    result = {
        **evaluate(model, test_set, task), **(majority(test_set, names) if task == "classification" else {}),
        "epsilon": epsilon, "delta": delta, "delta_choice": delta_text,
        "noise_multiplier": engine.noise_multiplier, "steps": engine.steps,
        "planned_steps": engine.planned_steps, "sample_rate": engine.sample_rate,
        "guarantee": guarantee_text(engine, delta, len(train_rows)),
        "randomness": engine.randomness.description,
        "note": loose_target_note(config.epsilon, engine.noise_multiplier, epsilon),
        "data_notes": notes, "task": task, "label_column": label_column,
        "model_directory": str(run.path / "model"), "lora": hasattr(model, "peft_config"),
        "trained": weights, "trained_why": weights_text, "batch_size": run_plan.batch_size,
        "trainable_parameters": sum(p.numel() for p in trainable),
        "preprocessing": [r.report() for r in releases],
        "preprocessing_epsilon": preprocessing_epsilon(releases, delta, config.accountant),
        "dataset": {"name": table.name, "train_examples": len(train_rows), "test_examples": len(test_rows),
                    "sequence_length": length, "classes": names},
        "config": {**asdict(config), "delta": delta, "lr": config.resolved_lr()},
        "train_seconds": train_seconds,
        "public_by_declaration": ["the number of training rows N (the sampling rate is batch size / N)",
                                  *([f"the classes given by --labels {list(config.labels)}"]
                                    if config.labels else []),
                                  *([f"the token length given by --max-length {config.max_length}"]
                                    if config.max_length else [])],
        "outside_the_guarantee": {**OUTSIDE_THE_GUARANTEE,
                                  "keys": [*OUTSIDE_THE_GUARANTEE["keys"], *MAJORITY_KEYS]},
    }
    run.finish(result)
    return result


def _weights(config: TextConfig, model: nn.Module, task: str, num_train: int, delta: float
             ) -> tuple[str, str]:
    """What the run trains (``"head"`` or ``"all"``) and why: a LoRA run, a causal LM and a LoRA adapter
    given as the model train what they hold; a classifier, what ``--train-weights`` says or the rule."""
    lora = hasattr(model, "peft_config")
    if task != "classification" or lora:
        kind = "LoRA" if lora else "causal-LM"
        if config.train_weights == "head":
            raise ValueError(f"--train-weights head trains a classification head on the frozen model; this "
                             f"is a {kind} run: drop --train-weights head")
        return "all", f"{'the LoRA adapters' if lora else 'every weight'} (a {kind} run)"
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return text_defaults.choose_weights(config.train_weights, count, num_train, config.epsilon, delta,
                                        config.batch_size, config.epochs, config.steps, config.accountant)


def _token_length(config: TextConfig, model, tokenizer, texts: list[str], train_rows, budget: Budget
                  ) -> tuple[int, Release | None]:
    """The token length every text is truncated and padded to: ``--max-length``, or the smallest public
    edge that holds 95% of the training texts, by a private quantile; never beyond the model's positions."""
    cap = text_models.max_positions(model, tokenizer)
    if config.max_length is not None:
        if cap is not None and config.max_length > cap:
            raise ValueError(f"--max-length {config.max_length} is longer than the model's {cap} positions: "
                             f"use --max-length {cap} or less")
        return config.max_length, None
    top = cap or LENGTH_EDGES[-1]
    edges = [e for e in LENGTH_EDGES if e < top] + [top]
    lengths = text_data.token_lengths(tokenizer, [texts[i] for i in train_rows], top)
    return private_length(lengths, edges, budget, config.seed)


def _notes(classes, other: bool, releases: list[Release], length: int, config: TextConfig) -> list[str]:
    notes = []
    for release in releases:
        if release.name == "text length":
            released = release.released
            notes.append(f"texts are truncated and padded to {length} tokens: the smallest of "
                         f"{released['edges']} that holds about {released['quantile']:.0%} of the training "
                         f"texts, by a private quantile ({release.share:.0%} of the budget's μ², in the "
                         "ledger); --max-length declares it")
        if release.name == "class labels":
            notes.append(f"the classes {classes[:10]} were selected privately from the training rows' "
                         f"labels (those at least about {release.released['threshold']:.0f} rows share; "
                         f"{release.share:.0%} of the budget's μ², in the ledger); a row whose label is not "
                         "among "
                         f"them is trained and tested as the class {OTHER!r}. Declare the classes with "
                         "--labels to spend nothing on this")
    return notes


def _train_loop(engine: DPEngine, task: str, config: TextConfig, delta: float, run: RunDirectory) -> float:
    """The planned steps, logged to ``run`` (public values only); returns ε spent (from the ledger)."""
    planned, steps_per_epoch = engine.planned_steps, len(engine.data_loader)
    epochs = math.ceil(planned / steps_per_epoch)
    progress = Progress(epochs, steps_per_epoch, planned, config.quiet)
    epsilon = float("nan")
    for epoch in range(1, epochs + 1):
        for i, batch in enumerate(engine.data_loader, start=1):
            _step(engine, batch, task)
            run.log({"kind": "step", "epoch": epoch, "step": engine.steps,
                     "lr": engine.optimizer.param_groups[0]["lr"]})
            progress.update(epoch, i, engine.steps, epsilon, float("nan"))
            if engine.steps >= planned:
                break
        epsilon = engine.epsilon(delta)
        progress.update(epoch, i, engine.steps, epsilon, float("nan"), final=True)
        run.log({"kind": "epoch", "epoch": epoch, "step": engine.steps, "epsilon": epsilon})
    return epsilon


# ---------------------------------------------------------------------------- command line
def _targets(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected module names like query,value, got {text!r}")
    return names


def add_arguments(train: argparse.ArgumentParser, positive_int) -> None:
    """The text flags of ``tunefree train`` (used when ``--model`` is a path)."""
    group = train.add_argument_group("text models (--model PATH)")
    group.add_argument("--text-column", default=None, help="text column of the table (default: text)")
    group.add_argument("--task", choices=text_data.TASKS, default=None,
                       help="classification or causal-lm (default: classification when the table has the "
                            "label column, else causal-lm)")
    group.add_argument("--max-length", type=positive_int, default=None,
                       help="tokens per example, declared public; longer texts are truncated, shorter ones "
                            "padded (default: the smallest of 8, 16, 32, … up to the model's positions that "
                            "holds 95%% of the training texts, by a private quantile: 5%% of the budget's "
                            "μ²)")
    group.add_argument("--train-weights", choices=text_defaults.TRAIN_WEIGHTS, default=None,
                       help="what a classification run trains: 'head' (a linear head on the frozen model's "
                            "mean-pooled token states), 'all' (every weight, or the LoRA adapters) or 'auto' "
                            "(the default: every weight only where the noise on a step's mean gradient, "
                            "σ√d/B, is at most 1, the largest signal under AUTO-S; else the head). Without "
                            "--batch-size and --epochs/--steps, a head trains 300 steps of batch N/4 (64 to "
                            "1024), every weight 3 epochs of batch 256")
    group.add_argument("--lora-rank", type=positive_int, default=None,
                       help="fine-tune LoRA adapters of this rank instead of every parameter")
    group.add_argument("--lora-targets", type=_targets, default=None,
                       help="comma-separated module names for LoRA (default: peft's attention "
                            "projections for the architecture, e.g. query,value for BERT, c_attn for GPT-2)")


TEXT_FLAGS = ("text_column", "task", "max_length", "lora_rank", "lora_targets", "train_weights")


def check_no_text_flags(args: argparse.Namespace) -> None:
    """Refuse the text flags on a run of a built-in model."""
    given = [name for name in TEXT_FLAGS if getattr(args, name) is not None]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"{flags} apply to text models: pass --model PATH of a Hugging Face model "
                         f"directory, or drop {flags}")


# Flags of the built-in models that a text run does not use, with their defaults.
TABLE_FLAGS = {"schema": None, "hidden": None, "numeric_scaling": "private", "thresholds": "fixed",
               "target_quantile": None, "quantile_lr": None, "quantile_budget": None, "clip_gamma": None,
               "psac_r": None, "noise_allocation": "global", "lr_update_interval": None,
               "audit_canaries": None, "na_values": (), "drop_rows_with_missing": False}


def command(args: argparse.Namespace) -> int:
    """``tunefree train --model PATH``: build the configuration from the flags, train, print the result."""
    given = ["--" + name.replace("_", "-") for name, default in TABLE_FLAGS.items()
             if getattr(args, name) != default]
    if given:
        raise ValueError(f"{', '.join(given)} do not apply to text models (fixed thresholds, no table "
                         "columns): drop them")
    config = TextConfig(
        model=args.model, data=args.dataset, out=str(args.out) if args.out else "", test_data=args.test_data,
        text_column=args.text_column or "text", label_column=args.label_column, task=args.task,
        labels=args.labels, max_length=args.max_length, lora_rank=args.lora_rank,
        lora_targets=args.lora_targets, epsilon=args.epsilon, delta=args.delta,
        epochs=args.epochs, steps=args.steps, batch_size=args.batch_size,
        train_weights=args.train_weights or "auto", optimizer=args.optimizer or DEFAULT_TEXT_OPTIMIZER,
        lr=args.lr, clipping=args.clipping, groups=args.groups, accountant=args.accountant, seed=args.seed,
        quiet=args.quiet)
    result = train_text(config)
    if args.json:
        write_json(args.json, result)
    if result["task"] == "classification":
        metric = (f"test accuracy {result['test_accuracy']:.4f} (always predicting the majority class "
                  f"{result['test_majority_class']!r}: {result['test_majority_rate']:.4f})")
    else:
        metric = f"test loss {result['test_loss']:.4f} (perplexity {result['test_perplexity']:.4g})"
    print(f"{metric} on {result['dataset']['test_examples']} held-out rows (outside the guarantee: computed "
          "from those rows without noise)")
    print(f"guarantee: {result['guarantee']}; randomness: {result['randomness']}")
    print(result["delta_choice"])
    for note in [*result["data_notes"], *([result["note"]] if result["note"] else [])]:
        print(f"note: {note}")
    adapter = " (the LoRA adapter only)" if result["lora"] else ""
    serves = (f" — `tunefree predict --run {args.out} --data new.csv` classifies new texts"
              if result["task"] == "classification" else "")
    print(f"model saved in {result['model_directory']}{adapter}{serves}; run directory: {args.out} (model/, "
          "report.json, metrics.jsonl, plots)")
    return 0


# ---------------------------------------------------------------------------- tunefree predict
def holds_text_model(run: Path) -> bool:
    """Whether the run directory ``run`` is a text run's (its model in ``model/``, described there)."""
    return (Path(run) / "model" / text_models.TEXT_CONFIG).exists()


@torch.no_grad()
def predict_classes(model: nn.Module, batch: dict[str, torch.Tensor], batch_size: int = 64) -> list[str]:
    """The predicted class name of each tokenised text (``(other)`` for the labels not selected)."""
    indices = []
    for start in range(0, len(batch["input_ids"]), batch_size):
        logits = model(batch["input_ids"][start:start + batch_size],
                       batch["attention_mask"][start:start + batch_size])
        indices += logits.argmax(-1).tolist()
    return [model.classes[i] for i in indices]


def predict_command(args: argparse.Namespace) -> int:
    """``tunefree predict --run DIR`` of a text run: the texts of ``--data`` tokenised as the training texts
    were (text column, token length: ``model/tunefree_text.json``), classified by the saved model."""
    import sys

    if not holds_text_model(args.run):
        raise ValueError(f"{args.run} holds a model/ folder without {text_models.TEXT_CONFIG}: give the "
                         "--out directory of a finished `tunefree train` run on a text column")
    if args.na_values:
        raise ValueError("--na-values applies to table models: a text run reads its text column as it is")
    model, tokenizer, description = text_models.load_classifier(Path(args.run) / "model")
    table = text_data.read_table(args.data, description["text_column"])
    batch = text_data.tokenize(tokenizer, table.texts, description["max_length"], "classification")
    frame = table.frame.copy()
    frame["prediction"] = predict_classes(model, batch)
    if args.output is None:
        frame.to_csv(sys.stdout, index=False)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(args.output, index=False)
        print(f"{len(frame)} predictions written to {args.output}")
    return 0
