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
from tunefree.cli.predict import TablePredictor, load
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
        seen.setdefault("selections", []).append([dict(h) for h in histograms])
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
    # two selections: the labels, then the colour (one histogram each: each row adds one count to each)
    assert [[set(c) for c in selection] for selection in full["selections"]] == [
        [{"maybe", "no", "yes"}], [{"blue", "green", "red", "violet"}]]
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
        # each partition selection: counts move by at most 1 in each histogram, √k in its k histograms
        for selection, other in zip(full["selections"], neighbour["selections"], strict=True):
            change = math.sqrt(sum(_distance(a, b) ** 2 for a, b in zip(selection, other, strict=True)))
            worst["counts"] = max(worst["counts"], change)
            assert change <= math.sqrt(len(selection)) * in_training + 1e-12
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
    print(f"neighbour test through the CLI: measured {worst}")


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
    labels, categories = (release.report() for release in data.releases[:2])
    # the value and the label one row has are not selected: they are "(other)", and the notes say so
    assert labels["selected"] == {"label": ["no", "yes"]}
    assert categories["selected"] == {"colour": ["blue", "green", "red"]}
    # the merged rows are reported, from the noisy counts of the values kept and the public N
    assert set(labels["noisy_counts"]["label"]) == {"no", "yes"} and labels["other_rows"]["label"] >= 0
    assert labels["other_rows"]["label"] == max(0, round(data.num_train - sum(
        labels["noisy_counts"]["label"].values())))
    assert data.classes == ("no", "yes", "(other)") and "colour=(other)" in data.feature_names
    assert any("are merged into the class '(other)'" in note for note in data.notes)
    assert any("the other values are the category '(other)'" in note for note in data.notes)


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
    # Seeded: each of the 320 distinct values is kept with probability p/k (p = 5% of δ, k = 2 columns), so a
    # secret draw keeps one about 1 run in 70 at ε = 50 (as the selection's guarantee allows) and trains.
    for epsilon in ("50", "inf"):  # private selection, and the exact one of a reference run
        code = main(["train", "--dataset", str(tmp_path / "d.csv"), "--steps", "1", "--quiet", "--seed", "0",
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
    assert "no privacy" in printed and result["note"] is None
    assert "calibration stops" not in printed and "< inf" not in printed  # nothing untrue about noise
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
    predictor = load(out)
    assert isinstance(predictor, TablePredictor)
    assert predictor.encoder.classes == ("no", "yes") and predictor.encoder.other_class
    assert predictor.predict(held.iloc[:3]) == predicted.tolist()[:3]


# ---------------------------------------------------------------------------- no branch on a private row
class _Decisions:
    """What `tunefree train` decides before training, with every release replaced by a constant (so that
    what follows a release is the same in every neighbour): the public arguments of each release, the
    keywords make_private gets, the model's parameter shapes and each training example's features. Two
    neighbouring data sets must give the same decisions, and the same features for every row they share."""

    def __init__(self, monkeypatch):
        self.calls, self.selections = [], 0
        monkeypatch.setattr(releases, "select_partitions", self.select)
        monkeypatch.setattr(scaling, "release_gaussian", self.gaussian)
        monkeypatch.setattr(training_module, "make_private", self.stop)

    def select(self, histograms, sigma, threshold_delta, randomness):
        self.calls.append(("selection", len(histograms), sigma, threshold_delta))
        self.selections += 1
        constant = {1: ["no", "yes"], 2: ["blue", "green", "red"], 3: ["False", "True"]}
        kept = [{key: 100.0 for key in constant[min(self.selections + i, 3)]} for i in range(len(histograms))]
        return kept, 42.0, REAL_THRESHOLD(sigma, threshold_delta)

    def gaussian(self, values, sensitivity, sigma, randomness):
        self.calls.append(("gaussian", tuple(values.shape), sensitivity, sigma))
        return torch.full(values.shape, 100.0, dtype=torch.float64), REAL_GAUSSIAN_EVENT(sigma)

    def stop(self, model, optimizer, loader, **keywords):
        self.keywords = keywords
        self.shapes = [tuple(p.shape) for p in model.parameters()]
        self.x, self.y = loader.dataset.tensors
        raise _Stop

    def of(self, path, *flags) -> _Decisions:
        self.calls, self.selections = [], 0
        with pytest.raises(_Stop):
            main(["train", "--dataset", str(path), "--seed", "0", "--steps", "1", "--batch-size", "8",
                  "--quiet", "--epsilon", "3", *flags])
        return self

    def summary(self) -> tuple:
        return (list(self.calls), repr(self.keywords), list(self.shapes))


def REAL_THRESHOLD(sigma, threshold_delta):  # noqa: N802 - the real event of a selection
    from tunefree.privacy import threshold_event

    return threshold_event(sigma, threshold_delta)


def REAL_GAUSSIAN_EVENT(sigma):  # noqa: N802
    import dp_accounting as dpa

    return dpa.GaussianDpEvent(sigma)


def _same_side_replacement(frame, row: int, changes: dict):
    """``frame`` with ``changes`` made to ``row``, and a numeric cell of that row tweaked if needed so that
    it stays on its side of the keyed split: the training set keeps its size N (public) and its order."""
    key = split_key(0)
    side = held_out(table_rows([frame.loc[[row], c] for c in frame.columns]), key)[0]
    for salt in range(200):
        changed = frame.copy().astype(object)
        for column, value in changes.items():
            changed.loc[row, column] = value
        if salt:  # a cell the change leaves alone
            column = "income" if "income" not in changes else "age"
            changed.loc[row, column] = 18 + salt
        if held_out(table_rows([changed.loc[[row], c] for c in changed.columns]), key)[0] == side:
            return changed, side
    raise AssertionError("no salt keeps the row on its side")


NEIGHBOURS = {  # one row changed in ways that must decide nothing without a release
    "an outlier": {"income": 1e12},
    "a new category": {"colour": "violet"},
    "a bool column's cell that is text": {"member": "maybe"},
    "a new label": {"label": "maybe"},
    "a negative number": {"age": -5},
}


@pytest.mark.parametrize("change", list(NEIGHBOURS))
def test_no_table_preprocessing_decision_branches_on_one_row(tmp_path, monkeypatch, change):
    rng = np.random.default_rng(1)
    frame = _file(tmp_path / "d.csv", rows=400)
    frame["member"] = rng.choice([True, False], len(frame))
    frame.to_csv(tmp_path / "d.csv", index=False)
    decisions = _Decisions(monkeypatch)
    full = decisions.of(tmp_path / "d.csv")
    summary, x, y = full.summary(), full.x.clone(), full.y.clone()
    train = ~held_out(table_rows([frame[c] for c in frame.columns]), split_key(0))
    for row in (3, 150, 333):
        neighbour, test_side = _same_side_replacement(frame, row, NEIGHBOURS[change])
        neighbour.to_csv(tmp_path / "n.csv", index=False)
        other = decisions.of(tmp_path / "n.csv")
        assert other.summary() == summary, change
        position = int(train[:row].sum())  # the row's place among the training rows
        keep = torch.ones(len(x), dtype=torch.bool)
        if not test_side:
            keep[position] = False
        shared = [i for i in range(len(x)) if keep[i]]
        assert torch.equal(other.x[shared], x[shared]) and torch.equal(other.y[shared], y[shared])


@pytest.mark.parametrize("dtype, change", [("uint8", 255), ("float32", 5.0)])
def test_no_image_preprocessing_decision_branches_on_one_image(tmp_path, monkeypatch, dtype, change):
    """Binary uint8 images (0/1) with one 255, or float images in [0, 1] with one pixel of 5: every other
    image is scaled as before (by the storage type's range, never by the data's maximum)."""
    import datasets as hf

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 2, (8, 8)).astype(dtype) for _ in range(60)]
    labels = [i % 2 for i in range(60)]

    def save(images, name):
        split = hf.Dataset.from_dict({"image": images, "label": labels})
        hf.DatasetDict({"train": split, "test": split.select(range(10))}).save_to_disk(tmp_path / name)
        return tmp_path / name

    decisions = _Decisions(monkeypatch)
    full = decisions.of(save(images, "full"), "--labels", "0,1")
    summary, x = full.summary(), full.x.clone()
    changed = [image.copy() for image in images]
    changed[7][3, 3] = change
    other = decisions.of(save(changed, "neighbour"), "--labels", "0,1")
    assert other.summary() == summary
    rest = [i for i in range(60) if i != 7]
    assert torch.equal(other.x[rest], x[rest])
    scale = 255.0 if dtype == "uint8" else 1.0
    assert torch.equal(x[0], torch.as_tensor(images[0][None] / scale, dtype=torch.float32))
