"""``tunefree train --model PATH`` on text: tiny random-init BERT (classification) and GPT-2 (causal LM)
saved with ``save_pretrained`` beside a word-level tokenizer, trained a few steps from CSV, JSON lines
and Parquet; the saved model (or LoRA adapter) loads back with plain transformers/peft."""

from __future__ import annotations

import hashlib
import json
import math
import random

import dp_accounting as dpa
import pandas as pd
import peft
import pytest
import torch
import transformers

from tunefree.cli import main, text_data, text_defaults, text_head, text_models
from tunefree.cli import text as text_module
from tunefree.cli.releases import Budget
from tunefree.cli.split import held_out, split_key, table_rows
from tunefree.privacy import threshold_event
from tunefree.privacy.accounting import epsilon_of, planned_event

pytestmark = pytest.mark.hf

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "good", "great", "fun", "bad", "awful", "dull"]
SPECIAL = ["[PAD]", "[UNK]", "<eos>"]


def _tokenizer(**special):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", **special)


def _rows(n: int = 60) -> pd.DataFrame:
    """Reviews whose first three words say the label, then 1–6 random words (variable lengths)."""
    rng = random.Random(0)
    rows = []
    for i in range(n):
        positive = i % 2
        words = rng.choices(["good", "great", "fun"] if positive else ["bad", "awful", "dull"], k=3)
        rows.append({"review": " ".join(words + rng.choices(WORDS, k=rng.randint(1, 6))),
                     "sentiment": "pos" if positive else "neg"})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    torch.manual_seed(0)
    vocab = len(SPECIAL) + len(WORDS)
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=vocab, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32))
    bert.save_pretrained(root / "bert")
    _tokenizer(pad_token="[PAD]").save_pretrained(root / "bert")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_embd=16, n_layer=1, n_head=2, n_positions=32, bos_token_id=2, eos_token_id=2))
    gpt2.save_pretrained(root / "gpt2")
    _tokenizer(eos_token="<eos>").save_pretrained(root / "gpt2")  # no pad token, like GPT-2's own
    frame = _rows()
    frame.rename(columns={"review": "text", "sentiment": "label"}).to_csv(root / "reviews.csv", index=False)
    frame[["review"]].to_json(root / "lm.jsonl", orient="records", lines=True)
    frame.to_parquet(root / "reviews.parquet")
    return root


def _digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _train(files, out, *args):
    code = main(["train", "--steps", "2", "--batch-size", "8", "--quiet", "--seed", "0",
                 "--accountant", "rdp", "--out", str(out), "--json", str(out / "r.json"), *args])
    assert code == 0
    result = json.loads((out / "r.json").read_text())
    assert json.loads((out / "report.json").read_text())["epsilon"] == result["epsilon"]
    return result


def _held_out(texts, labels=None, seed=0) -> list[int]:
    """The rows a run with ``--seed seed`` tests on: the keyed hash of each row's text (and label)."""
    cells = [texts] + ([labels] if labels is not None else [])
    return [int(i) for i in held_out(table_rows(cells), split_key(seed)).nonzero()[0]]


@pytest.fixture(scope="module")
def bert_run(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("bert_run")
    return out, _train(files, out, "--model", str(files / "bert"), "--data", str(files / "reviews.csv"),
                       "--labels", "neg,pos", "--max-length", "16", "--train-weights", "all")


@pytest.fixture(scope="module")
def gpt2_lora_run(files, tmp_path_factory):
    before = _digest(files / "gpt2")
    out = tmp_path_factory.mktemp("gpt2_run")
    result = _train(files, out, "--model", str(files / "gpt2"), "--data", str(files / "lm.jsonl"),
                    "--text-column", "review", "--lora-rank", "2")
    return out, result, before


def test_classification_from_csv_saves_a_model_that_loads_and_predicts(files, bert_run):
    out, result = bert_run
    assert result["task"] == "classification" and result["label_column"] == "label"
    assert result["steps"] == result["planned_steps"] == 2 and not result["lora"]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out / "model").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "model")
    assert model.config.id2label == {0: "neg", 1: "pos"}
    frame = pd.read_csv(files / "reviews.csv")
    rows = _held_out(frame["text"].tolist(), frame["label"].tolist())
    texts = [frame["text"][i] for i in rows]
    expected = torch.tensor([{"neg": 0, "pos": 1}[frame["label"][i]] for i in rows])
    with torch.no_grad():
        logits = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits
    assert logits.shape == (len(texts), 2)
    # the reloaded model is the one that was evaluated: its held-out accuracy is the report's
    assert (logits.argmax(-1) == expected).float().mean().item() == pytest.approx(result["test_accuracy"])
    base = transformers.AutoModelForSequenceClassification.from_pretrained(files / "bert")
    changed = [name for name, p in model.named_parameters()
               if not torch.equal(p, base.state_dict()[name])]
    assert changed, "full fine-tuning must change the weights"


