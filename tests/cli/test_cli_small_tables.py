"""A table with fewer training rows than the default batch trains with defaults (q = 1) instead of being
refused; a batch size the user gives that exceeds N is still refused."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from tunefree.cli import main
from tunefree.cli.training import DEFAULT_BATCH_SIZE, batch_size_for


def _small_table(path, rows: int = 150) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3))
    label = np.where(x[:, 0] + 0.5 * x[:, 1] > 0, "yes", "no")
    pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "label": label}).to_csv(path, index=False)


def test_the_default_batch_is_256_or_every_row_of_a_smaller_training_set():
    assert batch_size_for(None, 10_000) == DEFAULT_BATCH_SIZE == 256
    assert batch_size_for(None, 123) == 123
    assert batch_size_for(64, 123) == 64


def test_a_table_smaller_than_the_default_batch_trains_at_sample_rate_one(tmp_path, capsys):
    _small_table(tmp_path / "t.csv")
    assert main(["train", "--dataset", str(tmp_path / "t.csv"), "--seed", "0", "--steps", "3", "--labels",
                 "no,yes", "--quiet", "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    rows = round(result["sample_rate"] * result["config"]["batch_size"] ** 0)  # q = B/N with B = N
    assert result["config"]["batch_size"] < DEFAULT_BATCH_SIZE and result["sample_rate"] == rows == 1
    assert 2.9 < result["epsilon"] <= 3.0


def test_a_given_batch_larger_than_the_training_rows_is_still_refused(tmp_path, capsys):
    _small_table(tmp_path / "t.csv")
    assert main(["train", "--dataset", str(tmp_path / "t.csv"), "--seed", "0", "--steps", "3", "--labels",
                 "no,yes", "--batch-size", "256", "--quiet"]) != 0
    assert "--batch-size 256 is larger than the" in capsys.readouterr().err
