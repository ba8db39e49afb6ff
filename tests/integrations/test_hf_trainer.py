"""``PrivateTrainer``: a Hugging Face ``Trainer`` made private. ε in the logs is the ledger's, the Trainer
takes the planned number of private steps, one step at σ = 0 is the brute-force clipped sum, the default
per-example losses ignore padding and other examples, and the model saves and generates as a plain one."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
import transformers as hf
from support.brute_force import clipped_sum
from support.hf_exact import per_example_grads
from test_hf_models import ENCODER, V

import tunefree
from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.guards.independence import Independence
from tunefree.integrations.hf_trainer import PrivateTrainer, default_example_loss

pytestmark = pytest.mark.hf

L = 6


def text_data(n: int, labels: str = "class") -> list[dict[str, torch.Tensor]]:
    """Right-padded token ids of 3 to 6 real tokens; a class label per example, or for a causal LM the
    token ids as labels with padding at -100."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (n, L), generator=g)
    mask = (torch.arange(L) < torch.randint(3, L + 1, (n, 1), generator=g)).long()
    ids = ids.masked_fill(mask == 0, 1)
    if labels == "class":
        return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": torch.tensor(i % 3)}
                for i in range(n)]
    tokens = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": tokens[i]} for i in range(n)]


def bert() -> hf.BertForSequenceClassification:
    return hf.BertForSequenceClassification(hf.BertConfig(**ENCODER, num_labels=3))


def gpt2() -> hf.GPT2LMHeadModel:
    config = hf.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=0,
                           eos_token_id=0, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return hf.GPT2LMHeadModel(config)


def arguments(tmp_path, **overrides) -> hf.TrainingArguments:
    settings = {"output_dir": str(tmp_path), "report_to": [], "use_cpu": True, "max_grad_norm": 0.0,
                "save_strategy": "no", "logging_steps": 1, "disable_tqdm": True,
                "per_device_train_batch_size": 4, "learning_rate": 0.05, **overrides}
    return hf.TrainingArguments(**settings)


class Recorder:
    """An example_loss that keeps every physical batch it was given (and defers to the default)."""

    def __init__(self):
        self.batches: list[dict[str, torch.Tensor]] = []

    def __call__(self, model, inputs):
        self.batches.append({k: v.clone() for k, v in inputs.items()})
        return default_example_loss(model, inputs)


@pytest.mark.slow
def test_epsilon_is_logged_from_the_ledger_and_the_trainer_takes_the_planned_steps(tmp_path):
    recorder = Recorder()
    trainer = PrivateTrainer(bert(), arguments(tmp_path, gradient_accumulation_steps=2, num_train_epochs=1.5,
                                               eval_strategy="steps", eval_steps=3, logging_steps=3),
                             train_dataset=text_data(32), eval_dataset=text_data(40)[32:], target_epsilon=4.0,
                             target_delta=1e-2, example_loss=recorder,
                             privacy={"seed": 0, "accountant": "rdp"})  # RDP: ε in milliseconds per log
    with pytest.warns(UserWarning, match="the guarantee covers train_dataset only"):
        output = trainer.train()
    engine = trainer.engine
    # q = 4·2/32: epochs of round(1/q) = 4 steps, 1.5 epochs → 6 planned steps, all taken by the Trainer
    assert engine.sample_rate == 8 / 32 and engine.planned_steps == 6
    assert trainer.state.max_steps == trainer.state.global_step == engine.steps == 6
    step_logs = [log for log in trainer.state.log_history if "learning_rate" in log]
    assert [log["step"] for log in step_logs] == [3, 6]
    epsilons = [log["epsilon"] for log in step_logs]
    assert epsilons[0] < epsilons[1] == engine.epsilon()
    assert 3.9 < epsilons[-1] <= 4.0 * 1.01
    assert trainer.state.log_history[-1]["epsilon"] == engine.epsilon()  # the final metrics too
    evaluations = [log for log in trainer.state.log_history if "eval_loss" in log]
    assert [log["step"] for log in evaluations] == [3, 6] and all("epsilon" in log for log in evaluations)
    unreleased = {"loss", "train_loss", "grad_norm", "total_flos"}
    assert not any(unreleased & set(log) for log in trainer.state.log_history)
    # nothing computed from the training data without noise comes back from train() either
    assert output.training_loss is None and not unreleased & set(output.metrics)
    assert output.global_step == 6 and "train_runtime" in output.metrics
    # physical batches of at most per_device_train_batch_size rows; the last step's rows are its examples
    assert all(len(b["labels"]) <= 4 for b in recorder.batches)
    assert engine.guards.of(Independence).first_done and engine.last_step.examples > 0


