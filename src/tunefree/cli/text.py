"""Private fine-tuning of a local Hugging Face model on a text table: what ``tunefree train --model PATH``
does (classification or causal LM, full fine-tuning or LoRA).

``train_text(config)`` reads and tokenises the table once, loads the model, calls
:func:`tunefree.make_private`, trains with AdamW, evaluates on the fixed held-out 20% and saves the
fine-tuned model (the adapter alone, for LoRA) with ``save_pretrained`` in ``<out>/model``; ``report.json``
beside it holds ε from the run's ledger.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..api import make_private
from ..run import DPEngine
from . import text_data, text_models
from .report import RunDirectory, norm_statistics
from .training import Progress, check_config, delta_choice, loose_target_note

# AdamW's learning rate when --lr is not given: "auto", make_private's lr="auto" (DoG's step within its
# noise budget, translated to AdamW's learning rate; no ε), benchmarks/RESULTS.md §5f.
DEFAULT_TEXT_LR = "auto"
DEFAULT_TEXT_EPOCHS = 3


@dataclass
class TextConfig:
    """A text run. ``model``: a local HF model or LoRA adapter directory; ``data``: a .csv, .jsonl or
    .parquet table. ``task`` None infers it (a label column → classification, else causal LM).
    ``lora_rank`` None fine-tunes every parameter. The privacy fields are ``TrainConfig``'s."""

    model: str
    data: str
    out: str
    text_column: str = "text"
    label_column: str | None = None
    task: str | None = None
    max_length: int = 128
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] | None = None
    epsilon: float = 3.0
    delta: float | None = None
    epochs: float | None = DEFAULT_TEXT_EPOCHS
    steps: int | None = None
    batch_size: int = 256
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
    check_config(TrainConfig(epsilon=config.epsilon, delta=config.delta, epochs=config.epochs,
                             steps=config.steps, batch_size=config.batch_size, clipping=config.clipping,
                             groups=config.groups, lr=config.resolved_lr(), accountant=config.accountant))
    if config.task is not None and config.task not in text_data.TASKS:
        raise ValueError(f"unknown task {config.task!r}: use one of {', '.join(text_data.TASKS)}")
    if config.max_length < 2:
        raise ValueError(f"--max-length must be at least 2, got {config.max_length}")
    if config.lora_rank is not None and config.lora_rank < 1:
        raise ValueError(f"--lora-rank must be at least 1, got {config.lora_rank}")
    if config.lora_targets is not None and config.lora_rank is None:
        raise ValueError("--lora-targets chooses where LoRA adapters go: add --lora-rank")
    if not config.out:
        raise ValueError("a text model run needs --out DIR: the run directory where the fine-tuned model "
                         "is saved")


def _batch_size(batch: dict[str, torch.Tensor]) -> int:
    return batch["input_ids"].shape[0]


def _step(engine: DPEngine, batch: dict[str, torch.Tensor], task: str) -> tuple[float, int]:
    """One private step; the batch's summed loss and its size."""
    engine.optimizer.zero_grad()
    size = _batch_size(batch)
    if size == 0:  # an empty Poisson batch: the model cannot run it, but the step (noise) happens
        engine.optimizer.step()
        return 0.0, 0
    losses = text_models.per_example_losses(engine.model, batch, task)
    losses.mean().backward()  # make_private's loss_reduction="mean"
    engine.optimizer.step()
    return float(losses.detach().sum()), size


@torch.no_grad()
def evaluate(model: torch.nn.Module, examples: text_data.TextExamples, task: str,
             batch_size: int = 64) -> dict[str, float]:
    """Held-out accuracy (classification) or mean per-example loss and its exponential (causal LM)."""
    model.eval()
    correct, loss_sum = 0, 0.0
    for batch in DataLoader(examples, batch_size=batch_size):
        loss_sum += float(text_models.per_example_losses(model, batch, task).sum())
        if task == "classification":
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            correct += int((logits.argmax(-1) == batch["labels"]).sum())
    model.train()
    loss = loss_sum / len(examples)
    if task == "classification":
        return {"test_accuracy": correct / len(examples), "test_loss": loss}
    return {"test_loss": loss, "test_perplexity": math.exp(min(loss, 700.0))}


