"""``PrivateTrainer``: a Hugging Face ``transformers.Trainer`` that trains through ``make_private``.

The Trainer's loop, callbacks, evaluation, checkpoints and ``save_model`` stay as they are; what changes
(Poisson sampling, one Trainer step per private step, per-example losses summed, no unnoised training
metric, evaluation data disjoint from the training data) is in docs/transformers.md's table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import transformers
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from ..api import make_private
from ..data.poisson import PoissonDataLoader
from ..errors import PrivacyError
from ..persample.model_loss import predicts_next_token, token_losses_per_example
from ..run import DPEngine

# example_loss(model, inputs) -> one loss per example, shape [n]: runs the model on the batch ``inputs``.
ExampleLoss = Callable[[nn.Module, Mapping[str, Any]], torch.Tensor]

# Set by PrivateTrainer itself, from the Trainer's arguments: refused in ``privacy``.
_SET_BY_TRAINER = ("target_epsilon", "target_delta", "noise_multiplier", "epochs", "steps",
                   "loss_reduction", "physical_batch_size", "poisson_sampling")
# Computed from private data without noise (or, the gradient norm, before the release): never logged.
_UNRELEASED_METRICS = ("loss", "train_loss", "grad_norm", "total_flos")
OUTSIDE_THE_GUARANTEE = ("PrivateTrainer: evaluation metrics, and the checkpoint load_best_model_at_end "
                         "picks by them, are computed from the evaluation data without noise: the guarantee "
                         "covers train_dataset only, not eval_dataset")


def label_losses_per_example(logits: torch.Tensor, labels: torch.Tensor, problem_type: str) -> torch.Tensor:
    """Each example's loss for one label per example, as HF's sequence classifiers define it (their
    ``out.loss`` is the mean of these): ``"regression"`` (mean squared error over the outputs),
    ``"single_label_classification"`` (cross-entropy), ``"multi_label_classification"`` (binary
    cross-entropy, mean over the labels)."""
    n = labels.shape[0]
    if problem_type == "regression":
        return (logits.reshape(n, -1) - labels.reshape(n, -1).to(logits.dtype)).square().mean(1)
    if problem_type == "single_label_classification":
        return F.cross_entropy(logits.reshape(n, -1), labels.reshape(n), reduction="none")
    if problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none").mean(1)
    raise ValueError(f"unknown problem_type {problem_type!r}")


def default_example_loss(model: nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
    """The per-example losses of a Hugging Face model with ``labels`` in its inputs: one label per
    token (causal LM, shifted by one; masked LM, token classification, seq2seq decoder labels) is a
    sum over the example's labelled tokens; one label per example follows the model's ``problem_type``.
    The model never gets the labels (its own loss would be a mean over the batch): an encoder-decoder
    model gets its decoder inputs built from them (``prepare_decoder_input_ids_from_labels``)."""
    if "labels" not in inputs:
        raise ValueError("the batch has no 'labels': give PrivateTrainer an example_loss(model, inputs) "
                         "that returns each example's loss")
    labels = inputs["labels"]
    config = getattr(model, "config", None)
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    features = {k: v for k, v in inputs.items() if k != "labels"}
    if encoder_decoder and "decoder_input_ids" not in features:
        prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
        if prepare is None:
            raise ValueError(f"{type(model).__name__} builds its decoder inputs from labels itself: put "
                             "decoder_input_ids in the batch, or give PrivateTrainer an "
                             "example_loss(model, inputs)")
        features["decoder_input_ids"] = prepare(labels=labels)
    logits = model(**features).logits
    if labels.dim() >= 2 and not labels.is_floating_point():
        return token_losses_per_example(logits, labels, _predicts_next_token(model))
    return label_losses_per_example(logits, labels, _problem_type(config, labels))


def _predicts_next_token(model: nn.Module) -> bool:
    """Whether the model's token labels are shifted by one, as its own loss does."""
    shift = predicts_next_token(model)
    if shift is None:
        raise ValueError(f"{type(model).__name__} is not a Hugging Face model: whether its token labels are "
                         "shifted is unknown; give PrivateTrainer an example_loss(model, inputs)")
    return shift


def _problem_type(config: Any, labels: torch.Tensor) -> str:
    """The model's ``problem_type``, inferred as HF's classifiers infer it when the config has none."""
    if getattr(config, "problem_type", None):
        return config.problem_type
    if getattr(config, "num_labels", 2) == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def _examples_in(batch: Any) -> int:
    """Rows of a collated batch: the first dimension of its first tensor."""
    values = batch.values() if isinstance(batch, Mapping) else batch
    return next(v.shape[0] for v in values if isinstance(v, torch.Tensor))


