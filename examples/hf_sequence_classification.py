"""Private fine-tuning of an unmodified Hugging Face sequence classifier with tunefree.

Offline and quick: a tiny BERT built from a config (random init, no download) learns which half of the
vocabulary the tokens of a sentence of variable length (right-padded) mostly come from. With a pretrained
model, replace the config by ``BertForSequenceClassification.from_pretrained(path)``; nothing else changes.
It reports the accuracy on held-out sentences, never on the training set (a training metric is computed
from the private data without noise, outside the guarantee).

    python examples/hf_sequence_classification.py [--examples 2048] [--epochs 4] [--save DIR]"""

from __future__ import annotations

import argparse
import os

import torch
import transformers
from torch.utils.data import DataLoader

import tunefree

VOCAB, LENGTH, PAD = 30, 12, 0


def make_data(n: int, generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Sentences of 4 to 12 tokens, right-padded. Label 1: most tokens come from the upper half of the
    vocabulary; label 0: from the lower half (a third of the tokens from either half)."""
    examples = []
    half = VOCAB // 2
    for _ in range(n):
        length = int(torch.randint(4, LENGTH + 1, (), generator=generator))
        label = int(torch.rand((), generator=generator) < 0.5)
        ids = torch.randint(1, half, (length,), generator=generator) + label * (half - 1)
        noise = torch.rand(length, generator=generator) < 1 / 3
        ids[noise] = torch.randint(1, VOCAB, (int(noise.sum()),), generator=generator)
        padded = torch.full((LENGTH,), PAD)
        padded[:length] = ids
        examples.append({"input_ids": padded, "attention_mask": (padded != PAD).long(),
                         "labels": torch.tensor(label)})
    return examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=2048, help="the private training set's size")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--save", help="a folder for the trained model and the run's privacy state")
    options = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    train, held_out = make_data(options.examples, generator), make_data(256, generator)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=LENGTH, num_labels=2, pad_token_id=PAD)
    model = transformers.BertForSequenceClassification(config)
    model.train()  # dropout stays on: tunefree captures each layer's real input
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = tunefree.make_private(model, optimizer, DataLoader(train, batch_size=256),
                                   target_epsilon=8.0, target_delta=1e-4, epochs=options.epochs)
    for _ in range(options.epochs):
        for batch in engine.data_loader:  # Poisson-sampled: sizes vary
            engine.optimizer.zero_grad()
            if len(batch["labels"]) > 0:  # HF models cannot run an empty batch; its step adds noise only
                model(**batch).loss.backward()  # the mean over the batch: loss_reduction="mean"
            engine.optimizer.step()

    model.eval()
    with torch.no_grad():
        batch = {key: torch.stack([example[key] for example in held_out]) for key in held_out[0]}
        accuracy = (model(**batch).logits.argmax(-1) == batch["labels"]).float().mean().item()
    print(f"held-out accuracy {accuracy:.4f}; {engine.guarantee()}")
    if options.save:
        model.save_pretrained(options.save)
        torch.save(engine.state_dict(), os.path.join(options.save, "privacy.pt"))


if __name__ == "__main__":
    main()