def train_text(config: TextConfig) -> dict[str, Any]:
    """Run private fine-tuning as configured; returns the result, also written to ``<out>/report.json``,
    and saves the model in ``<out>/model``."""
    _check(config)
    directory = Path(config.model)
    if not directory.is_dir():
        raise text_models.not_a_model(directory)
    table = text_data.read_table(config.data, config.text_column)
    task, label_column = text_data.infer_task(config.task, config.label_column, table.columns)
    train_rows, test_rows = text_data.split(len(table.texts))
    delta, delta_text = delta_choice(config.delta, len(train_rows))
    if len(train_rows) < config.batch_size:
        raise ValueError(f"--batch-size {config.batch_size} is larger than the {len(train_rows)} training "
                         f"examples: use --batch-size {len(train_rows)} or less")
    classes = None
    if config.seed is not None:
        torch.manual_seed(config.seed)  # initialisation only; the release's randomness is make_private's
    tensors: dict[str, torch.Tensor] = {}
    if task == "classification":
        labels = table.labels(label_column)
        tensors["labels"], classes = text_data.class_indices(labels, train_rows, test_rows)
    model, tokenizer, notes = text_models.load(config.model, task, classes, config.quiet)
    if config.lora_rank is not None:
        if hasattr(model, "peft_config"):
            raise ValueError(f"--model {config.model} is already a LoRA adapter, trained as it is: drop "
                             "--lora-rank")
        model = text_models.add_lora(model, task, config.lora_rank, config.lora_targets)
    tensors.update(text_data.tokenize(tokenizer, table.texts, config.max_length, task))
    text_models.share_padding(model, tokenizer)
    if classes is not None:
        notes.append(f"the classes {[str(c) for c in classes][:10]} were read from the data and are "
                     "treated as public")
    train_set = text_data.TextExamples(tensors, train_rows)
    test_set = text_data.TextExamples(tensors, test_rows)
    trainable = [p for p in model.parameters() if p.requires_grad]
    auto = config.resolved_lr() == "auto"
    optimizer = torch.optim.AdamW(trainable, lr=1.0 if auto else config.resolved_lr())
    engine = make_private(model, optimizer, DataLoader(train_set, batch_size=config.batch_size),
                          target_epsilon=config.epsilon, target_delta=delta, epochs=config.epochs,
                          steps=config.steps, clipping=config.clipping, groups=config.groups,
                          accountant=config.accountant, seed=config.seed, lr="auto" if auto else None)
    run, started = RunDirectory(config.out), time.perf_counter()
    epsilon = _train_loop(engine, task, config, delta, run)
    train_seconds = time.perf_counter() - started
    engine.detach()
    if engine.dog_lr is not None:  # the model kept is the automatic learning rate's averaged one
        engine.dog_lr.apply_average()
    text_models.save(model, tokenizer, run.path / "model")
    result = {
        **evaluate(model, test_set, task), "epsilon": epsilon, "delta": delta, "delta_choice": delta_text,
        "noise_multiplier": engine.noise_multiplier, "steps": engine.steps,
        "planned_steps": engine.planned_steps, "sample_rate": engine.sample_rate,
        "guarantee": str(engine.guarantee(delta)), "randomness": engine.randomness.description,
        "note": loose_target_note(config.epsilon, engine.noise_multiplier, epsilon),
        "data_notes": notes, "task": task, "label_column": label_column,
        "model_directory": str(run.path / "model"), "lora": hasattr(model, "peft_config"),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "dataset": {"name": table.name, "train_examples": len(train_rows), "test_examples": len(test_rows),
                    "sequence_length": int(tensors["input_ids"].shape[1])},
        "config": {**asdict(config), "delta": delta, "lr": config.resolved_lr(), "optimizer": "adamw"},
        "train_seconds": train_seconds, "diagnostics_are_not_private": True,
    }
    run.finish(result)
    return result