def ledger_of(result) -> dpa.DpEvent:
    """The run's releases as report.json lists them: the training steps and each preprocessing release."""
    events = [planned_event(result["noise_multiplier"], result["sample_rate"], result["steps"])]
    for release in result["preprocessing"]:
        if release["release"] == "class labels":  # a partition selection
            events.append(threshold_event(release["noise_multiplier"], release["threshold_delta"]))
        else:
            events.append(dpa.GaussianDpEvent(release["noise_multiplier"]))
    return dpa.ComposedDpEvent(events)


@pytest.fixture(scope="module")
def head_run(files, tmp_path_factory):
    """The default on a small table: a head on the frozen model's mean-pooled states, its own schedule."""
    out = tmp_path_factory.mktemp("head_run")
    code = main(["train", "--quiet", "--seed", "0", "--accountant", "rdp", "--model", str(files / "bert"),
                 "--data", str(files / "reviews.csv"), "--labels", "neg,pos", "--out", str(out), "--json",
                 str(out / "r.json")])
    assert code == 0
    return out, json.loads((out / "r.json").read_text())


def test_small_data_trains_a_mean_pooled_head_that_loads_and_predicts(files, head_run):
    out, result = head_run
    train_rows = result["dataset"]["train_examples"]
    assert result["trained"] == "head" and "σ√d/B" in result["trained_why"]
    assert result["trainable_parameters"] == 16 * 2 + 2  # hidden 16 → neg, pos
    # the head's schedule: batch N/4 within [64, 1024] (here all N rows), 300 steps
    assert result["batch_size"] == min(64, train_rows) and result["steps"] == 300
    assert 0.99 * 3.0 <= result["epsilon"] <= 3.0
    model, tokenizer = text_models.load_mean_pooled_classifier(out / "model")
    assert model.classes == ["neg", "pos"]
    frame = pd.read_csv(files / "reviews.csv")
    rows = _held_out(frame["text"].tolist(), frame["label"].tolist())
    length = result["dataset"]["sequence_length"]
    batch = text_data.tokenize(tokenizer, [frame["text"][i] for i in rows], length, "classification")
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"])
    expected = torch.tensor([{"neg": 0, "pos": 1}[frame["label"][i]] for i in rows])
    # the reloaded model is the one that was evaluated: its held-out accuracy is the report's
    assert (logits.argmax(-1) == expected).float().mean().item() == pytest.approx(result["test_accuracy"])
    base = transformers.AutoModel.from_pretrained(files / "bert")
    assert all(torch.equal(p, base.state_dict()[name]) for name, p in model.encoder.named_parameters())


def test_mean_pooling_ignores_padding(files):
    model, tokenizer, _ = text_models.load(str(files / "bert"), "classification", ["neg", "pos"], True)
    encoder = text_models.encoder_of(model)
    padded = text_data.tokenize(tokenizer, ["good fun", "bad awful dull the mat"], 8, "classification")
    alone = text_data.tokenize(tokenizer, ["good fun"], 2, "classification")
    together = text_models.mean_pooled(encoder, padded["input_ids"], padded["attention_mask"])
    single = text_models.mean_pooled(encoder, alone["input_ids"], alone["attention_mask"])
    assert torch.allclose(together[0], single[0], atol=1e-5)
    torch.manual_seed(0)
    deeper = transformers.BertModel(transformers.BertConfig(
        vocab_size=len(SPECIAL) + len(WORDS), hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32)).eval()
    pooled = text_models.mean_pooled(deeper, padded["input_ids"], padded["attention_mask"])
    with torch.no_grad():
        out = deeper(input_ids=alone["input_ids"], attention_mask=alone["attention_mask"],
                     output_hidden_states=True)
    layers = out.hidden_states[1:]  # every layer's output, not the embeddings: their mean over the tokens
    assert len(layers) == 3
    assert torch.allclose(pooled[0], torch.stack(layers).mean(0)[0].mean(0), atol=1e-5)
    assert not torch.allclose(pooled[0], layers[-1][0].mean(0), atol=1e-3)


