"""Hugging Face models for ``tunefree train --model PATH``: loading from a local directory, LoRA, the
per-example losses, saving. ``transformers`` and ``peft`` are imported here only, when a text run
starts, so the image and table paths never need them.

The per-example loss of a causal LM is the mean cross-entropy over the example's own predicted tokens
(padding excluded), so every example weighs the same in the batch mean whatever its length; that of a
classifier is its cross-entropy.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .text_data import IGNORED_LABEL


def not_a_model(path: Path) -> ValueError:
    return ValueError(f"--model {path} is not a model: give one of the built-in models (auto, cnn, mlp, "
                      "linear) or a local Hugging Face model directory (config.json, weights and tokenizer, "
                      "as written by save_pretrained) or a LoRA adapter directory (adapter_config.json)")


# The files save_pretrained writes for a tokenizer (one suffices). Without any, transformers 5 builds some
# tokenizers (BERT's) from config.json alone, with an empty vocabulary: every word [UNK], no error.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                   "tokenizer.model", "sentencepiece.bpe.model")


def check_model_directory(path: str) -> None:
    """Refuse, before any data is read, a ``--model`` that is not a model or LoRA adapter directory, or
    that holds no tokenizer."""
    directory = Path(path)
    if not ((directory / "config.json").exists() or (directory / "adapter_config.json").exists()):
        raise not_a_model(directory)
    if not any((directory / name).exists() for name in TOKENIZER_FILES):
        raise ValueError(f"--model {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save one "
                         "there with tokenizer.save_pretrained")


def _auto_class(task: str):
    import transformers

    if task == "classification":
        return transformers.AutoModelForSequenceClassification
    return transformers.AutoModelForCausalLM


def _from_pretrained(task: str, path: Path, classes: list | None) -> tuple[nn.Module, list[str]]:
    """The model at ``path`` for ``task`` in float32, and the names of weights it had to initialise."""
    options = {}
    if classes is not None:
        options = {"num_labels": len(classes), "ignore_mismatched_sizes": True,
                   "id2label": dict(enumerate(str(c) for c in classes)),
                   "label2id": {str(c): i for i, c in enumerate(classes)}}
    try:
        model, info = _auto_class(task).from_pretrained(str(path), dtype=torch.float32,
                                                        output_loading_info=True, **options)
    except (OSError, ValueError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--model {path}: transformers cannot load it as a {task} model: {first}") from error
    new = [*info.get("missing_keys", []), *(k for k, *_ in info.get("mismatched_keys", []))]
    return model, sorted(new)


def load(path: str, task: str, classes: list | None, quiet: bool = False
         ) -> tuple[nn.Module, object, list[str]]:
    """The model and tokenizer at ``path`` (a HF model directory, or a LoRA adapter directory whose
    ``base_model_name_or_path`` is a local model), in training mode, and notes on what was new.
    ``quiet`` turns off transformers' progress bars (for the rest of the process)."""
    import transformers

    if quiet:
        transformers.utils.logging.disable_progress_bar()

    directory = Path(path)
    if not directory.is_dir():
        raise not_a_model(directory)
    notes = []
    if (directory / "adapter_config.json").exists():
        import peft

        base = Path(json.loads((directory / "adapter_config.json").read_text()).get(
            "base_model_name_or_path") or "")
        if not (base / "config.json").exists():
            raise ValueError(f"--model {directory} is a LoRA adapter whose base model {str(base)!r} is not "
                             "a local model directory: move the base model there or load it yourself")
        model, new = _from_pretrained(task, base.resolve(), classes)
        model = peft.PeftModel.from_pretrained(model, str(directory), is_trainable=True)
    elif (directory / "config.json").exists():
        model, new = _from_pretrained(task, directory.resolve(), classes)
    else:
        raise not_a_model(directory)
    if new:
        notes.append(f"weights {new[:6]}{' …' if len(new) > 6 else ''} are not in {path} and start from a "
                     "random initialisation (e.g. a new classification head)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--model {path} has no tokenizer transformers can load ({type(error).__name__}): "
                         "save one there with tokenizer.save_pretrained") from error
    model.train()
    return model, tokenizer, notes


