"""A Hugging Face model's own loss, asked for with ``labels=`` in a training call, must be one that
``loss_reduction`` describes.

Given ``labels``, a Hugging Face model computes ``outputs.loss`` over the batch itself:

- **one label per token** (integer labels with more than one per example: causal LM, masked LM, token
  classification, seq2seq decoder labels): the mean over every labelled token of the batch. Each example's
  weight is 1/(the batch's labelled tokens), so it depends on the other examples' lengths: no
  ``loss_reduction`` describes it (1.09·R measured, issue 29). Refused, whatever ``loss_reduction``.
- **one label per example** (integer ``[B]`` or ``[B, 1]``; float labels of regression or multi-label
  classification): the mean over the batch's examples (and, for float labels, over each example's
  outputs, a constant), which is ``loss_reduction="mean"``; under ``"sum"`` refused.

The check reads the model's type and the labels' dtype and shape only, never their values, at every
captured training call of every Hugging Face model in the private model, before its forward; it never
imports ``transformers``. What it cannot see: docs/refusals.md. The fix, each example's own loss summed
with ``loss_reduction="sum"``, is :func:`token_losses_per_example` (``tunefree.token_losses_per_example``).
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import PrivacyError

IGNORED_LABEL = -100  # the label of a position that is no example's data (padding), as in Hugging Face


def token_losses_per_example(logits: torch.Tensor, labels: torch.Tensor, next_token: bool) -> torch.Tensor:
    """Each example's summed cross-entropy over its labelled tokens, shape ``[B]`` (label ``-100``:
    padding, not data). ``logits``: ``[B, L, vocabulary]``; ``labels``: ``[B, L]``. ``next_token``: the
    logits at position t predict the label at t + 1 (causal language models, as their own loss shifts
    them); False for masked LM, token classification and encoder-decoder labels (aligned). An example's
    loss depends on its own tokens alone, whatever the other examples' lengths."""
    if next_token:
        logits, labels = logits[:, :-1], labels[:, 1:]
    tokens = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORED_LABEL,
                             reduction="none")
    return tokens.view(labels.shape[0], -1).sum(1)


def predicts_next_token(model: nn.Module) -> bool | None:
    """Whether a Hugging Face model's token labels are shifted by one, as its own loss does (HF's causal LM
    loss, which every decoder-only model without another loss type uses; encoder-decoder labels are
    aligned); ``None`` for a model that is not a Hugging Face model (a PEFT wrapper is seen through)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if not hasattr(base, "loss_function"):
        return None
    if getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        return False
    causal = getattr(sys.modules.get("transformers.loss.loss_utils"), "ForCausalLMLoss", None)
    return causal is not None and base.loss_function is causal


def _pretrained_model_class() -> type[nn.Module] | None:
    return getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)


def watch_model_losses(model: nn.Module, capturing: Callable[[], bool], loss_reduction: str) -> list[Any]:
    """Forward pre-hooks (their handles) on every Hugging Face model in ``model`` that refuse a captured
    training call (``capturing()``) whose ``labels`` ask for a loss over the batch that ``loss_reduction``
    does not describe."""
    pretrained = _pretrained_model_class()
    if pretrained is None:
        return []
    # prepend: before the engine's own hooks of the call, so that a refused call leaves nothing behind
    return [module.register_forward_pre_hook(_LabelsCheck(module, capturing, loss_reduction),
                                             with_kwargs=True, prepend=True)
            for module in model.modules() if isinstance(module, pretrained)]


class _LabelsCheck:
    """The pre-hook of one Hugging Face model."""

    def __init__(self, module: nn.Module, capturing: Callable[[], bool], loss_reduction: str):
        self.capturing, self.loss_reduction = capturing, loss_reduction
        names = list(inspect.signature(module.forward).parameters)
        self.position = names.index("labels") if "labels" in names else None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        labels = kwargs.get("labels")
        if labels is None and self.position is not None and len(args) > self.position:
            labels = args[self.position]
        if isinstance(labels, torch.Tensor) and self.capturing():
            refusal = labels_refusal(module, labels, self.loss_reduction)
            if refusal is not None:
                raise PrivacyError(refusal)


def labels_refusal(model: nn.Module, labels: torch.Tensor, loss_reduction: str) -> str | None:
    """Why a training call of the Hugging Face ``model`` with ``labels`` must not train (``None``: its own
    loss is the mean over the batch's examples, as ``loss_reduction="mean"`` declares)."""
    name, shape = type(model).__name__, tuple(labels.shape)
    per_example = math.prod(shape[1:])
    if not labels.is_floating_point() and per_example > 1:
        shift = predicts_next_token(model)
        return (
            f"{name} was called for training with labels= of shape {shape}, one label per token: a Hugging "
            "Face model's own loss (outputs.loss) is then the mean over every labelled token of the batch, "
            "so each example's weight depends on how many labelled tokens the other examples have, and no "
            "loss_reduction describes it (one example moved a release by 1.09·R). Do not pass labels= in "
            "training; compute each example's loss from the logits, e.g. "
            f"loss = tunefree.token_losses_per_example(outputs.logits, labels, next_token={bool(shift)})"
            ".sum() with make_private(..., loss_reduction='sum') (next_token=True for a causal LM, whose "
            "logits at position t predict the label at t + 1; False for masked LM, token classification and "
            "encoder-decoder labels). An encoder-decoder model takes "
            "decoder_input_ids=model.prepare_decoder_input_ids_from_labels(labels=labels) instead of labels. "
            "tunefree.integrations.hf_trainer.PrivateTrainer does all this")
    if loss_reduction == "sum":
        return (
            f"{name} was called for training with labels= of shape {shape}, one label per example, under "
            "make_private(..., loss_reduction='sum'): its own loss (outputs.loss) is the mean over the "
            "batch's examples, so each example's gradient is divided by the number of examples sampled, "
            "which the private step would take for a sum. Pass make_private(..., loss_reduction='mean'), or "
            "compute each example's loss from the logits (e.g. F.cross_entropy(outputs.logits, labels, "
            "reduction='none')), sum it, and do not pass labels= in training")
    return None
