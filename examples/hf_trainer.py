"""Private fine-tuning of a sequence classifier with the Hugging Face ``Trainer``: ``PrivateTrainer``.

Offline by default: a tiny BERT built from a config (random init, no download) with a word-level
vocabulary learns whether a sentence is mostly positive or negative. With ``--model PATH`` (a local Hugging
Face model directory with its tokenizer) the same sentences are tokenized by the model's tokenizer and the
pretrained model is fine-tuned instead. The logs show ε and the held-out sentences' loss and accuracy, never
a training metric (``PrivateTrainer`` drops the training loss: it is computed from the private data
without noise, outside the guarantee).

    python examples/hf_trainer.py [--model PATH] [--epsilon 8] [--epochs 3] [--examples 2048] [--save DIR]"""

from __future__ import annotations

import argparse
import os
import random
import tempfile

import torch
import transformers

import tunefree

POSITIVE = ["good", "great", "fine", "nice", "happy", "lovely", "superb", "bright", "warm", "kind"]
NEGATIVE = ["bad", "awful", "poor", "sad", "grim", "dull", "harsh", "cold", "cruel", "ugly"]
NEUTRAL = ["the", "a", "movie", "day", "food", "room", "it", "was", "very", "and", "quite", "really"]
LENGTH = 16


def sentences(n: int, rng: random.Random) -> list[tuple[str, int]]:
    """Sentences of 4 to 12 words; label 1: four in five sentiment words are positive (0: negative)."""
    out = []
    for _ in range(n):
        label = rng.random() < 0.5
        words = []
        for _ in range(rng.randint(4, 12)):
            kind = rng.random()
            if kind < 0.4:
                words.append(rng.choice(NEUTRAL))
            else:
                positive = (rng.random() < 0.8) == label
                words.append(rng.choice(POSITIVE if positive else NEGATIVE))
        out.append((" ".join(words), int(label)))
    return out


class WordTokenizer:
    """A word-level tokenizer of this example's vocabulary (0: padding, 1: [CLS])."""

    def __init__(self):
        self.ids = {w: i + 2 for i, w in enumerate(POSITIVE + NEGATIVE + NEUTRAL)}
        self.vocab_size = len(self.ids) + 2

    def __call__(self, text: str) -> dict[str, torch.Tensor]:
        ids = [1] + [self.ids[w] for w in text.split()][:LENGTH - 1]
        padded = torch.tensor(ids + [0] * (LENGTH - len(ids)))
        return {"input_ids": padded, "attention_mask": (padded != 0).long()}


def encode(data: list[tuple[str, int]], tokenize) -> list[dict[str, torch.Tensor]]:
    return [{**tokenize(text), "labels": torch.tensor(label)} for text, label in data]


def build(model_path: str | None):
    """The model and a function text → padded input tensors."""
    if model_path is None:
        tokenizer = WordTokenizer()
        config = transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=64,
                                         max_position_embeddings=LENGTH, num_labels=2, pad_token_id=0)
        return transformers.BertForSequenceClassification(config), tokenizer
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=2)

    def tokenize(text: str) -> dict[str, torch.Tensor]:
        encoded = tokenizer(text, padding="max_length", truncation=True, max_length=LENGTH,
                            return_tensors="pt")
        return {k: v[0] for k, v in encoded.items() if k in ("input_ids", "attention_mask")}
    return model, tokenize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local Hugging Face model directory (default: a tiny random BERT)")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--examples", type=int, default=2048, help="the private training set's size")
    parser.add_argument("--save", help="a folder for the trained model and the run's privacy state")
    options = parser.parse_args()

    rng = random.Random(0)
    model, tokenize = build(options.model)
    train = encode(sentences(options.examples, rng), tokenize)  # the private data
    held_out = encode(sentences(256, rng), tokenize)
    with tempfile.TemporaryDirectory() as output_dir:
        args = transformers.TrainingArguments(
            output_dir=output_dir, report_to=[], use_cpu=not torch.cuda.is_available(),
            per_device_train_batch_size=32,  # at most 32 examples in one forward pass …
            gradient_accumulation_steps=2,  # … and 2 × 32 = 64 examples per step, in expectation
            num_train_epochs=options.epochs, learning_rate=1e-2, lr_scheduler_type="constant",
            max_grad_norm=0.0,  # tunefree clips each example's gradient; the Trainer's clipping is off
            logging_steps=32, save_strategy="no", eval_strategy="epoch", disable_tqdm=True)
        trainer = tunefree.PrivateTrainer(model, args, train_dataset=train, eval_dataset=held_out,
                                          target_epsilon=options.epsilon, target_delta=1e-4,
                                          compute_metrics=accuracy)
        trainer.train()  # the logs show ε spent so far, the held-out loss and accuracy
        metrics = trainer.evaluate()
    print(f"held-out accuracy {metrics['eval_accuracy']:.4f}; {trainer.engine.guarantee()}")
    if options.save:
        trainer.save_model(options.save)
        torch.save(trainer.engine.state_dict(), os.path.join(options.save, "privacy.pt"))


def accuracy(prediction: transformers.EvalPrediction) -> dict[str, float]:
    logits, labels = prediction.predictions, prediction.label_ids
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


if __name__ == "__main__":
    main()