def test_one_step_at_sigma_zero_is_the_brute_force_clipped_sum_over_the_expected_batch(tmp_path):
    torch.manual_seed(0)
    model = bert().double()
    reference = copy.deepcopy(model).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    recorder = Recorder()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = PrivateTrainer(model, arguments(tmp_path, gradient_accumulation_steps=2, max_steps=1,
                                              lr_scheduler_type="constant"),
                             train_dataset=text_data(32), optimizers=(optimizer, None), noise_multiplier=0.0,
                             target_delta=1e-2, example_loss=recorder, privacy={"seed": 3})
    trainer.train()
    assert len(recorder.batches) >= 2  # the logical batch came in physical batches of at most 4
    batch = {k: torch.cat([b[k] for b in recorder.batches]) for k in recorder.batches[0]}
    assert trainer.engine.last_step.examples == len(batch["labels"])

    def loss_fn(m, example):
        return default_example_loss(m, example)

    groups = make_groups(reference, "all-layer", 1.0)
    expected, _ = clipped_sum(per_example_grads(reference, loss_fn, batch), groups, clip_function("auto-s"))
    names = {p: n for n, p in reference.named_parameters()}
    for p, total in expected.items():
        update = dict(model.named_parameters())[names[p]].detach() - before[names[p]]
        torch.testing.assert_close(update, -total / 8, rtol=1e-6, atol=1e-9, msg=names[p])


def test_empty_logical_batches_step_with_noise_alone(tmp_path):
    recorder = Recorder()
    # q = 1/16: a step's batch is empty with probability (15/16)^16 ≈ 0.36
    trainer = PrivateTrainer(bert(), arguments(tmp_path, per_device_train_batch_size=1, max_steps=8,
                                                         logging_steps=100),
                             train_dataset=text_data(16), noise_multiplier=1.0, target_delta=1e-2,
                             example_loss=recorder, privacy={"seed": 0})
    trainer.train()
    assert trainer.state.global_step == trainer.engine.steps == 8
    assert len(recorder.batches) < 8  # some steps had no example: no forward, a release of noise alone


def test_default_example_losses_ignore_padding_and_the_other_examples():
    model, lm = bert().eval(), gpt2().eval()
    data = text_data(4)
    batch = {k: torch.stack([d[k] for d in data]) for k in data[0]}
    losses = default_example_loss(model, batch)
    torch.testing.assert_close(losses.mean(), model(**batch).loss)  # HF's classifier loss is their mean

    tokens = text_data(4, labels="lm")
    batch = {k: torch.stack([d[k] for d in tokens]) for k in tokens[0]}
    losses = default_example_loss(lm, batch)
    alone = torch.cat([default_example_loss(lm, {k: v[i:i + 1] for k, v in batch.items()}) for i in range(4)])
    torch.testing.assert_close(losses, alone)
    logits = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    real = batch["labels"][:, 1:] != -100
    manual = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:],
                                               ignore_index=-100, reduction="none")
    torch.testing.assert_close(losses, (manual * real).sum(1))  # next-token, summed over real tokens
    repadded = dict(batch, input_ids=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 7))
    torch.testing.assert_close(default_example_loss(lm, repadded), losses)


def test_a_causal_lm_trained_privately_saves_and_generates_as_a_plain_model(tmp_path):
    model = gpt2()
    trainer = PrivateTrainer(model, arguments(tmp_path, max_steps=2, logging_steps=100),
                             train_dataset=text_data(16, labels="lm"), noise_multiplier=1.0,
                             target_delta=1e-2, privacy={"seed": 0})
    trainer.train()
    assert trainer.engine.steps == 2
    model.eval()
    prompt = torch.tensor([[3, 4, 5]])
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False)
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = hf.GPT2LMHeadModel.from_pretrained(tmp_path / "saved").eval()
    assert set(reloaded.state_dict()) == set(model.state_dict())
    assert all(torch.equal(v, reloaded.state_dict()[k]) for k, v in model.state_dict().items())
    assert torch.equal(reloaded.generate(prompt, max_new_tokens=4, do_sample=False), generated)


