"""Unmodified Hugging Face models, tiny random-init configs, exact against a batch-size-1 loop.

Each model looks up shared tensors the way it does in real use (BERT's position ids (1, L) from a buffer,
GPT-2's from ``arange``); the engine makes that broadcast explicit. Losses are per example; a causal-LM
loss is summed over each example's real tokens (padding labels are -100).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as hf
from support.hf_exact import assert_exact

from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.errors import PrivacyError
from tunefree.persample.engine import ClippingEngine

pytestmark = pytest.mark.hf

B, L, V = 3, 6, 50
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
ENCODER = {"vocab_size": V, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 32, **NO_DROPOUT}


def text_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids with right padding of variable length: the examples have 6, 4 and 5 real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 5:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 1), "attention_mask": mask}


def classification_loss(model, batch):
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return F.cross_entropy(model(**inputs).logits, labels, reduction="none")


def causal_lm_loss(model, batch):
    """Each example's summed next-token loss over its real tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    tokens = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
    return tokens.sum(1)


def with_labels(batch, classes=3):
    return {**batch, "labels": torch.arange(B) % classes}


def test_bert_classifier_with_padding_and_its_pooler():
    model = hf.BertForSequenceClassification(hf.BertConfig(**ENCODER, num_labels=3))
    assert_exact(model, classification_loss, with_labels(text_batch()))


def test_bert_with_an_unused_pooler_gets_no_clipped_sum_for_it():
    model = hf.BertModel(hf.BertConfig(**ENCODER))

    def first_token_loss(model, batch):
        return model(**batch).last_hidden_state[:, 0].tanh().sum(1)

    sums = assert_exact(model, first_token_loss, text_batch(), grouping="per-layer")
    pooler = set(model.pooler.parameters())
    assert pooler and not pooler & set(sums)  # zero clipped sum; the release adds its full noise
    assert len(sums) == sum(p.requires_grad for p in model.parameters()) - len(pooler)


def test_roberta_classifier():
    config = hf.RobertaConfig(**{**ENCODER, "max_position_embeddings": 16}, num_labels=3, pad_token_id=1)
    assert_exact(hf.RobertaForSequenceClassification(config), classification_loss, with_labels(text_batch()))


@pytest.mark.parametrize("grouping", ["all-layer", "per-layer"])
def test_gpt2_lm_head_with_tied_embeddings_and_variable_length(grouping):
    config = hf.GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = hf.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert_exact(model, causal_lm_loss, text_batch(), grouping=grouping)


def test_llama_style_decoder_rmsnorm_and_rotary():
    config = hf.LlamaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=32, max_position_embeddings=16,
                            bos_token_id=0, eos_token_id=0)
    assert_exact(hf.LlamaForCausalLM(config), causal_lm_loss, text_batch())


def bart_config():
    return hf.BartConfig(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                         decoder_ffn_dim=32,
                         max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                         activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                         decoder_start_token_id=2, forced_eos_token_id=None)


def seq2seq_loss(model, batch):
    """Each example's summed token loss over its real target tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   decoder_input_ids=batch["decoder_input_ids"]).logits
    return F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").sum(1)


def seq2seq_batch():
    batch = text_batch()
    labels = text_batch(seed=1)["input_ids"][:, :4].clone()
    labels[1, 3:] = -100
    decoder_input_ids = hf.models.bart.modeling_bart.shift_tokens_right(labels, 1, 2)
    return {**batch, "labels": labels, "decoder_input_ids": decoder_input_ids}


def test_bart_encoder_decoder_with_the_decoder_inputs_in_the_batch():
    assert_exact(hf.BartForConditionalGeneration(bart_config()), seq2seq_loss, seq2seq_batch())


def test_bart_decoder_inputs_built_inside_the_model_are_refused_with_the_fix():
    """From ``labels`` BART would compute its own loss, a mean over the batch's tokens: refused at the call
    (``persample/model_loss.py``), naming the decoder inputs as the fix. From ``input_ids`` alone BART
    builds its decoder inputs anew: the engine cannot prove they are the batch's, and its fallback for
    BartScaledWordEmbedding refuses rather than guess."""
    model = hf.BartForConditionalGeneration(bart_config()).train()
    ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("auto-s"))
    batch = seq2seq_batch()
    with pytest.raises(PrivacyError, match="one label per token.*prepare_decoder_input_ids_from_labels"):
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    with pytest.raises(PrivacyError, match="BartScaledWordEmbedding.*derived from the batch"):
        seq2seq_out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        F.cross_entropy(seq2seq_out.transpose(1, 2), batch["input_ids"], reduction="sum").backward()


def t5_model():
    config = hf.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                         dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return hf.T5ForConditionalGeneration(config).train()


def test_t5_relative_attention_bias_is_refused_and_exact_when_frozen():
    model = t5_model()
    engine = ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("auto-s"))
    batch = seq2seq_batch()
    with pytest.raises(PrivacyError, match="relative_attention_bias.*shows 4 examples"):
        seq2seq_loss(model, batch).sum().backward()
    engine.detach()
    model = t5_model()
    for name, p in model.named_parameters():
        p.requires_grad_("relative_attention_bias" not in name)
    assert_exact(model, seq2seq_loss, batch)


def test_vit_classifier():
    config = hf.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                          image_size=8, patch_size=4, num_channels=3, num_labels=3, **NO_DROPOUT)
    pixels = torch.randn(B, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    assert_exact(hf.ViTForImageClassification(config), classification_loss,
                 {"pixel_values": pixels, "labels": torch.arange(B) % 3})
