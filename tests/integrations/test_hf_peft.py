"""PEFT LoRA on unmodified Hugging Face models: only the adapters are trainable, their inner nn.Linear
modules go through the Linear rule (no generic fallback), and the clipped sums are exact."""

from __future__ import annotations

import peft
import pytest
import transformers as hf
from support import pop_step
from support.hf_exact import assert_exact
from test_hf_models import ENCODER, V, causal_lm_loss, classification_loss, text_batch, with_labels

from tunefree import verify_example_independence
from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.persample.engine import ClippingEngine
from tunefree.rules.linear import LinearRule

pytestmark = pytest.mark.hf


def lora(model, targets, **kwargs):
    config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=targets,
                             init_lora_weights=False, **kwargs)  # B random, so A's gradient is not 0
    return peft.get_peft_model(model, config)


def gpt2():
    return hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                            bos_token_id=0, eos_token_id=0))


def bert_classifier():
    return hf.BertForSequenceClassification(hf.BertConfig(**ENCODER, num_labels=3))


def llama():
    return hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=1,
                                              intermediate_size=32, max_position_embeddings=16,
                                              bos_token_id=0, eos_token_id=0))


CASES = {
    "gpt2": (lambda: lora(gpt2(), ["c_attn", "c_proj"], fan_in_fan_out=True), causal_lm_loss, text_batch),
    "bert": (lambda: lora(bert_classifier(), ["query", "value"], modules_to_save=["classifier"]),
             classification_loss, lambda: with_labels(text_batch())),
    "llama": (lambda: lora(llama(), ["q_proj", "v_proj", "down_proj"]), causal_lm_loss, text_batch),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_lora_adapters_only_are_trainable_and_go_through_the_linear_rule(name):
    build, _, _ = CASES[name]
    model = build().train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    engine = ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("auto-s"))
    assert all(isinstance(u.rule, LinearRule) for u in engine.units), \
        [u.name for u in engine.units if not isinstance(u.rule, LinearRule)]


@pytest.mark.parametrize("grouping", ["all-layer", "per-layer"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_lora_is_exact(name, grouping):
    build, loss, batch = CASES[name]
    model = build()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    sums = assert_exact(model, loss, batch(), grouping=grouping)
    assert {p for p in sums} <= {p for p in model.parameters() if p.requires_grad}
    for n, p in model.named_parameters():
        if n in frozen:
            assert p.grad is None and (p.detach() == frozen[n].to(p.dtype)).all()


def test_lora_dropout_passes_the_independence_check_and_writes_no_ordinary_gradient():
    model = peft.get_peft_model(gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.5,
                                                        fan_in_fan_out=True, init_lora_weights=False)).train()
    engine = ClippingEngine(model, make_groups(model, "all-layer", 1.0), clip_function("auto-s"))
    batch = text_batch()
    causal_lm_loss(model, batch).mean().backward()
    sums, examples, norms = pop_step(engine)
    verify_example_independence(model, engine, (), batch)
    assert examples == 3 and norms["all"].gt(0).all() and len(sums) == 4
    assert all(p.grad is None for p in model.parameters())


def bitfit(model):
    """BitFit: only the bias terms (and the new task head) are trained; every weight stays frozen."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(".bias") or name.startswith("classifier."))
    return model


@pytest.mark.parametrize("grouping", ["all-layer", "per-layer"])
def test_bitfit_bias_only_fine_tuning_is_exact_and_leaves_the_weights_untouched(grouping):
    model = bitfit(bert_classifier())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(".bias") or n.startswith("classifier.") for n in trainable)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    sums = assert_exact(model, classification_loss, with_labels(text_batch()), grouping=grouping)
    assert sum(p.numel() for p in sums) < sum(v.numel() for v in frozen.values()) / 10
    for n, p in model.named_parameters():
        if n in frozen:
            assert p.grad is None and (p.detach() == frozen[n].to(p.dtype)).all()