@pytest.mark.slow
def test_the_weights_rule_trains_every_weight_only_where_the_noise_is_below_the_signal():
    # the issue's case: N = 1,897, ε = 8, all-MiniLM-L6-v2's 22.7M weights, batch 256, 3 epochs
    weights, why = text_defaults.choose_weights("auto", 22_713_986, 1897, 8.0, 1 / 1897 ** 1.1, None, None,
                                                None)
    assert weights == "head" and "σ√d/B = 12" in why  # RESULTS §5f's measured 12.4
    big = {"num_train": 10 ** 7, "epsilon": 8.0, "delta": 1e-8, "accountant": "rdp"}
    run = text_defaults.schedule("all", 10 ** 7, 4096, None, 100)
    assert text_defaults.noise_to_signal(100_000, run=run, **{k: v for k, v in big.items()}) < 1
    assert text_defaults.choose_weights("auto", 100_000, batch_size=4096, epochs=None, steps=100, **big)[0] \
        == "all"
    # a reference run (no noise) trains what a private run at the default ε = 3 would
    weights, why = text_defaults.choose_weights("auto", 22_713_986, 1897, float("inf"), 1 / 1897 ** 1.1, None,
                                                None, None)
    assert weights == "head" and "at ε = 3" in why and "without noise (a reference run)" in why
    assert text_defaults.choose_weights("auto", 100_000, batch_size=None, epochs=None, steps=None,
                                        **{**big, "epsilon": float("inf")})[0] == "all"  # as at ε = 3
    assert text_defaults.choose_weights("head", 100_000, batch_size=None, epochs=None, steps=None, **big)[0] \
        == "head"


def test_reported_epsilon_is_the_ledgers(bert_run, gpt2_lora_run, head_run):
    (_, declared), (_, private, _), (_, head) = bert_run, gpt2_lora_run, head_run
    assert declared["preprocessing"] == [] and declared["dataset"]["sequence_length"] == 16
    length, = private["preprocessing"]  # no --max-length: a private quantile of the training texts' lengths
    assert length["release"] == "text length" and length["share"] == 0.05
    assert private["dataset"]["sequence_length"] == length["length"] in length["edges"]
    assert 0 < private["preprocessing_epsilon"] < 3.0 and declared["preprocessing_epsilon"] == 0.0
    assert [r["release"] for r in head["preprocessing"]] == ["text length", "centre of the pooled states"]
    for result in (declared, private, head):
        assert result["epsilon"] == pytest.approx(epsilon_of(ledger_of(result), result["delta"], "rdp"),
                                                  rel=1e-12)
        # training is calibrated on the whole ledger, the length release included: ε is the target
        assert 0.99 * 3.0 <= result["epsilon"] <= 3.0


def test_lora_causal_lm_from_json_lines_saves_only_the_adapter(files, gpt2_lora_run):
    out, result, before = gpt2_lora_run
    assert result["task"] == "causal-lm" and result["lora"]  # no label column: causal LM inferred
    saved = {p.name for p in (out / "model").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= saved
    assert not saved & {"model.safetensors", "pytorch_model.bin"}
    assert _digest(files / "gpt2") == before  # the base model's files are untouched
    base = transformers.AutoModelForCausalLM.from_pretrained(files / "gpt2")
    original = {name: p.clone() for name, p in base.state_dict().items()}
    model = peft.PeftModel.from_pretrained(base, out / "model").eval()
    for name, p in model.base_model.model.state_dict().items():
        if "lora_" not in name:  # every base weight is the original one
            key = name.replace(".base_layer", "")
            assert torch.equal(p, original[key]), name
    lora_b = [p for name, p in model.named_parameters() if "lora_B" in name]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # B starts at zero: it was trained
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "model")
    texts = pd.read_json(files / "lm.jsonl", lines=True)["review"].tolist()
    held = [texts[i] for i in _held_out(texts)]
    batch = text_data.tokenize(tokenizer, held, result["dataset"]["sequence_length"], "causal-lm")
    with torch.no_grad():
        loss = text_models.per_example_losses(model, batch, "causal-lm").mean().item()
        generated = model.generate(input_ids=batch["input_ids"][:1, :3], max_new_tokens=2, do_sample=False)
    assert loss == pytest.approx(result["test_loss"], rel=1e-5)
    assert generated.shape == (1, 5)


