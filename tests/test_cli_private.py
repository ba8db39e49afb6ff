"""What `tunefree train` learns from the private rows, through the whole command line: the neighbour test
(removing one row of the file changes no released value beyond its mechanism's sensitivity, and moves no
other row between the splits), mistyped and identifier columns, the reference run without noise, and the
saved model with its preprocessing (`tunefree predict`)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pandas as pd
import pytest
import torch

from tunefree.cli import main, preprocess, releases, scaling
from tunefree.cli import training as training_module
from tunefree.cli.predict import Predictor
from tunefree.cli.split import held_out, split_key, table_rows


class ZeroNoise:
    """The preprocessing releases' randomness with every draw 0: a release is then its exact value."""

    def normal(self, shape, device, dtype):
        return torch.zeros(shape, device=device, dtype=dtype)


class _Stop(Exception):
    pass


# the functions the spies below wrap (taken before any test replaces them)
REAL_SELECT, REAL_RELEASED, REAL_HELD_OUT = releases.select_partitions, scaling._released, preprocess.held_out
REAL_STANDARDISATION = scaling.release


def _file(path, rows: int = 160, seed: int = 0) -> pd.DataFrame:
    """A table with a numeric column of wide range, a categorical one with a value only row 7 has, and
    labels of which one only row 11 has."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"age": rng.integers(18, 90, rows), "income": rng.lognormal(8, 2, rows).round(2),
                          "colour": rng.choice(["red", "green", "blue"], rows),
                          "label": rng.choice(["no", "yes"], rows)})
    frame.loc[7, "colour"] = "violet"
    frame.loc[11, "label"] = "maybe"
    frame.to_csv(path, index=False)
    return frame


def _releases_of(monkeypatch, path, *flags) -> dict:
    """Run `tunefree train` on ``path`` up to make_private, with noise 0 in the preprocessing releases;
    what each release was computed from (its value at noise 0) and the training rows."""
    seen: dict = {}

    def select(histograms, sigma, threshold_delta, randomness):
        seen["counts"] = [dict(h) for h in histograms]
        return REAL_SELECT(histograms, sigma, threshold_delta, ZeroNoise())

    def released(values, sensitivity, sigma, randomness):
        seen.setdefault("standardisation", []).append((values.clone(), sensitivity))
        return REAL_RELEASED(values, sensitivity, sigma, ZeroNoise())

    def standardisation(x, columns, sigma, randomness):
        released = REAL_STANDARDISATION(x, columns, sigma, randomness)
        seen["bounds"] = released.bound
        return released

    def split(rows, key):
        mask = REAL_HELD_OUT(rows, key)
        seen["sides"] = dict(zip(rows, mask.tolist()))
        return mask

    def stop(*args, **kwargs):
        seen["train_rows"] = len(args[2].dataset)
        raise _Stop

    monkeypatch.setattr(releases, "select_partitions", select)
    monkeypatch.setattr(scaling, "_released", released)
    monkeypatch.setattr(scaling, "release", standardisation)
    monkeypatch.setattr(preprocess, "held_out", split)
    monkeypatch.setattr(training_module, "make_private", stop)
    with pytest.raises(_Stop):
        main(["train", "--dataset", str(path), "--seed", "0", "--steps", "1", "--batch-size", "8",
              "--quiet", "--accountant", "rdp", *flags])
    return seen


def _distance(a: dict, b: dict) -> float:
    keys = set(a) | set(b)
    return math.sqrt(sum((a.get(k, 0) - b.get(k, 0)) ** 2 for k in keys))


def test_removing_one_row_changes_no_release_beyond_its_sensitivity(tmp_path, monkeypatch):
    frame = _file(tmp_path / "d.csv")
    full = _releases_of(monkeypatch, tmp_path / "d.csv", "--epsilon", "50")
    k = len(full["counts"])  # the label and the colour histograms: each row adds one count to each
    assert k == 2 and [set(c) for c in full["counts"]] == [{"maybe", "no", "yes"},
                                                           {"blue", "green", "red", "violet"}]
    worst = {"counts": 0.0, "histogram": 0.0, "moments": 0.0, "moved": 0}
    for j in [7, 11, *range(0, 160, 12), int(frame["income"].idxmax())]:
        frame.drop(index=j).to_csv(tmp_path / "n.csv", index=False)
        neighbour = _releases_of(monkeypatch, tmp_path / "n.csv", "--epsilon", "50")
        # the split: every other row stays on its side
        moved = sum(neighbour["sides"][row] != side for row, side in full["sides"].items()
                    if row in neighbour["sides"])
        worst["moved"] = max(worst["moved"], moved)
        in_training = not full["sides"][table_rows([frame.loc[[j], c] for c in frame.columns])[0]]
        assert neighbour["train_rows"] == full["train_rows"] - in_training
        # the partition selection: counts move by at most 1 in each histogram, √k in all
        change = math.sqrt(sum(_distance(a, b) ** 2 for a, b in zip(full["counts"], neighbour["counts"])))
        worst["counts"] = max(worst["counts"], change)
        assert change <= math.sqrt(k) * in_training + 1e-12
        # the standardisation's two releases, each within its sensitivity (the moments, computed with the
        # bounds the first release gave, are compared where both runs got the same bounds: all rows here)
        (hist, s_hist), (moments, s_moments) = full["standardisation"]
        (n_hist, _), (n_moments, _) = neighbour["standardisation"]
        worst["histogram"] = max(worst["histogram"], float((hist - n_hist).norm()))
        assert float((hist - n_hist).norm()) <= s_hist * in_training + 1e-9
        assert torch.equal(full["bounds"], neighbour["bounds"])
        worst["moments"] = max(worst["moments"], float((moments - n_moments).norm()))
        assert float((moments - n_moments).norm()) <= s_moments * in_training + 1e-9
    assert worst["moved"] == 0 and worst["counts"] > 0  # rows did leave the training split
    print(f"neighbour test through the CLI: sensitivity √k = {math.sqrt(k):.3f}, measured {worst}")


def test_the_split_of_the_other_rows_is_stable_for_every_row_removed(tmp_path):
    frame = _file(tmp_path / "d.csv")
    rows = table_rows([frame[c] for c in frame.columns])
    key = split_key(0)
    sides = held_out(rows, key)
    assert 0.1 < sides.mean() < 0.3
    for j in range(len(rows)):
        assert np.array_equal(held_out(rows[:j] + rows[j + 1:], key), np.delete(sides, j))
    assert not np.array_equal(held_out(rows, split_key(1)), sides)  # the key decides it


def test_the_selection_says_what_happened_to_rare_values(tmp_path):
    _file(tmp_path / "d.csv", rows=2000)
    data = preprocess.load(str(tmp_path / "d.csv"), epsilon=3.0, accountant="rdp", seed=0)
    selection = data.releases[0].report()
    # the value and the label one row has are not selected: they are "(other)", and the notes say so
    assert selection["selected"] == {"label": ["no", "yes"], "colour": ["blue", "green", "red"]}
    assert data.classes == ("no", "yes", "(other)") and "colour=(other)" in data.feature_names
    assert any("a row whose label is not among them is trained and tested as the class '(other)'" in note
               for note in data.notes)
    assert any("other values are the category '(other)'" in note for note in data.notes)


@pytest.mark.parametrize("cell, flags, match", [
    ("?", [], r"column 'age' holds numbers except in some rows, e.g. data row 18 .*: '\?'. If that marks a "
              r"missing value, pass --na-values '\?' \(and --drop-rows-with-missing"),
    ("4O", [], r"data row 18 .*: '4O'.*declare it categorical in --schema; otherwise fix the cell"),
    ("?", ["--na-values", "?,NA"], r"column 'age' is missing or infinite in data row 18 .*"
                                  r"or pass --drop-rows-with-missing"),
    ("N/A", [], r"column 'age' is missing or infinite in data row 18"),
])
def test_a_mistyped_numeric_column_is_refused_naming_column_row_and_value(tmp_path, capsys, cell, flags,
                                                                          match):
    frame = _file(tmp_path / "d.csv", rows=60)
    frame["age"] = frame["age"].astype(object)
    frame.loc[17, "age"] = cell
    frame.to_csv(tmp_path / "d.csv", index=False)
    assert main(["train", "--dataset", str(tmp_path / "d.csv"), "--steps", "1", "--quiet", *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(match, err), err


def test_na_values_and_dropping_incomplete_rows_train(tmp_path, monkeypatch):
    frame = _file(tmp_path / "d.csv", rows=400)
    frame["age"] = frame["age"].astype(object)
    frame.loc[[17, 30], "age"] = "?"
    frame.to_csv(tmp_path / "d.csv", index=False)
    full = _releases_of(monkeypatch, tmp_path / "d.csv", "--epsilon", "50", "--na-values", "?",
                        "--drop-rows-with-missing")
    assert len(full["sides"]) == 398  # the two rows with '?' were dropped before the split


def test_an_identifier_column_is_refused(tmp_path, capsys):
    frame = _file(tmp_path / "d.csv", rows=400)
    frame["customer"] = [f"C{i:05d}" for i in range(len(frame))]
    frame.to_csv(tmp_path / "d.csv", index=False)
    for epsilon in ("50", "inf"):  # private selection, and the exact one of a reference run
        code = main(["train", "--dataset", str(tmp_path / "d.csv"), "--steps", "1", "--quiet",
                     "--epsilon", epsilon, "--accountant", "rdp"])
        err = capsys.readouterr().err
        assert code == 2 and "no value of column(s) ['customer'] is shared by enough training rows" in err
        assert "an identifier or free text, not a category — drop it, or declare its categories" in err


def test_a_reference_run_without_noise_and_the_saved_model_predicts_new_rows(tmp_path, capsys):
    _file(tmp_path / "d.csv", rows=600)
    out = tmp_path / "run"
    assert main(["train", "--dataset", str(tmp_path / "d.csv"), "--epsilon", "inf", "--seed", "0",
                 "--steps", "4", "--quiet", "--out", str(out), "--json", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["epsilon"] == "inf" and result["noise_multiplier"] == 0
    assert result["guarantee"].startswith("no privacy: a non-private reference run")
    assert "no privacy" in printed
    assert all(r["noise_multiplier"] == 0 for r in result["preprocessing"])
    # the saved model carries its preprocessing: on the held-out rows it predicts as it was evaluated
    frame = pd.read_csv(tmp_path / "d.csv")
    test = held_out(table_rows([frame[c] for c in frame.columns]), split_key(0))
    held = frame[test].drop(columns=["label"])
    held.to_csv(tmp_path / "new.csv", index=False)
    assert main(["predict", "--run", str(out), "--data", str(tmp_path / "new.csv"),
                 "--output", str(tmp_path / "p.csv")]) == 0
    predicted = pd.read_csv(tmp_path / "p.csv")["prediction"]
    truth = frame["label"][test].where(frame["label"][test].isin(["no", "yes"]), "(other)")
    assert (predicted.to_numpy() == truth.to_numpy()).mean() == pytest.approx(result["test_accuracy"])
    predictor = Predictor.load(out)
    assert predictor.encoder.classes == ("no", "yes") and predictor.encoder.other_class
    assert predictor.predict(held.iloc[:3]) == predicted.tolist()[:3]