def _canonical(value: Any) -> bytes:
    """Bytes that identify a field of an example whatever its container: a tensor, an array or a list of
    the same numbers give the same bytes (numbers as int64 or float64, with their shape); text as UTF-8."""
    if isinstance(value, str):
        return b"s" + value.encode()
    if isinstance(value, bytes):
        return b"b" + value
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        return b"r" + repr(value).encode()
    if array.dtype.kind in "biu":
        array = array.astype(np.int64)
    elif array.dtype.kind == "f":
        array = array.astype(np.float64)
    else:
        return b"r" + repr(value).encode()
    return b"a" + repr(array.shape).encode() + array.tobytes()


def _fields(example: Any) -> dict[Any, Any]:
    """An example's fields by name (a mapping) or position (a tuple or list)."""
    if isinstance(example, Mapping):
        return dict(example)
    if isinstance(example, (tuple, list)):
        return dict(enumerate(example))
    return {0: example}


def example_digests(dataset: Iterable[Any], keys: tuple) -> set[bytes]:
    """A digest of each example's ``keys`` fields: equal examples have equal digests."""
    digests = set()
    for example in dataset:
        fields = _fields(example)
        digest = hashlib.blake2b(digest_size=16)
        for key in keys:
            part = _canonical(fields[key])
            digest.update(len(part).to_bytes(8, "little") + part)
        digests.add(digest.digest())
    return digests


def _examples(dataset: Any) -> Iterator[Any]:
    """The examples of a map-style data set, by index (an HF ``Dataset`` iterates the same way)."""
    return (dataset[i] for i in range(len(dataset)))


def _first(dataset: Any) -> Any:
    return dataset[0] if len(dataset) else None


class _LogicalBatch:
    """One logical batch: its physical batches, handed out one at a time as the model consumes them (the
    engine learns each physical batch's examples from the Poisson loader the moment it is handed out)."""

    def __init__(self, first: Any, rest: Iterator[Any], loader: PoissonDataLoader):
        self._first, self._rest, self._loader = first, rest, loader

    def __iter__(self) -> Iterator[Any]:
        yield self._first
        while not self._loader.schedule.ends_logical:
            yield next(self._rest)


class _LogicalBatches:
    """The Poisson loader as the Trainer's train loader: one item per logical batch (private step)."""

    def __init__(self, loader: PoissonDataLoader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)  # logical steps per epoch, round(1/q)

    def __iter__(self) -> Iterator[_LogicalBatch]:
        physical = iter(self.loader)
        for first in physical:
            yield _LogicalBatch(first, physical, self.loader)


class PrivateTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose training is (ε, δ)-DP, through :func:`tunefree.make_private`.

    Build it as a ``Trainer`` (``model``, ``args``, ``train_dataset``, ``data_collator``, …) plus:

    Args:
        target_delta: δ of the guarantee; below 1/N.
        target_epsilon: the budget ε that the planned run (``args.max_steps`` or
            ``args.num_train_epochs``) spends at most; or ``noise_multiplier``: σ directly (0: no privacy).
        example_loss: ``example_loss(model, inputs)`` → each example's loss (shape ``[n]``); the
            default (:func:`default_example_loss`) covers HF models with ``labels``. Each example's loss
            must depend on that example alone: it is what one example contributes to the release.
        privacy: further ``make_private`` keywords (``clipping``, ``groups``, ``max_grad_norm``,
            ``accountant``, ``seed``, ``thresholds``, …).

    ``args.per_device_train_batch_size × args.gradient_accumulation_steps`` is the *expected* batch
    size (q = that / N); ``per_device_train_batch_size`` caps the examples in one forward pass.
    ``args.max_grad_norm`` must be 0: tunefree clips each example's gradient (its bound is
    ``privacy={"max_grad_norm": R}``); the Trainer's clipping would act on the whole batch's gradient.
    After training, ``trainer.engine`` is the run's :class:`tunefree.DPEngine` (``engine.guarantee()``).

    ``train()`` returns ``training_loss=None`` and no unnoised metric. ``eval_dataset`` (and any data set
    given to ``evaluate`` or ``predict``) must share no example with ``train_dataset`` (refused otherwise);
    its metrics and ``load_best_model_at_end``'s choice are not covered by the guarantee.
    """

    def __init__(self, model: nn.Module, args: transformers.TrainingArguments, *, target_delta: float,
                 target_epsilon: float | None = None, noise_multiplier: float | None = None,
                 example_loss: ExampleLoss | None = None, privacy: Mapping[str, Any] | None = None,
                 **trainer_kwargs: Any):
        if not isinstance(args, transformers.TrainingArguments):
            raise TypeError("PrivateTrainer needs explicit TrainingArguments (with max_grad_norm=0), "
                            f"got {type(args).__name__}")
        _check_arguments(args, trainer_kwargs)
        privacy = dict(privacy or {})
        overlap = sorted(set(privacy) & set(_SET_BY_TRAINER))
        if overlap:
            raise ValueError(f"privacy={{...}} sets {overlap}, which PrivateTrainer sets itself: pass ε/δ/σ "
                             "as PrivateTrainer's own arguments and the length and batch sizes in "
                             "TrainingArguments")
        if privacy.get("lr") is not None:
            raise ValueError("privacy={'lr': ...} is not supported: HyFreeDP needs per-example losses "
                             "from an optimizer closure, which the Trainer does not pass, and lr='auto' "
                             "(DoG) would set the learning rate over the Trainer's scheduler (whose rate "
                             "the Trainer logs) while the Trainer evaluates and saves the last weights, "
                             "not DoG's averaged ones; use the Trainer's learning rate and scheduler")
        self.accumulation_steps = args.gradient_accumulation_steps
        # The Trainer's loop sees one item per private step; the accumulation happens inside it.
        args = dataclasses.replace(args, gradient_accumulation_steps=1)
        super().__init__(model=model, args=args, **trainer_kwargs)
        self.model_accepts_loss_kwargs = False  # the loss is a sum of per-example losses, never rescaled
        self.example_loss = example_loss or default_example_loss
        self.private_settings = {"target_delta": target_delta, "target_epsilon": target_epsilon,
                                 "noise_multiplier": noise_multiplier, **privacy}
        self.engine: DPEngine | None = None
        self._epsilon_at: tuple[int, float] | None = None  # (private steps, ε after them)
        self._training_digests: dict[tuple, set[bytes]] = {}  # by the fields compared
        self._warned_outside = False
        for dataset in self._evaluation_sets(self.eval_dataset):
            self._refuse_training_examples(dataset, "eval_dataset")

    @property
    def expected_batch_size(self) -> int:
        """The expected logical batch size: per-device batch size × gradient accumulation steps."""
        return self.args.per_device_train_batch_size * self.accumulation_steps

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        if resume_from_checkpoint:
            raise ValueError("resuming a PrivateTrainer from a checkpoint is not supported: the run's "
                             "privacy state (ledger, sampler, randomness) is not in Trainer checkpoints; "
                             "save trainer.engine.state_dict() yourself and resume with make_private")
        output = super().train(resume_from_checkpoint=None, **kwargs)
        metrics = {k: v for k, v in output.metrics.items() if k not in _UNRELEASED_METRICS}
        return transformers.trainer_utils.TrainOutput(output.global_step, None, metrics)

    # ------------------------------------------------------------------ evaluation on other data only
    @staticmethod
    def _evaluation_sets(dataset: Any) -> list[Any]:
        if dataset is None:
            return []
        return list(dataset.values()) if isinstance(dataset, Mapping) else [dataset]

    def _refuse_training_examples(self, dataset: Any, what: str) -> None:
        """Refuse a data set to evaluate or predict on that shares an example with the training set (by
        per-example digests of the fields both have): its metrics would be unnoised training metrics."""
        if self.train_dataset is None or dataset is None or not hasattr(dataset, "__len__"):
            return
        first_train, first_other = _first(self.train_dataset), _first(dataset)
        if first_train is None or first_other is None:
            return
        keys = tuple(sorted(set(_fields(first_train)) & set(_fields(first_other)), key=str))
        if not keys:
            return
        if keys not in self._training_digests:
            self._training_digests[keys] = example_digests(_examples(self.train_dataset), keys)
        training = self._training_digests[keys]
        shared = sum(digest in training for digest in example_digests(_examples(dataset), keys))
        if shared:
            raise PrivacyError(
                f"{what} shares {shared} of its {len(dataset)} examples with train_dataset: evaluating on "
                "training examples releases their loss and metrics without noise. Evaluate on held-out "
                "examples that are not in train_dataset")

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """The Trainer's evaluation loader, for a data set that shares no example with the training set."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(eval_dataset, str):
            dataset = self.eval_dataset[eval_dataset]
        self._refuse_training_examples(dataset, "the evaluation data set")
        if not self._warned_outside:
            warnings.warn(OUTSIDE_THE_GUARANTEE, stacklevel=2)
            self._warned_outside = True
        return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        """The Trainer's prediction loader, for a data set that shares no example with the training set."""
        self._refuse_training_examples(test_dataset, "the prediction data set")
        return super().get_test_dataloader(test_dataset)

    def get_train_dataloader(self) -> Any:
        """Make the run private (once) and return its Poisson loader, one item per logical batch."""
        if self.engine is None:
            self.engine = self._make_private()
        return _LogicalBatches(self.engine.data_loader)

    def _make_private(self) -> DPEngine:
        trainer_loader = super().get_train_dataloader()  # the Trainer's data set and collator
        loader = DataLoader(trainer_loader.dataset, batch_size=self.expected_batch_size,
                            collate_fn=trainer_loader.collate_fn,
                            num_workers=self.args.dataloader_num_workers,
                            pin_memory=self.args.dataloader_pin_memory)
        optimizer = self.create_optimizer()
        length = ({"steps": self.args.max_steps} if self.args.max_steps > 0
                  else {"epochs": self.args.num_train_epochs})
        self.model.train()
        engine = make_private(self.model, optimizer, loader, loss_reduction="sum",
                              physical_batch_size=self.args.per_device_train_batch_size,
                              **length, **self.private_settings)
        self.optimizer = engine.optimizer
        return engine

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> tuple[list, None]:
        """One logical batch per Trainer step; nothing counted from it (its size is private)."""
        batch = next(epoch_iterator, None)
        return ([] if batch is None else [batch]), None

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """Forward and backward over each physical batch of the logical batch ``inputs``; the Trainer then
        calls ``optimizer.step()`` once: clip, noise, record, update. Returns 0: the training loss is
        computed from private data without noise, so it never reaches the Trainer's logs or results."""
        for physical in inputs:
            if _examples_in(physical) > 0:  # an empty batch still steps: its release is noise alone
                super().training_step(model, physical, None)
        return torch.zeros((), device=self.args.device)

    def compute_loss(self, model: nn.Module, inputs: Mapping[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """In training, the sum of the per-example losses; in evaluation, the model's own loss."""
        if not model.training or return_outputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        losses = self.example_loss(model, inputs)
        examples = _examples_in(inputs)
        if losses.shape != (examples,):
            raise ValueError(f"example_loss returned shape {tuple(losses.shape)} for a batch of {examples} "
                             f"examples: it must return one loss per example, shape ({examples},)")
        return losses.sum()

    def floating_point_ops(self, inputs: Any) -> int:
        """Not counted: the count would follow the private batch sizes."""
        return 0

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's metrics with ``epsilon`` spent so far (from the ledger), without the metrics
        computed from private data without noise (training loss, gradient norm, FLOPs)."""
        logs = {k: v for k, v in logs.items() if k not in _UNRELEASED_METRICS}
        if self.engine is not None:
            logs["epsilon"] = self._epsilon()
        super().log(logs, start_time)

    def _epsilon(self) -> float:
        """ε spent so far, computed once per private step (a PLD accountant takes seconds per call)."""
        steps = self.engine.steps
        if self._epsilon_at is None or self._epsilon_at[0] != steps:
            self._epsilon_at = (steps, self.engine.epsilon())
        return self._epsilon_at[1]


def _check_arguments(args: transformers.TrainingArguments, trainer_kwargs: Mapping[str, Any]) -> None:
    """Refuse Trainer settings that would act outside the private step or be silently replaced."""
    refusals = []
    if args.max_grad_norm:
        refusals.append(f"max_grad_norm={args.max_grad_norm}: the Trainer would clip the batch's summed "
                        "gradient; tunefree clips each example's own (its bound R: privacy={'max_grad_norm': "
                        "R}). Set TrainingArguments(max_grad_norm=0)")
    if args.fp16:
        refusals.append("fp16=True: the gradient scaler's scaled gradients would be clipped; use bf16=True "
                        "or float32")
    if args.include_num_input_tokens_seen not in ("no", False):
        refusals.append("include_num_input_tokens_seen: the count follows the private batch sizes; set it "
                        "to 'no'")
    if args.auto_find_batch_size:
        refusals.append("auto_find_batch_size=True: it changes the batch size, hence the sampling rate the "
                        "guarantee was planned with; choose per_device_train_batch_size yourself")
    if args.world_size > 1 or args.n_gpu > 1:
        refusals.append("more than one process or GPU: use make_private on a DistributedDataParallel model "
                        "(docs/distributed.md)")
    if getattr(args, "train_sampling_strategy", "random") != "random":
        refusals.append(f"train_sampling_strategy={args.train_sampling_strategy!r}: Poisson sampling "
                        "replaces the Trainer's sampler; leave it at 'random'")
    if trainer_kwargs.get("compute_loss_func") is not None:
        refusals.append("compute_loss_func: it computes a loss over the whole batch; give example_loss "
                        "(one loss per example) instead")
    if refusals:
        raise ValueError("PrivateTrainer cannot train with these settings:\n  " + "\n  ".join(refusals))
