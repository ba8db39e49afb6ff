"""A Hugging Face model's own loss from ``labels=``: refused where it mixes the batch's examples.

Given one label per token, ``model(..., labels=...).loss`` is the mean over every labelled token of the
batch, so each example's weight depends on the other examples' lengths (1.09·R measured, issue 29);
``loss_reduction`` describes no such loss, so the call is refused at its forward, before anything is booked,
whatever the labels' values. One label per example gives the mean over the examples, which
``loss_reduction="mean"`` describes. The fix, each example's loss from the logits
(``tunefree.token_losses_per_example``), is exact against the batch-size-1 loop."""

from __future__ import annotations

import pytest
import torch
import transformers as hf
from support.hf_exact import assert_exact
from test_hf_models import (
    ENCODER,
    B,
    V,
    bart_config,
    causal_lm_loss,
    seq2seq_batch,
    seq2seq_loss,
    t5_model,
    text_batch,
)
from test_hf_peft import gpt2, llama, lora
from torch import nn
from torch.utils.data import DataLoader

import tunefree
from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.integrations.hf_trainer import default_example_loss
from tunefree.persample.engine import ClippingEngine

pytestmark = pytest.mark.hf


def engine_on(model: nn.Module, loss_reduction: str = "mean") -> ClippingEngine:
    model.train()
    groups = make_groups(model, "all-layer", 1.0)
    return ClippingEngine(model, groups, clip_function("auto-s"), loss_reduction)


def token_labels(padded: bool = True) -> dict[str, torch.Tensor]:
    batch = text_batch()
    if not padded:  # every example as long as the others: the refusal does not depend on the values
        batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
    return {**batch, "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)}


PER_TOKEN = {
    "gpt2 causal LM": (gpt2, "next_token=True"),
    "llama causal LM": (llama, "next_token=True"),
    "bert masked LM": (lambda: hf.BertForMaskedLM(hf.BertConfig(**ENCODER)), "next_token=False"),
    "bert token classification": (
        lambda: hf.BertForTokenClassification(hf.BertConfig(**ENCODER, num_labels=V)), "next_token=False"),
}


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", PER_TOKEN)
def test_a_model_s_own_token_mean_loss_is_refused_at_its_forward(name, loss_reduction, padded):
    make, shift = PER_TOKEN[name]
    model = make()
    engine = engine_on(model, loss_reduction)
    words = (r"labels= of shape \(3, 6\), one label per token: .*mean over every labelled token of the "
             rf"batch.*token_losses_per_example\(outputs.logits, labels, {shift}\)")
    with pytest.raises(tunefree.PrivacyError, match=words):
        model(**token_labels(padded)).loss.backward()
    assert engine._pass.uses == [] and engine.accumulator.pop().examples == 0  # nothing booked
    assert all(p.grad is None for p in model.parameters())


def test_labels_given_by_position_are_seen():
    model = hf.BertForTokenClassification(hf.BertConfig(**ENCODER, num_labels=V))
    engine_on(model)
    batch = token_labels()
    with pytest.raises(tunefree.PrivacyError, match="one label per token"):
        model(batch["input_ids"], batch["attention_mask"], None, None, None, batch["labels"])


@pytest.mark.parametrize("make", [lambda: hf.BartForConditionalGeneration(bart_config()), t5_model])
def test_encoder_decoder_labels_are_refused_with_the_decoder_inputs_as_the_fix(make):
    model = make()
    engine_on(model)
    batch = seq2seq_batch()
    words = "one label per token.*next_token=False.*decoder_input_ids=model.prepare_decoder_input_ids_from"
    with pytest.raises(tunefree.PrivacyError, match=words):
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])


class Wrapped(nn.Module):
    """A module of the user's own that calls a causal LM with labels inside its forward."""

    def __init__(self):
        super().__init__()
        self.lm = gpt2()

    def forward(self, input_ids, attention_mask):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss


@pytest.mark.parametrize("make, call", [
    (Wrapped, lambda model, batch: model(batch["input_ids"], batch["attention_mask"])),
    (lambda: lora(gpt2(), ["c_attn"], fan_in_fan_out=True), lambda model, batch: model(**batch).loss)])
def test_a_hugging_face_model_inside_a_wrapper_or_peft_is_seen(make, call):
    model = make()
    engine_on(model)
    with pytest.raises(tunefree.PrivacyError, match="GPT2LMHeadModel was called for training with labels= "
                                                    r"of shape \(3, 6\), one label per token"):
        call(model, token_labels())


def classifier(num_labels: int = 3, **config) -> nn.Module:
    return hf.BertForSequenceClassification(hf.BertConfig(**ENCODER, num_labels=num_labels, **config))


def test_one_label_per_example_is_the_mean_loss_reduction_mean_declares():
    """Sequence classification (integer labels [B]) and multi-label classification (float labels [B, k]):
    the model's own loss is a mean over the examples, trained under loss_reduction='mean' and refused
    under 'sum', which would take it for a sum."""
    batch = text_batch()
    for model, labels in ((classifier(), torch.arange(B) % 3),
                          (classifier(problem_type="multi_label_classification"), torch.rand(B, 3).round())):
        engine = engine_on(model, "mean")
        model(**batch, labels=labels).loss.backward()
        assert engine.accumulator.pop().examples == B
        engine.detach()
        engine_on(model, "sum")
        words = (r"labels= of shape \(3,( 3)?\), one label per example, under make_private.*"
                 "loss_reduction='sum'.*mean over the batch's examples.*loss_reduction='mean'")
        with pytest.raises(tunefree.PrivacyError, match=words):
            model(**batch, labels=labels)


def test_labels_in_evaluation_and_outside_capture_are_not_refused():
    model = gpt2()
    engine = engine_on(model)
    with torch.no_grad():
        model(**token_labels())
    with engine.no_capture():
        model(**token_labels()).loss.backward()
    model.eval()
    model(**token_labels())


def token_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return tunefree.token_losses_per_example(logits, batch["labels"], next_token=True)


def test_the_fix_is_each_example_s_token_loss_exact_against_the_batch_size_1_loop():
    batch = token_labels()
    model = gpt2()
    torch.testing.assert_close(token_loss(model, batch), causal_lm_loss(model, batch))
    assert_exact(model, token_loss, batch)


def test_the_fix_trains_through_make_private():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (16, 6), generator=g)
    data = [{"input_ids": ids[i], "attention_mask": torch.ones(6, dtype=torch.long), "labels": ids[i]}
            for i in range(16)]
    model = gpt2().train()
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(data, batch_size=8), target_delta=1e-2, noise_multiplier=1.0,
                                   steps=2, seed=0, loss_reduction="sum")
    for batch in engine.data_loader:
        engine.optimizer.zero_grad()
        with pytest.raises(tunefree.PrivacyError, match="one label per token"):
            model(**batch)  # the idiom: refused before the forward runs
        token_loss(model, batch).sum().backward()
        engine.optimizer.step()
    assert engine.ledger.steps == 2


def test_private_trainer_s_example_loss_gives_an_encoder_decoder_its_decoder_inputs_not_its_labels():
    model = hf.BartForConditionalGeneration(bart_config())
    engine_on(model, "sum")
    batch = seq2seq_batch()
    inputs = {k: v for k, v in batch.items() if k != "decoder_input_ids"}
    torch.testing.assert_close(default_example_loss(model, inputs), seq2seq_loss(model, batch))