def test_lora_classification_from_parquet_with_named_columns(files, tmp_path):
    result = _train(files, tmp_path, "--model", str(files / "bert"), "--data", str(files / "reviews.parquet"),
                    "--text-column", "review", "--label-column", "sentiment", "--lora-rank", "2",
                    "--lora-targets", "query,value", "--max-length", "6", "--labels", "neg,pos")
    assert result["task"] == "classification" and result["dataset"]["sequence_length"] == 6
    base = transformers.AutoModelForSequenceClassification.from_pretrained(files / "bert")
    model = peft.PeftModel.from_pretrained(base, tmp_path / "model").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "model")
    with torch.no_grad():
        logits = model(**tokenizer(["good fun", "awful dull"], padding=True, return_tensors="pt")).logits
    assert logits.shape == (2, 2) and torch.isfinite(logits).all()
    # only the adapters and the classifier head were trained
    assert result["trainable_parameters"] < sum(p.numel() for p in base.parameters()) / 10


def test_causal_lm_loss_is_the_mean_over_the_examples_own_tokens(files):
    model = transformers.AutoModelForCausalLM.from_pretrained(files / "gpt2").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(files / "gpt2")
    texts = ["the cat sat", "a dog ran on the mat fast"]
    batch = text_data.tokenize(tokenizer, texts, 10, "causal-lm")  # padded to the declared length
    assert batch["input_ids"].shape == (2, 10)
    assert (batch["labels"][0, 3:] == text_data.IGNORED_LABEL).all()  # padding is not the example's data
    assert (batch["attention_mask"][0, 3:] == 0).all() and (batch["attention_mask"][1, :7] == 1).all()
    with torch.no_grad():
        together = text_models.per_example_losses(model, batch, "causal-lm")
        for i, text in enumerate(texts):
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            logits = model(input_ids=ids).logits
            alone = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])  # mean over its tokens
            assert together[i].item() == pytest.approx(alone.item(), rel=1e-5)


def test_a_gpt2_classifier_pads_with_its_end_of_text_token(files):
    model, tokenizer, notes = text_models.load(str(files / "gpt2"), "classification", ["neg", "pos"], True)
    assert any("score" in note for note in notes)  # the new head is named
    batch = text_data.tokenize(tokenizer, ["good fun", "bad awful dull the mat"], 5, "classification")
    text_models.share_padding(model, tokenizer)
    assert batch["attention_mask"][0].tolist() == [1, 1, 0, 0, 0]
    first = {"input_ids": batch["input_ids"][:1, :2], "attention_mask": batch["attention_mask"][:1, :2],
             "labels": torch.tensor([1])}
    batch["labels"] = torch.tensor([1, 0])
    model.eval()
    with torch.no_grad():
        padded = text_models.per_example_losses(model, batch, "classification")
        alone = text_models.per_example_losses(model, first, "classification")
    assert padded[0].item() == pytest.approx(alone[0].item(), rel=1e-5)  # padding does not change it


BAD_INPUTS = [
    (["--data", "{files}/reviews.csv", "--text-column", "body"], "text column 'body' not found"),
    (["--data", "{files}/reviews.csv", "--label-column", "stars"], "label column 'stars' not found"),
    (["--data", "{files}/empty_text.csv"], "column 'text' is empty or not text in data row(s) [2]"),
    (["--data", "{files}/lm.jsonl", "--text-column", "review", "--task", "classification"],
     "--task classification needs a label column"),
    (["--data", "{files}/reviews.csv", "--model", "{files}"], "is not a model: give one of the built-in"),
    (["--data", "{files}/reviews.csv", "--model", "{files}/nowhere"], "is not a model"),
    (["--data", "{files}/reviews.csv", "--lora-targets", "query"], "--lora-targets chooses where LoRA"),
    (["--data", "{files}/reviews.csv", "--lora-rank", "2", "--lora-targets", "nothing_here"],
     "LoRA on this bert model failed"),
    (["--data", "{files}/reviews.csv", "--hidden", "8"], "--hidden do not apply to text models"),
    (["--data", "{files}/reviews.csv", "--audit-canaries", "100"], "--audit-canaries do not apply to text"),
    (["--data", "{files}/reviews.csv", "--lr", "hyfreedp"], "--lr hyfreedp is not available for text models"),
    (["--data", "{files}/reviews.csv", "--max-length", "64"], "--max-length 64 is longer than the model's"),
    (["--data", "{files}/reviews.csv", "--na-values", "?"], "--na-values do not apply to text models"),
    (["--model", "mlp", "--text-column", "review"], "--text-column apply to text models"),
    (["--data", "{files}/reviews.csv", "--train-weights", "head", "--lora-rank", "2"],
     "--train-weights head trains a classification head on the frozen model: drop it with --lora-rank"),
    (["--model", "{files}/gpt2", "--data", "{files}/lm.jsonl", "--text-column", "review", "--train-weights",
      "head"],
     "this is a causal-LM run: drop --train-weights head"),
]