def test_the_public_name_is_the_integration():
    assert tunefree.PrivateTrainer is PrivateTrainer


@pytest.mark.parametrize("overrides, message", [
    ({"max_grad_norm": 1.0}, "max_grad_norm=0"),
    ({"fp16": False, "auto_find_batch_size": True}, "auto_find_batch_size"),
    ({"include_num_input_tokens_seen": "all"}, "include_num_input_tokens_seen"),
])
def test_trainer_settings_acting_outside_the_private_step_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        PrivateTrainer(bert(), arguments(tmp_path, **overrides), train_dataset=text_data(8),
                       noise_multiplier=1.0, target_delta=1e-2)


def test_privacy_options_the_trainer_sets_itself_and_resuming_are_refused(tmp_path):
    with pytest.raises(ValueError, match="epochs"):
        PrivateTrainer(bert(), arguments(tmp_path), train_dataset=text_data(8), noise_multiplier=1.0,
                       target_delta=1e-2, privacy={"epochs": 3})
    for lr, reason in (("auto", "over the Trainer's scheduler"), (tunefree.HyFreeDP(),
                                                                    "closure")):
        with pytest.raises(ValueError, match=reason):
            PrivateTrainer(bert(), arguments(tmp_path), train_dataset=text_data(8), noise_multiplier=1.0,
                           target_delta=1e-2, privacy={"lr": lr})
    trainer = PrivateTrainer(bert(), arguments(tmp_path), train_dataset=text_data(8), noise_multiplier=1.0,
                             target_delta=1e-2)
    with pytest.raises(ValueError, match="resuming"):
        trainer.train(resume_from_checkpoint=True)


def test_a_peft_lora_model_trains_only_its_adapters(tmp_path):
    config = peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM")
    model = peft.get_peft_model(gpt2(), config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = PrivateTrainer(model, arguments(tmp_path, max_steps=2, logging_steps=100),
                             train_dataset=text_data(16, labels="lm"), noise_multiplier=1.0,
                             target_delta=1e-2, privacy={"seed": 0})
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert trainer.engine.steps == 2
    assert changed == {n for n, p in model.named_parameters() if p.requires_grad} and changed
    assert all("lora_" in n for n in changed)


def test_evaluating_or_predicting_on_training_examples_is_refused(tmp_path):
    train = text_data(16)
    with pytest.raises(tunefree.PrivacyError, match="eval_dataset shares 16 of its 16 examples"):
        PrivateTrainer(bert(), arguments(tmp_path), train_dataset=train, eval_dataset=train,
                       noise_multiplier=1.0, target_delta=1e-2)
    # one training example among held-out ones, in another form (lists, not tensors), in a dict of sets
    held_out = text_data(24)[16:]
    mixed = [*held_out[:3], {k: v.tolist() for k, v in train[5].items()}]
    with pytest.raises(tunefree.PrivacyError, match="shares 1 of its 4 examples with train_dataset"):
        PrivateTrainer(bert(), arguments(tmp_path), train_dataset=train,
                       eval_dataset={"clean": held_out, "mixed": mixed}, noise_multiplier=1.0,
                       target_delta=1e-2)
    trainer = PrivateTrainer(bert(), arguments(tmp_path, max_steps=1), train_dataset=train,
                             eval_dataset=held_out, noise_multiplier=1.0, target_delta=1e-2,
                             privacy={"seed": 0})
    with pytest.warns(UserWarning, match="not eval_dataset"):
        assert "eval_loss" in trainer.evaluate()  # held-out examples: evaluated (outside the guarantee)
    with pytest.raises(tunefree.PrivacyError, match="the evaluation data set shares 2 of its 2"):
        trainer.evaluate(eval_dataset=train[:2])
    with pytest.raises(tunefree.PrivacyError, match="the prediction data set shares 1 of its 3"):
        trainer.predict([*held_out[:2], train[0]])
