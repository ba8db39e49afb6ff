"""Private LoRA fine-tuning of a causal language model (GPT-2 architecture) with ``peft`` and tunefree.

Offline and quick: the private corpus is the source of a Python standard-library module (``argparse``),
cut into lines packed into examples of at most 64 bytes, right-padded. A tiny GPT-2 is first trained
briefly, non-privately, on other public text (``textwrap``'s source) to stand in for a pretrained model;
then only LoRA adapters are trained, with (ε, δ)-DP, on the private corpus. Each example's loss is the sum
of its real tokens' losses (padding has label -100 and is nobody's data).

It reports the loss on held-out lines, never on the training set (a training metric is computed from the
private data without noise, outside the guarantee).

    python examples/lora_causal_lm.py [--epsilon 8] [--epochs 2] [--pretrain-steps 100] [--save FILE]"""

from __future__ import annotations

import argparse
import pathlib
import textwrap

import peft
import torch
import transformers
from torch.nn import functional as F
from torch.utils.data import DataLoader

import tunefree

LENGTH, PAD = 64, 0  # byte-level tokens; NUL never occurs in source code


def examples_of(text: str) -> list[dict[str, torch.Tensor]]:
    """Consecutive lines packed into examples of at most LENGTH bytes (longer lines truncated)."""
    examples, current = [], b""
    for line in text.encode().splitlines(keepends=True):
        if current and len(current) + len(line) > LENGTH:
            examples.append(current)
            current = b""
        current += line[:LENGTH]
    examples.append(current)
    out = []
    for raw in examples:
        ids = torch.full((LENGTH,), PAD)
        ids[:len(raw)] = torch.tensor(list(raw))
        mask = (torch.arange(LENGTH) < len(raw)).long()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def summed_token_losses(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each example's next-token cross-entropy summed over its real tokens: one loss per example."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], ignore_index=-100,
                           reduction="none").sum(1)


def loss_per_token(model, data: list[dict[str, torch.Tensor]]) -> float:
    batch = {k: torch.stack([d[k] for d in data]) for k in data[0]}
    with torch.no_grad():
        return (summed_token_losses(model, batch).sum() / (batch["labels"][:, 1:] != -100).sum()).item()


def pretrain(model, text: str, steps: int = 100) -> None:
    """Ordinary (non-private) training on public text: the stand-in for a pretrained model."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(examples_of(text), batch_size=32, shuffle=True)
    done = 0
    while done < steps:
        for batch in loader:
            optimizer.zero_grad()
            summed_token_losses(model, batch).mean().backward()
            optimizer.step()
            done += 1
            if done == steps:
                return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--pretrain-steps", type=int, default=100, help="the public stand-in's training")
    parser.add_argument("--save", help="a file for the trained weights and the run's privacy state")
    options = parser.parse_args()
    torch.manual_seed(0)

    config = transformers.GPT2Config(vocab_size=256, n_positions=LENGTH, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD)
    base = transformers.GPT2LMHeadModel(config)
    pretrain(base, pathlib.Path(textwrap.__file__).read_text(), options.pretrain_steps)

    private = examples_of(pathlib.Path(argparse.__file__).read_text())
    train, held_out = private[:-200], private[-200:]
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"],
                           fan_in_fan_out=True, task_type="CAUSAL_LM")  # GPT-2's Conv1D layers
    model = peft.get_peft_model(base, lora)
    model.train()
    before = loss_per_token(model, held_out)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine = tunefree.make_private(model, optimizer, DataLoader(train, batch_size=64),
                                   target_epsilon=options.epsilon, target_delta=1e-5, epochs=options.epochs,
                                   loss_reduction="sum")
    while engine.steps < engine.planned_steps:
        for batch in engine.data_loader:  # Poisson-sampled: sizes vary, may be empty
            engine.optimizer.zero_grad()
            if len(batch["input_ids"]) > 0:  # the sum of the per-example losses: loss_reduction="sum"
                summed_token_losses(model, batch).sum().backward()
            engine.optimizer.step()  # always: an empty batch's step releases noise alone
            if engine.steps == engine.planned_steps:
                break

    model.eval()
    after = loss_per_token(model, held_out)
    prompt = torch.tensor([list(b"    def ")])
    sample = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40,
                            do_sample=False, pad_token_id=PAD)
    print(f"held-out loss per token: {before:.4f} before, {after:.4f} after private LoRA training "
          f"({sum(p.numel() for p in model.parameters() if p.requires_grad)} trainable parameters)")
    print("greedy sample:", repr(bytes(sample[0].tolist()).decode(errors="replace")))
    print(engine.guarantee())
    if options.save:
        torch.save({"model": model.state_dict(), "privacy": engine.state_dict()}, options.save)


if __name__ == "__main__":
    main()