def add_lora(model: nn.Module, task: str, rank: int, targets: tuple[str, ...] | None) -> nn.Module:
    """Wrap ``model`` with peft LoRA adapters of rank ``rank`` (alpha = 2·rank) on ``targets``, by
    default peft's choice of attention projections for the architecture; only the adapters (and a
    classifier's head) are trainable, the base is frozen."""
    import peft

    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
        target_modules=list(targets) if targets else None,
        task_type=peft.TaskType.SEQ_CLS if task == "classification" else peft.TaskType.CAUSAL_LM)
    try:
        return peft.get_peft_model(model, config)
    except ValueError as error:
        model_type = getattr(getattr(model, "config", None), "model_type", "?")
        hint = ("pass --lora-targets with the names of its attention projections, e.g. q_proj,v_proj"
                if not targets else "check the module names with print(model)")
        raise ValueError(f"LoRA on this {model_type} model failed ({str(error).splitlines()[0]}): {hint}"
                         ) from error


def per_example_losses(model: nn.Module, batch: dict[str, torch.Tensor], task: str) -> torch.Tensor:
    """One loss per example, shape [n]: cross-entropy of the class (classification) or the mean
    next-token cross-entropy over the example's own tokens (causal LM; padding is not its data)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if task == "classification":
        return F.cross_entropy(logits, batch["labels"], reduction="none")
    targets = batch["labels"][:, 1:]
    tokens = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none",
                             ignore_index=IGNORED_LABEL)
    return tokens.sum(1) / (targets != IGNORED_LABEL).sum(1)


def max_positions(model: nn.Module, tokenizer) -> int | None:
    """The most tokens the model reads (its position embeddings), from its config or its tokenizer; None if
    neither says (public: the model's own)."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < 1_000_000 else None


def share_padding(model: nn.Module, tokenizer) -> None:
    """Tell the model which token pads (a GPT-2 classifier finds each example's last real token by it)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id


def save(model: nn.Module, tokenizer, directory: Path) -> None:
    """``save_pretrained`` of the model (of the adapter only, for LoRA) and the tokenizer, so that
    plain transformers/peft load it back."""
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))


# ---------------------------------------------------------------------------- a head on mean-pooled states
TEXT_CONFIG, HEAD_WEIGHTS = "tunefree_text.json", "tunefree_head.pt"


def encoder_of(model: nn.Module) -> nn.Module:
    """The transformer under a Hugging Face classifier (its ``base_model``: BERT's ``bert``, GPT-2's
    ``transformer``), without the classifier's own pooler and head."""
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        raise ValueError(f"{type(model).__name__} has no base transformer to read states from: use "
                         "--train-weights all")
    return base


@torch.no_grad()
def mean_pooled(encoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                batch_size: int = 64) -> torch.Tensor:
    """Each text's token states under the frozen ``encoder``, averaged over its layers (every layer's
    output, not the embeddings) and over its tokens (padding excluded by the attention mask), shape
    [n, hidden]: a function of that text alone and of public weights. The layers' average, not the last
    layer: a sentence encoder's last layer is trained for similarity of meaning, in which a review and
    its opposite are close; on generated reviews the average gave the head 2–4 points more (RESULTS §5i)."""
    was_training = encoder.training
    encoder.eval()
    pooled = []
    for start in range(0, len(input_ids), batch_size):
        ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
        layers = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[1:]
        states = torch.stack(layers).mean(0)
        weights = mask.unsqueeze(-1).to(states.dtype)
        pooled.append((states * weights).sum(1) / weights.sum(1).clamp(min=1))
    encoder.train(was_training)
    return torch.cat(pooled)


class MeanPooledClassifier(nn.Module):
    """A frozen encoder and a linear head on its mean-pooled states (:func:`mean_pooled`) scaled to unit
    length: what
    ``--train-weights head`` trains (the head) and saves; ``model(input_ids=..., attention_mask=...)`` gives
    the logits."""

    def __init__(self, encoder: nn.Module, head: nn.Linear, classes: list[str]):
        super().__init__()
        self.encoder, self.head, self.classes = encoder, head, list(classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = mean_pooled(self.encoder, input_ids, attention_mask)
        return self.head(F.normalize(states, dim=1))


class Logits(nn.Module):
    """A Hugging Face classifier (or a peft model of one) as ``model(input_ids, attention_mask)`` → logits."""

    def __init__(self, model: nn.Module, classes: list[str]):
        super().__init__()
        self.model, self.classes = model, list(classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def save_description(directory: Path, description: dict) -> None:
    """``tunefree_text.json`` beside the saved model: what ``tunefree predict`` needs to prepare new texts
    as the training texts were (text column, token length, classes) and what was trained (all public:
    declared, or released)."""
    (directory / TEXT_CONFIG).write_text(json.dumps(description, indent=1))


def save_head(encoder: nn.Module, head: nn.Linear, tokenizer, directory: Path, description: dict) -> None:
    """The encoder (``save_pretrained``, unchanged), the tokenizer, the trained head and the run's
    description (with the head's pooling and input width) beside them."""
    encoder.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    save_description(directory, {**description, "pooling": "mean", "in_features": head.in_features})
    torch.save(head.state_dict(), directory / HEAD_WEIGHTS)


def read_description(directory: str | Path) -> dict:
    directory = Path(directory)
    try:
        return json.loads((directory / TEXT_CONFIG).read_text())
    except OSError as error:
        raise ValueError(f"{directory} holds no {TEXT_CONFIG}: give the model/ directory of a `tunefree "
                         "train --model PATH` run") from error


def load_mean_pooled_classifier(directory: str | Path) -> tuple[MeanPooledClassifier, object]:
    """The classifier ``--train-weights head`` saved in ``directory`` (``<out>/model``), in eval mode, and
    its tokenizer."""
    import transformers

    directory = Path(directory)
    config = read_description(directory)
    encoder = transformers.AutoModel.from_pretrained(str(directory), dtype=torch.float32)
    head = nn.Linear(config["in_features"], len(config["classes"]))
    head.load_state_dict(torch.load(directory / HEAD_WEIGHTS, weights_only=True))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    return MeanPooledClassifier(encoder, head, config["classes"]).eval(), tokenizer


def load_classifier(directory: str | Path) -> tuple[nn.Module, object, dict]:
    """The classifier a text run saved in ``directory`` (``<out>/model``) — a head, every weight, or LoRA
    adapters on their local base model — as ``model(input_ids, attention_mask)`` → logits over
    ``model.classes``, in eval mode; its tokenizer and the run's description. A causal LM is refused."""
    import transformers

    directory = Path(directory)
    description = read_description(directory)
    if description["task"] != "classification":
        raise ValueError(f"{directory} holds a {description['task']} model, which generates text rather than "
                         "classifying it: load it with transformers' AutoModelForCausalLM.from_pretrained"
                         f"({str(directory)!r}) (peft.PeftModel.from_pretrained for a LoRA adapter)")
    classes = description["classes"]
    if description["trained"] == "head":
        model, tokenizer = load_mean_pooled_classifier(directory)
        return model, tokenizer, description
    if (directory / "adapter_config.json").exists():
        import peft

        base = json.loads((directory / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base or not (Path(base) / "config.json").exists():
            raise ValueError(f"{directory} holds a LoRA adapter whose base model {base!r} is not a local "
                             "model directory: put the base model there")
        model, _ = _from_pretrained("classification", Path(base), classes)
        model = peft.PeftModel.from_pretrained(model, str(directory))
    else:
        model, _ = _from_pretrained("classification", directory, classes)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    share_padding(model, tokenizer)
    return Logits(model, classes).eval(), tokenizer, description
