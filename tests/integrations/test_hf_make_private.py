"""Unmodified Hugging Face models through the public API: ``make_private`` on a Poisson loader of dict
batches, the independence check before the first release, and an unused pooler noised like every
other trainable parameter."""

from __future__ import annotations

import pytest
import torch
import transformers as hf
from test_hf_models import ENCODER, V
from torch import nn
from torch.utils.data import DataLoader

import tunefree
from tunefree.guards.independence import Independence

pytestmark = pytest.mark.hf


def dataset(n: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (n, 6), generator=g)
    mask = (torch.arange(6) < torch.randint(3, 7, (n, 1), generator=g)).long()
    return [{"input_ids": ids[i] * mask[i], "attention_mask": mask[i], "labels": torch.tensor(i % 3)}
            for i in range(n)]


def train(model, steps: int, **private) -> tunefree.DPEngine:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine = tunefree.make_private(model, optimizer, DataLoader(dataset(), batch_size=8), target_delta=1e-2,
                                   steps=steps, seed=0, **private)
    done = 0
    while done < steps:
        for batch in engine.data_loader:
            engine.optimizer.zero_grad()
            if len(batch["labels"]):
                model(**batch).loss.backward()
            engine.optimizer.step()
            done += 1
            if done == steps:
                break
    return engine


def test_an_unmodified_bert_classifier_trains_privately():
    model = hf.BertForSequenceClassification(hf.BertConfig(**ENCODER, num_labels=3)).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = train(model, steps=3, noise_multiplier=1.0)  # σ given: no calibration, fast
    assert engine.guards.of(Independence).first_done  # the example-independence check ran and passed
    assert engine.ledger.steps == 3
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())


class FirstToken(nn.Module):
    """A classifier on the first token's hidden state: BERT's pooler runs but feeds no loss."""

    def __init__(self):
        super().__init__()
        self.bert, self.head = hf.BertModel(hf.BertConfig(**ENCODER)), nn.Linear(16, 3)

    def forward(self, input_ids, attention_mask, labels):
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.head(hidden[:, 0])
        return hf.modeling_outputs.SequenceClassifierOutput(
            loss=nn.functional.cross_entropy(logits, labels), logits=logits)


@pytest.mark.parametrize("sigma", [0.0, 2.0])
def test_an_unused_pooler_gets_a_zero_clipped_sum_plus_the_full_noise(sigma):
    model = FirstToken().train()
    pooler = dict(model.bert.pooler.named_parameters())
    engine = train(model, steps=1, noise_multiplier=sigma, groups="per-layer", clipping="abadi",
                   max_grad_norm=1.0)
    grads = {n: p.grad for n, p in pooler.items()}
    assert all(g is not None for g in grads.values())
    if sigma == 0:
        assert all((g == 0).all() for g in grads.values())
    else:  # pure noise: std σ·R / expected batch size (R = 1: the sensitivity of the whole release)
        std = sigma * 1.0 / (16 * engine.sample_rate)
        weight = grads["dense.weight"]
        assert weight.abs().gt(0).all() and 0.8 < weight.std().item() / std < 1.2


def test_generate_and_save_pretrained_are_unaffected_after_private_steps(tmp_path):
    config = hf.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=0,
                           eos_token_id=0, pad_token_id=0)
    model = hf.GPT2LMHeadModel(config).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [{"input_ids": row["input_ids"]} for row in dataset()]
    engine = tunefree.make_private(model, optimizer, DataLoader(data, batch_size=8), target_delta=1e-2,
                                   noise_multiplier=1.0, steps=1, seed=0)
    for batch in engine.data_loader:
        engine.optimizer.zero_grad()
        if len(batch["input_ids"]):
            logits = model(**batch).logits
            loss = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch["input_ids"][:, 1:],
                                               reduction="none").sum(1).mean()
            loss.backward()
        engine.optimizer.step()
        break
    model.eval()
    prompt = torch.tensor([[3, 4, 5]])
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False)
    model.save_pretrained(tmp_path)
    reloaded = hf.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert generated.shape == (1, 7)
    assert torch.equal(reloaded.generate(prompt, max_new_tokens=4, do_sample=False), generated)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))
