"""Text data for ``tunefree train --model PATH``: a CSV, JSON-lines or Parquet table with a text column
(and a label column for classification), tokenised once, up front.

Padding is not the examples' data: each example is truncated or padded on the right to the run's token
length (``--max-length``, or a private quantile: never a length read from the data), its attention mask
is 0 on the padding, and for causal LM its labels are -100 there, so that no padding token enters its
loss. The train/test split is the keyed per-row hash of ``split.py``; the classes are declared or selected
privately (``text.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .datasets import detect_format
from .tables import DataError

TASKS = ("classification", "causal-lm")
TEXT_FORMATS = ("csv", "jsonl", "parquet")
IGNORED_LABEL = -100  # torch's cross_entropy ignore_index: a causal-LM position that is not a target


@dataclass
class TextTable:
    """The rows of a text table: its texts, and its columns for the labels."""

    name: str
    texts: list[str]
    frame: Any  # the pandas DataFrame

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(str(c) for c in self.frame.columns)

    def labels(self, column: str) -> np.ndarray:
        """The raw values of the label ``column``; refused if missing or with an empty cell."""
        import pandas as pd

        if column not in self.frame.columns:
            raise DataError(f"{self.name}: label column {column!r} not found; columns are "
                            f"{list(self.columns)[:20]} — pass --label-column")
        labels = self.frame[column].to_numpy()
        missing = np.flatnonzero(pd.isna(np.asarray(labels, dtype=object)))
        if missing.size:
            raise DataError(f"{self.name}: column {column!r} is empty in data row(s) "
                            f"{(missing[:10] + 1).tolist()} (counting from 1 after any header): fill in "
                            "or drop those rows")
        return labels


def read_table(path: str, text_column: str) -> TextTable:
    """Read ``path`` (CSV, JSON lines or Parquet); refuse a missing text column or an empty text."""
    import pandas as pd

    fmt = detect_format(path)
    if fmt not in TEXT_FORMATS:
        raise DataError(f"{path}: text data must be a .csv, .jsonl or .parquet file, got {fmt} data")
    readers = {"csv": pd.read_csv, "parquet": pd.read_parquet,
               "jsonl": lambda file: pd.read_json(file, lines=True, dtype=False)}
    name = Path(path).name
    try:
        frame = readers[fmt](path)
    except Exception as error:  # pandas' and pyarrow's parse errors have many types
        raise DataError(f"{name} cannot be read as {fmt}: {error}") from error
    if text_column not in frame.columns:
        raise DataError(f"{name}: text column {text_column!r} not found; columns are "
                        f"{[str(c) for c in frame.columns][:20]} — pass --text-column")
    if len(frame) == 0:
        raise DataError(f"{name}: the table holds no rows")
    empty = np.flatnonzero([not isinstance(t, str) or not t.strip() for t in frame[text_column]])
    if empty.size:
        raise DataError(f"{name}: column {text_column!r} is empty or not text in data row(s) "
                        f"{(empty[:10] + 1).tolist()} (counting from 1 after any header): fill in or drop "
                        "those rows")
    return TextTable(name, [str(t) for t in frame[text_column]], frame)


def infer_task(task: str | None, label_column: str | None, columns: tuple[str, ...],
               default_label: str = "label") -> tuple[str, str | None]:
    """The task and its label column: ``--task`` if given, else classification when the table has a
    label column (``--label-column`` or a column named ``label``), else causal LM."""
    if task is not None and task not in TASKS:
        raise ValueError(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
    if task == "causal-lm":
        if label_column is not None:
            raise ValueError("--label-column applies to --task classification; a causal LM learns the "
                             "text itself: drop --label-column")
        return task, None
    if label_column is None and default_label in columns:
        label_column = default_label
    if label_column is None:
        if task == "classification":
            raise ValueError(f"--task classification needs a label column and the table has none named "
                             f"{default_label!r} (columns {list(columns)[:20]}): pass --label-column")
        return "causal-lm", None
    return "classification", label_column


def token_lengths(tokenizer, texts: list[str], cap: int) -> torch.Tensor:
    """Each text's number of tokens, counted up to ``cap``."""
    encoded = tokenizer(texts, truncation=True, max_length=cap, padding=False)
    return torch.tensor([len(ids) for ids in encoded["input_ids"]], dtype=torch.float64)


def tokenize(tokenizer, texts: list[str], max_length: int, task: str) -> dict[str, torch.Tensor]:
    """Token ids and attention masks of every text, truncated or right-padded to ``max_length`` tokens
    (public: declared or released); for causal LM, labels that are the ids with -100 on the padding."""
    if tokenizer.pad_token is None:  # e.g. GPT-2: any id will do, the mask and labels ignore padding
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        if tokenizer.pad_token is None:
            raise ValueError("the tokenizer has no padding, end-of-text or unknown token to pad with: "
                             "give it a pad_token and save it with the model")
    tokenizer.padding_side = "right"
    encoded = tokenizer(texts, truncation=True, max_length=max_length, padding="max_length",
                        return_tensors="pt")
    batch = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    lengths = batch["attention_mask"].sum(1)
    needed = 2 if task == "causal-lm" else 1
    short = torch.nonzero(lengths < needed).flatten()
    if len(short):
        reason = "one to predict from and one to predict" if needed == 2 else "a classifier reads one"
        raise DataError(f"text row(s) {(short[:10] + 1).tolist()} give fewer than {needed} token(s) "
                        f"({reason}): drop those rows")
    if task == "causal-lm":
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORED_LABEL)
    return batch


class TextExamples(torch.utils.data.Dataset):
    """Rows of a tokenised batch, as dicts of tensors (the form the Poisson loader collates)."""

    def __init__(self, tensors: dict[str, torch.Tensor], rows: np.ndarray):
        self.tensors = {key: value[torch.as_tensor(rows)] for key, value in tensors.items()}
        self.rows = len(rows)

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.tensors.items()}