@pytest.mark.parametrize("args, message", BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(files, tmp_path, capsys, args, message):
    pd.DataFrame({"text": ["good fun", " ", "bad"], "label": [1, 0, 0]}).to_csv(
        files / "empty_text.csv", index=False)
    args = [a.format(files=files) for a in args]
    model = [] if "--model" in args else ["--model", str(files / "bert"), "--labels", "neg,pos"]
    code = main(["train", "--steps", "1", "--batch-size", "2", "--quiet", "--out", str(tmp_path / "run"),
                 *model, *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_model_without_a_tokenizer_and_a_text_too_short_to_learn_from_are_refused(files, tmp_path, capsys):
    import shutil

    shutil.copytree(files / "bert", tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "bare" / name).unlink(missing_ok=True)
    common = ["train", "--steps", "1", "--batch-size", "2", "--quiet", "--out", str(tmp_path / "run")]
    code = main([*common, "--model", str(tmp_path / "bare"), "--data", str(files / "reviews.csv"),
                 "--labels", "neg,pos"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--model {tmp_path / 'bare'} has no tokenizer (none of tokenizer.json, " in err
    texts = [f"good fun day {i}" for i in range(20)] + ["bad"] + [f"dull awful plot {i}" for i in range(20)]
    pd.DataFrame({"review": texts}).to_json(tmp_path / "short.jsonl", orient="records", lines=True)
    code = main([*common, "--model", str(files / "gpt2"), "--data", str(tmp_path / "short.jsonl"),
                 "--text-column", "review", "--max-length", "8", "--seed", "0"])  # seeded: a fixed split
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "text row(s) [21] give fewer than 2 token(s) (one to predict from and one to predict)" in err


def test_unknown_task_and_missing_out_are_refused(files, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", str(files / "bert"), "--data", str(files / "reviews.csv"),
              "--task", "translation"])
    assert exit_info.value.code == 2 and "invalid choice: 'translation'" in capsys.readouterr().err
    code = main(["train", "--model", str(files / "bert"), "--data", str(files / "reviews.csv")])
    assert code == 2 and "needs --out DIR" in capsys.readouterr().err


def test_the_optimizer_asked_for_is_the_one_that_trains(files, tmp_path, monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def capture(model, optimizer, *args, **kwargs):
        seen["optimizer"] = optimizer
        raise Stop

    monkeypatch.setattr(text_module, "make_private", capture)
    with pytest.raises(Stop):
        main(["train", "--model", str(files / "bert"), "--data", str(files / "reviews.csv"), "--out",
              str(tmp_path / "run"), "--optimizer", "sgd", "--lr", "0.1", "--labels", "neg,pos",
              "--max-length", "16", "--batch-size", "8", "--steps", "1", "--quiet", "--accountant", "rdp"])
    assert type(seen["optimizer"]) is torch.optim.SGD and seen["optimizer"].param_groups[0]["lr"] == 0.1


def _predict(out, frame, path) -> pd.DataFrame:
    """``tunefree predict --run out`` on the rows of ``frame``, written to ``path`` first."""
    frame.to_csv(path, index=False)
    output = path.with_suffix(".out")
    assert main(["predict", "--run", str(out), "--data", str(path), "--output", str(output)]) == 0
    return pd.read_csv(output)


def _held_out_frame(files, name="reviews.csv", text="text", label="label") -> pd.DataFrame:
    frame = pd.read_csv(files / name) if name.endswith(".csv") else pd.read_parquet(files / name)
    return frame.iloc[_held_out(frame[text].tolist(), frame[label].tolist())]


@pytest.mark.parametrize("run", ["head_run", "bert_run"])
def test_predict_serves_a_text_run(files, tmp_path, request, run):
    out, result = request.getfixturevalue(run)
    held = _held_out_frame(files)
    predicted = _predict(out, held.drop(columns=["label"]), tmp_path / "new.csv")
    assert list(predicted["text"]) == list(held["text"]) and set(predicted["prediction"]) <= {"neg", "pos"}
    # new texts are tokenised and pooled as the training texts were: the held-out accuracy is the report's
    accuracy = (predicted["prediction"].to_numpy() == held["label"].to_numpy()).mean()
    assert accuracy == pytest.approx(result["test_accuracy"])


def test_predict_serves_a_lora_classifier_and_refuses_a_causal_lm(files, tmp_path, gpt2_lora_run, capsys):
    result = _train(files, tmp_path / "lora", "--model", str(files / "bert"), "--data",
                    str(files / "reviews.parquet"), "--text-column", "review", "--label-column", "sentiment",
                    "--lora-rank", "2", "--labels", "neg,pos", "--max-length", "8")
    held = _held_out_frame(files, "reviews.parquet", "review", "sentiment")
    predicted = _predict(tmp_path / "lora", held[["review"]], tmp_path / "new.csv")
    accuracy = (predicted["prediction"].to_numpy() == held["sentiment"].to_numpy()).mean()
    assert accuracy == pytest.approx(result["test_accuracy"])
    out, _, _ = gpt2_lora_run
    capsys.readouterr()
    code = main(["predict", "--run", str(out), "--data", str(files / "lm.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and "holds a causal-lm model, which generates text rather than classifying it" in err


def test_the_reference_run_trains_the_private_recipe_without_noise(files, tmp_path, capsys):
    out = tmp_path / "reference"
    code = main(["train", "--quiet", "--seed", "0", "--model", str(files / "bert"), "--data",
                 str(files / "reviews.csv"), "--labels", "neg,pos", "--epsilon", "inf", "--out", str(out),
                 "--json", str(out / "r.json")])
    assert code == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "r.json").read_text())
    # a private run of this size trains a head: so does its reference, 300 steps of N/4, with σ = 0
    assert result["trained"] == "head" and "without noise (a reference run)" in result["trained_why"]
    assert result["noise_multiplier"] == 0 and result["epsilon"] == "inf" and result["steps"] == 300
    assert result["config"]["optimizer"] == "adamw" and result["config"]["lr"] == "auto"
    centre, = [r for r in result["preprocessing"] if r["release"] == "centre of the pooled states"]
    assert centre["noise_multiplier"] == 0  # exact with no privacy
    # the majority rate of the test rows is shown beside the accuracy, outside the guarantee
    labels = _held_out_frame(files)["label"]
    share = labels.value_counts(normalize=True)
    assert result["test_majority_rate"] == pytest.approx(share.max())
    assert result["test_majority_class"] == share.idxmax()
    assert {"test_majority_rate", "test_majority_class"} <= set(result["outside_the_guarantee"]["keys"])
    assert f"always predicting the majority class {share.idxmax()!r}: {share.max():.4f}" in printed
    assert f"tunefree predict --run {out}" in printed


def test_classes_selected_privately_are_named_in_the_output_and_in_the_ledger(files, tmp_path, capsys):
    """docs/cli.md: classes are declared with --labels or selected privately, as for tables (the output
    says which)."""
    capsys.readouterr()
    result = _train(files, tmp_path / "run", "--model", str(files / "bert"), "--data",
                    str(files / "reviews.csv"), "--max-length", "16", "--epsilon", "50")
    printed = capsys.readouterr().out
    labels, = [r for r in result["preprocessing"] if r["release"] == "class labels"]
    assert labels["selected"] == {"label": ["neg", "pos"]} and labels["noise_multiplier"] > 0
    assert "note: the classes ['neg', 'pos'] were selected privately from the training rows' labels" \
        in printed
    assert "of the budget's μ², in the ledger" in printed and "(other)" in printed
    assert result["epsilon"] == pytest.approx(epsilon_of(ledger_of(result), result["delta"], "rdp"), rel=1e-9)


def test_one_class_training_rows_are_refused_with_the_true_reason(files, tmp_path, capsys):
    frame = pd.read_csv(files / "reviews.csv")
    frame[frame["label"] == "pos"].to_csv(tmp_path / "pos.csv", index=False)
    for labels in (["--labels", "neg,pos"], []):
        code = main(["train", "--steps", "1", "--batch-size", "2", "--quiet", "--out", str(tmp_path / "run"),
                     "--seed", "0", "--model", str(files / "bert"), "--data", str(tmp_path / "pos.csv"),
                     *labels])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "every training row has the label 'pos'" in err, err


def test_a_text_run_reports_the_documented_keys_and_logs_no_training_loss(gpt2_lora_run, head_run):
    """docs/cli.md (text models, Output): report.json's keys per task; metrics.jsonl holds the learning
    rate per step and ε per epoch, nothing computed from the training rows without noise."""
    lm_out, lm, _ = gpt2_lora_run
    head_out, head = head_run
    common = {"epsilon", "delta", "noise_multiplier", "steps", "task", "trainable_parameters",
              "preprocessing", "dataset"}
    assert common | {"test_loss", "test_perplexity"} <= set(lm) and "test_accuracy" not in lm
    assert lm["task"] == "causal-lm" and lm["test_perplexity"] == pytest.approx(math.exp(lm["test_loss"]))
    assert common | {"test_accuracy", "test_majority_class", "test_majority_rate"} <= set(head)
    assert "sequence_length" in lm["dataset"] and "sequence_length" in head["dataset"]
    for out, result in ((lm_out, lm), (head_out, head)):
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert records[0]["kind"] == "run"
        steps = [r for r in records if r["kind"] == "step"]
        epochs = [r for r in records if r["kind"] == "epoch"]
        assert len(steps) == result["steps"] and all(set(r) == {"kind", "epoch", "step", "lr"} for r in steps)
        assert all(set(r) == {"kind", "epoch", "step", "epsilon"} for r in epochs)
        assert epochs[-1]["epsilon"] == pytest.approx(result["epsilon"])


@pytest.mark.slow
def test_test_data_gives_the_test_rows(files, tmp_path):
    frame = pd.read_csv(files / "reviews.csv")
    frame.iloc[:45].to_csv(tmp_path / "train.csv", index=False)
    test = frame.iloc[45:].copy()
    test.loc[test.index[0], "label"] = "neg" if (test["label"] == "pos").mean() >= 0.5 else "pos"
    test.to_csv(tmp_path / "test.csv", index=False)
    result = _train(files, tmp_path / "run", "--model", str(files / "bert"), "--data",
                    str(tmp_path / "train.csv"), "--test-data", str(tmp_path / "test.csv"), "--labels",
                    "neg,pos", "--max-length", "16")
    assert result["dataset"]["train_examples"] == 45 and result["dataset"]["test_examples"] == 15
    assert result["test_majority_rate"] == pytest.approx(test["label"].value_counts(normalize=True).max())
    predicted = _predict(tmp_path / "run", test.drop(columns=["label"]), tmp_path / "new.csv")
    accuracy = (predicted["prediction"].to_numpy() == test["label"].to_numpy()).mean()
    assert accuracy == pytest.approx(result["test_accuracy"])


def test_the_head_reads_privately_centred_unit_states():
    torch.manual_seed(0)
    states = torch.randn(50, 6) * 3 + 5
    rows = torch.arange(40)
    exact, release = text_head.release_centre(states, rows, Budget(float("inf"), 1e-5), None)
    units = states / states.norm(dim=1, keepdim=True)
    assert torch.allclose(exact, units[:40].double().mean(0)) and release.events == ()
    noisy, release = text_head.release_centre(states, rows, Budget(3.0, 1e-5), 0)
    assert len(release.events) == 1 and release.events[0].noise_multiplier == release.noise_multiplier > 0
    # the noise is σ·1/N per coordinate: one row moves the unit vectors' sum by at most 1
    assert (noisy - exact).std().item() == pytest.approx(release.noise_multiplier / 40, rel=0.8)
    inputs = text_head.head_inputs(states, exact)
    assert torch.allclose(inputs, (units - exact.float()) * 6 ** 0.5, atol=1e-6)
    assert inputs[:40].mean(0).abs().max() < 1e-5  # centred on the training rows
    head = torch.nn.Linear(6, 3)
    weight, bias = text_head.fold(head.weight.detach(), head.bias.detach(), exact)
    assert torch.allclose(head(inputs), units @ weight.T + bias, atol=1e-5)  # the saved head, on unit states