def _train_loop(engine: DPEngine, task: str, config: TextConfig, delta: float, run: RunDirectory) -> float:
    """The planned steps, logged to ``run``; returns ε spent (from the ledger)."""
    planned, steps_per_epoch = engine.planned_steps, len(engine.data_loader)
    epochs = math.ceil(planned / steps_per_epoch)
    progress = Progress(epochs, steps_per_epoch, planned, config.quiet)
    epsilon = float("nan")
    for epoch in range(1, epochs + 1):
        loss_total, seen = 0.0, 0
        for i, batch in enumerate(engine.data_loader, start=1):
            loss_sum, size = _step(engine, batch, task)
            loss_total, seen = loss_total + loss_sum, seen + size
            record: dict[str, Any] = {"kind": "step", "epoch": epoch, "step": engine.steps,
                                      "batch_size": size, "loss": loss_sum / size if size else None,
                                      "lr": engine.optimizer.param_groups[0]["lr"]}
            if engine.last_step is not None:
                record["groups"] = norm_statistics(engine.last_step.group_norms, engine.last_step.thresholds)
            run.log(record)
            progress.update(epoch, i, engine.steps, loss_total / max(seen, 1), float("nan"), epsilon)
            if engine.steps >= planned:
                break
        epsilon = engine.epsilon(delta)
        progress.update(epoch, i, engine.steps, loss_total / max(seen, 1), float("nan"), epsilon, final=True)
        run.log({"kind": "epoch", "epoch": epoch, "step": engine.steps, "epsilon": epsilon,
                 "train_loss": loss_total / max(seen, 1)})
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
                       help="tokens per example; longer texts are truncated (default: 128)")
    group.add_argument("--lora-rank", type=positive_int, default=None,
                       help="fine-tune LoRA adapters of this rank instead of every parameter")
    group.add_argument("--lora-targets", type=_targets, default=None,
                       help="comma-separated module names for LoRA (default: peft's attention "
                            "projections for the architecture, e.g. query,value for BERT, c_attn for GPT-2)")


TEXT_FLAGS = ("text_column", "task", "max_length", "lora_rank", "lora_targets")


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
               "loss_privacy": None, "optimizer": "sgd", "audit_canaries": None}


def command(args: argparse.Namespace) -> int:
    """``tunefree train --model PATH``: build the configuration from the flags, train, print the result."""
    import json

    given = ["--" + name.replace("_", "-") for name, default in TABLE_FLAGS.items()
             if getattr(args, name) != default]
    if given:
        raise ValueError(f"{', '.join(given)} do not apply to text models (AdamW, fixed thresholds): "
                         "drop them")
    config = TextConfig(
        model=args.model, data=args.dataset, out=str(args.out) if args.out else "",
        text_column=args.text_column or "text", label_column=args.label_column, task=args.task,
        max_length=args.max_length or 128, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
        epsilon=args.epsilon, delta=args.delta,
        epochs=DEFAULT_TEXT_EPOCHS if args.epochs is None and args.steps is None else args.epochs,
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, clipping=args.clipping,
        groups=args.groups, accountant=args.accountant, seed=args.seed, quiet=args.quiet)
    result = train_text(config)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    metric = (f"test accuracy {result['test_accuracy']:.4f}" if result["task"] == "classification"
              else f"test loss {result['test_loss']:.4f} (perplexity {result['test_perplexity']:.4g})")
    print(f"{metric} — {result['guarantee']}; randomness: {result['randomness']}")
    print(result["delta_choice"])
    for note in [*result["data_notes"], *([result["note"]] if result["note"] else [])]:
        print(f"note: {note}")
    print(f"model saved in {result['model_directory']}"
          f"{' (the LoRA adapter only)' if result['lora'] else ''}; run directory: {args.out}")
    return 0
