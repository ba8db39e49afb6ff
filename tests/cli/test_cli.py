"""The command line end to end: a short private run on digits, the calculator, every error path."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

import tunefree
from tunefree.cli import main, models, preprocess
from tunefree.cli.report import where_results_went
from tunefree.cli.training import accuracy
from tunefree.data.poisson import planned_steps

REPORT_KEYS = {"test_accuracy", "epsilon", "delta", "noise_multiplier", "steps", "train_seconds",
               "config"}


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    code = main(["train", "--dataset", "digits", "--epsilon", "3", "--epochs", "2", "--seed", "1",
                 "--json", str(out / "result.json"), "--out", str(out / "dir"), "--quiet"])
    return code, out


@pytest.mark.slow
def test_train_writes_result_and_run_directory(short_run):
    code, out = short_run
    assert code == 0
    result = json.loads((out / "result.json").read_text())
    assert set(result) >= REPORT_KEYS
    assert result["config"]["epochs"] == 2 and result["config"]["seed"] == 1
    assert 0 < result["epsilon"] <= 3.0 and 0 <= result["test_accuracy"] <= 1
    n = result["dataset"]["train_examples"]
    assert result["steps"] == 2 * round(n / 256)
    assert result["delta"] == pytest.approx(1 / n ** 1.1)
    run = out / "dir"
    for name in ("metrics.jsonl", "report.json", "model.pt", "model.json", "test_accuracy.png", "epsilon.png",
                 "learning_rate.png"):
        assert (run / name).stat().st_size > 0, name
    assert not (run / "thresholds.png").exists()  # fixed thresholds: nothing to draw
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert len(steps) == result["steps"] and len(epochs) == 2
    assert epochs[-1]["epsilon"] == pytest.approx(result["epsilon"])
    assert json.loads((run / "report.json").read_text())["steps"] == result["steps"]


# What a step, an epoch and the run's first line of metrics.jsonl may hold: public or released values, and
# the test accuracy (held-out rows), which the first line names as outside the guarantee.
RELEASED_STEP_KEYS = {"kind", "epoch", "step", "lr", "thresholds", "loss_bound"}
EPOCH_KEYS = {"kind", "epoch", "step", "epsilon", "test_accuracy"}


@pytest.mark.slow
def test_nothing_computed_from_the_training_rows_without_noise_is_written(short_run):
    _, out = short_run
    records = [json.loads(line) for line in (out / "dir" / "metrics.jsonl").read_text().splitlines()]
    header = records[0]
    assert header["kind"] == "run" and "test_accuracy" in header["outside_the_guarantee"]
    assert all(set(r) <= RELEASED_STEP_KEYS for r in records if r["kind"] == "step")
    assert all(set(r) <= EPOCH_KEYS for r in records if r["kind"] == "epoch")
    result = json.loads((out / "result.json").read_text())
    assert "test_accuracy" in result["outside_the_guarantee"]["keys"]
    assert not {"loss", "train_loss", "train_accuracy", "diagnostics_are_not_private"} & set(result)
    assert result["guarantee"].startswith(f"covers the {result['dataset']['train_examples']} training rows")


@pytest.mark.slow
def test_progress_shows_epsilon_and_a_labelled_test_accuracy_and_says_nothing_was_kept(capsys):
    assert main(["train", "--epochs", "1", "--epsilon", "2"]) == 0
    captured = capsys.readouterr()
    assert "epoch   1/1" in captured.err and "ε" in captured.err and "loss" not in captured.err
    assert "test acc" in captured.err and "(held-out rows, outside the guarantee)" in captured.err
    assert "outside the guarantee" in captured.out.splitlines()[0]
    assert captured.out.splitlines()[-1].startswith("no --out: the model was not saved")


@pytest.mark.slow
def test_epsilon_calculator(capsys):
    assert main(["epsilon", "--noise-multiplier", "1.0", "--sample-rate", "0.01", "--steps",
                 "1000", "--delta", "1e-5"]) == 0
    printed = capsys.readouterr().out
    expected = tunefree.epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=1000, delta=1e-5)
    assert f"epsilon {expected:.6g}" in printed
    assert main(["epsilon", "--target-epsilon", "2", "--sample-rate", "0.01", "--epochs", "10",
                 "--delta", "1e-5", "--accountant", "rdp"]) == 0
    assert "noise multiplier" in capsys.readouterr().out


@pytest.mark.parametrize("argv,match", [
    (["train", "--dataset", "/nonexistent/data.csv"], "not found"),
    (["train", "--dataset", "{tmp}/notes.txt"], "unknown file format"),
    (["train", "--dataset", "{tmp}/t.csv", "--label-column", "y"], "label column 'y' not found"),
    (["train", "--epsilon", "0"], "must be positive"),
    (["train", "--epsilon", "-1"], "must be positive"),
    (["train", "--delta", "2"], r"must be in \(0, 1\)"),
    (["train", "--delta", "0.01", "--epochs", "1"], "1/N"),
    (["train", "--epochs", "0"], "must be positive"),
    (["train", "--steps", "0"], "at least 1"),
    (["train", "--steps", "2", "--epochs", "1"], "not allowed with"),
    (["train", "--lr", "fast", "--epochs", "1"], "expected a number"),
    (["epsilon", "--noise-multiplier", "1", "--sample-rate", "2", "--steps", "3", "--delta",
      "1e-5"], "sample-rate"),
    (["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", str(10 ** 30),
      "--delta", "1e-5"], "too large"),
])
def test_errors_are_one_line_without_traceback(tmp_path, capsys, argv, match):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "t.csv").write_text("a,label\n1,0\n2,1\n3,0\n4,1\n5,0\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as usage_error:  # argparse's own checks
        code = usage_error.code
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(match, err), err


@pytest.mark.slow
def test_console_entry_point_exits_2_on_error():
    proc = subprocess.run([sys.executable, "-m", "tunefree.cli", "train", "--dataset",
                           "/nonexistent.csv"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("tunefree: error: dataset '/nonexistent.csv' not found")


@pytest.mark.slow
def test_debug_shows_the_traceback():
    proc = subprocess.run([sys.executable, "-m", "tunefree.cli", "--debug", "train", "--dataset",
                           "/nonexistent.csv"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


@pytest.mark.slow
def test_adaptive_per_layer_flags(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--groups", "per-layer", "--thresholds", "adaptive",
                 "--target-quantile", "0.6", "--seed", "0", "--quiet", "--out", str(out), "--json",
                 str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["thresholds"] == "adaptive"
    assert result["config"]["target_quantile"] == 0.6
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    layers = set(steps[-1]["thresholds"])
    assert layers == {"1", "3"}  # the two Linear layers of the MLP, by qualified module name
    first, last = steps[0]["thresholds"]["1"], steps[-1]["thresholds"]["1"]
    assert first != last  # thresholds adapt (released by noisy counts), and their plot is drawn
    assert (out / "thresholds.png").stat().st_size > 0


@pytest.mark.slow
def test_the_default_learning_rate_is_automatic_and_the_averaged_model_is_kept(tmp_path):
    """No --lr, no --optimizer: SGD with lr='auto' (its step set from the released gradients, no ε of its
    own); every epoch's test accuracy, and the result's, is of the averaged weights the run keeps."""
    out = tmp_path / "run"
    assert main(["train", "--epochs", "3", "--quiet", "--seed", "0", "--out", str(out),
                 "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["lr"] == "auto" and result["config"]["optimizer"] == "sgd"
    assert 0.99 * 3.0 <= result["epsilon"] <= 3.0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert all(r["lr"] > 0 and "loss_bound" not in r for r in steps) and steps[0]["lr"] != steps[-1]["lr"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert epochs[-1]["test_accuracy"] == result["test_accuracy"] > 0.5
    data = preprocess.load("digits", seed=0)  # the model kept is in the run directory, as evaluated
    model = models.build("auto", data.kind, data.input_shape, data.num_classes)
    model.load_state_dict(torch.load(out / result["model_file"]))
    assert accuracy(model, data.test) == result["test_accuracy"]


@pytest.mark.slow
def test_lr_auto_sets_the_step_of_any_optimizer_offered(tmp_path):
    """--optimizer adamw without --lr: the automatic learning rate, translated to AdamW's (no ε)."""
    assert main(["train", "--epochs", "1", "--optimizer", "adamw", "--quiet", "--seed", "0",
                 "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["lr"] == "auto" and result["learning_rate"].startswith("automatic (adamw")
    assert 0.99 * 3.0 <= result["epsilon"] <= 3.0 and result["test_accuracy"] > 0.3


@pytest.mark.slow
def test_hyfreedp_learning_rate(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--epochs", "2", "--optimizer", "adamw", "--lr", "hyfreedp", "--quiet", "--seed",
                 "0", "--out", str(out), "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["lr"] == "hyfreedp" and result["config"]["optimizer"] == "adamw"
    assert 0.99 * 3.0 <= result["epsilon"] <= 3.0  # every release, loss probes included
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert all("loss_bound" in r and r["lr"] > 0 for r in steps)
    assert steps[0]["lr"] != steps[-1]["lr"]
    assert (out / "learning_rate.png").stat().st_size > 0


@pytest.mark.slow
def test_default_run_is_secure_and_a_seeded_run_says_the_seed_removes_the_noise(short_run, tmp_path, capsys):
    _, out = short_run
    seeded = json.loads((out / "result.json").read_text())
    assert seeded["randomness"].startswith("seeded") and "remove the noise" in seeded["randomness"]
    assert json.loads((out / "dir" / "report.json").read_text())["randomness"] == seeded["randomness"]
    code = main(["train", "--dataset", "digits", "--epsilon", "3", "--epochs", "1",
                 "--json", str(tmp_path / "r.json"), "--quiet"])
    assert code == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["seed"] is None and result["randomness"] == "secure"
    out = capsys.readouterr().out
    assert "randomness: secure" in out and result["delta_choice"] in out
    assert "no --out: the result is in" in out


@pytest.mark.parametrize("args, expected", [
    (["--batch-size", "100000"], "larger than the"),
    (["--target-quantile", "0.7"], "--target-quantile applies only to --thresholds adaptive"),
])
def test_refuses_silently_ignored_arguments(args, expected, capsys):
    code = main(["train", "--dataset", "digits", "--epochs", "1", "--quiet", *args])
    assert code == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_calculator_is_bounded_for_tiny_noise_and_huge_targets(capsys):
    common = ["--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"]
    assert main(["epsilon", "--noise-multiplier", "1e-3", *common]) == 0  # 38 GiB by PLD: RDP here
    assert float(re.search(r"epsilon ([0-9.e+-]+)", capsys.readouterr().out).group(1)) > 1e4
    assert main(["epsilon", "--target-epsilon", "1e6", *common]) == 0
    printed = capsys.readouterr().out
    sigma = float(re.search(r"noise multiplier ([0-9.e+-]+)", printed).group(1))
    spent = tunefree.epsilon(noise_multiplier=sigma, sample_rate=0.01, steps=100, delta=1e-5)
    assert sigma == 0.3 and spent <= 1e6
    assert "note: the target ε = 1e+06 is looser than any useful noise" in printed
    assert f"spends ε = {spent:.4g} < 1e+06" in printed


@pytest.mark.parametrize("length, planned", [(["--epochs", "1.5"], 5), (["--steps", "4"], 4)])
@pytest.mark.slow
def test_training_runs_exactly_the_planned_steps(tmp_path, length, planned):
    # 431 of the 1,437 digits training examples: q ≈ 0.3, round(1/q) = 3 steps per epoch, so 1.5 epochs
    # plan ⌈4.5⌉ = 5 steps, in make_private's calibration and in the loop alike.
    out = tmp_path / "run"
    assert main(["train", "--batch-size", "431", *length, "--quiet", "--out", str(out),
                 "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    epochs = 1.5 if length[0] == "--epochs" else None
    steps = None if epochs else 4
    assert planned_steps(epochs, steps, result["sample_rate"]) == planned
    assert result["planned_steps"] == result["steps"] == planned  # the ledger's count of releases
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, planned + 1))
    epoch_ends = [r["step"] for r in records if r["kind"] == "epoch"]
    assert epoch_ends == [3, planned]  # one full epoch of 3 steps, then the partial last one
    assert result["epsilon"] <= 3.0


@pytest.mark.slow
def test_a_target_looser_than_any_useful_noise_ends_and_says_so(tmp_path, capsys):
    assert main(["train", "--epsilon", "1e6", "--steps", "3", "--quiet",
                 "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["noise_multiplier"] == 0.3 and result["steps"] == 3
    assert 0 < result["epsilon"] < 1e6
    out = capsys.readouterr().out
    assert "note: the target ε = 1e+06 is looser than any useful noise" in out
    assert f"spends ε = {result['epsilon']:.4g} < 1e+06" in out
    assert result["note"] in out


@pytest.mark.slow
def test_a_reachable_target_gets_no_note(short_run):
    _, out = short_run
    assert json.loads((out / "result.json").read_text())["note"] is None


def _idx(path, array):
    array = np.asarray(array, dtype=np.uint8)
    path.write_bytes(bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
                     + array.tobytes())


def _write_bad_data(directory, case):
    """Local data with one defect; returns the --dataset argument."""
    if case == "empty label cell":
        (directory / "t.csv").write_text("a,label\n" + "".join(
            f"{i},{'' if i == 5 else i % 2}\n" for i in range(20)))
        return str(directory / "t.csv")
    if case == "empty test split":  # one row: whatever the key, one of the two splits is empty
        (directory / "t.csv").write_text("a,label\n1,0\n")
        return str(directory / "t.csv")
    if case == "unseen test labels":
        _idx(directory / "train-images-idx3-ubyte", np.zeros((6, 4, 4)))
        _idx(directory / "train-labels-idx1-ubyte", np.arange(6) % 2)
        _idx(directory / "t10k-images-idx3-ubyte", np.zeros((2, 4, 4)))
        _idx(directory / "t10k-labels-idx1-ubyte", [1, 5])
        return str(directory)
    claim = b"\x80\x04}C\x04data\x8e" + struct.pack("<Q", 10 ** 12) + b"abcs."  # 10¹² bytes claimed
    for name in ("data_batch_1", "test_batch"):
        (directory / name).write_bytes(claim)
    return str(directory)


@pytest.mark.parametrize("case, match", [
    ("empty label cell", r"t.csv: column 'label' is empty in data row\(s\) \[6\]"),
    ("empty test split", "the 80/20 split of its 1 rows put none in the (test|training) split: add rows"),
    ("unseen test labels", r"labels \['5'\] are not among the declared classes"),
    ("huge pickle", "expected 1000000000000 bytes in a bytes8, but only 5 remain"),
])
def test_bad_data_is_one_line_error(tmp_path, capsys, case, match):
    dataset = _write_bad_data(tmp_path, case)
    labels = ["--labels", "0,1"] if case == "unseen test labels" else []
    assert main(["train", "--dataset", dataset, "--steps", "1", "--quiet", *labels]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("tunefree: error: "), err
    assert re.search(match, err), err


@pytest.mark.slow
def test_audit_canaries_report_a_lower_bound_below_the_runs_epsilon(tmp_path, capsys):
    # seeded: the verdict is a 95%-confidence test, so a secure (unseeded) run fails it now and then
    code = main(["train", "--dataset", "digits", "--epsilon", "8", "--steps", "20", "--batch-size", "512",
                 "--seed", "0", "--audit-canaries", "400", "--json", str(tmp_path / "r.json"), "--quiet"])
    assert code == 0
    result = json.loads((tmp_path / "r.json").read_text())
    audit = result["audit"]
    assert audit["canaries"] == 400 and audit["confidence"] == 0.95
    assert 0 < audit["epsilon_lower_bound"] <= result["epsilon"] and audit["verdict"] == "consistent"
    assert result["epsilon"] <= 8  # the canaries cost no ε: the run spends its target as without them
    assert "audit: ε_LB" in capsys.readouterr().out


@pytest.mark.slow
def test_a_run_without_canaries_reports_no_audit(short_run):
    _, out = short_run
    assert json.loads((out / "result.json").read_text())["audit"] is None


# ---------------------------------------------------------------------------- tunefree predict
@pytest.mark.slow
def test_predict_serves_an_image_model_as_it_was_evaluated(short_run, tmp_path, capsys):
    """`make run` trains digits into runs/digits and advertises `tunefree predict --run runs/digits`."""
    from tunefree.cli.predict import ImagePredictor, load

    _, out = short_run
    result = json.loads((out / "result.json").read_text())
    assert f"tunefree predict --run {out / 'dir'} --data IMAGES" in where_results_went(
        out / "dir", None, kind=result["dataset"]["kind"])
    assert main(["predict", "--run", str(out / "dir"), "--data", "digits", "--output",
                 str(tmp_path / "p.csv")]) == 0
    predicted = pd.read_csv(tmp_path / "p.csv", dtype=str)
    assert len(predicted) == 1797 and set(predicted["prediction"]) <= set(result["dataset"]["classes"])
    predictor = load(out / "dir")
    assert isinstance(predictor, ImagePredictor)
    data = preprocess.load("digits", seed=1)  # the run's split: its test rows, predicted as evaluated
    x, y = data.test.tensors
    classes = result["dataset"]["classes"]
    hits = np.mean([p == classes[int(t)] for p, t in zip(predictor.predict(x.numpy()), y)])
    assert hits == pytest.approx(result["test_accuracy"])


@pytest.mark.slow
def test_predict_reads_image_arrays_and_folders_by_their_storage_type(short_run, tmp_path):
    from PIL import Image

    from tunefree.cli.predict import load

    _, out = short_run
    images = (np.random.default_rng(0).random((5, 8, 8)) * 255).astype(np.uint8)
    np.save(tmp_path / "x.npy", images)
    (tmp_path / "folder").mkdir()
    for i, image in enumerate(images):
        Image.fromarray(image).save(tmp_path / "folder" / f"{i}.png")
    predictor = load(out / "dir")
    names, from_array = predictor.read(str(tmp_path / "x.npy"))
    _, from_folder = predictor.read(str(tmp_path / "folder"))
    np.testing.assert_array_equal(from_array, images[:, None] / 255.0)  # uint8: /255, as in training
    np.testing.assert_array_equal(from_folder, from_array)
    np.save(tmp_path / "big.npy", np.zeros((2, 9, 9), np.uint8))
    np.save(tmp_path / "ints.npy", np.zeros((2, 8, 8), np.int64))
    for data, match in (("big.npy", r"the images are \[1, 9, 9\].*the model takes \[1, 8, 8\]"),
                        ("ints.npy", "pixels stored as int64 have no public range")):
        with pytest.raises(ValueError, match=match):
            predictor.predict(predictor.read(str(tmp_path / data))[1], data)


def test_predict_refuses_an_unfinished_text_run_and_a_directory_without_a_model(tmp_path, capsys):
    (tmp_path / "text" / "model").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    for run, match in (("text", "holds a model/ folder without tunefree_text.json"),
                       ("empty", "holds no model.json .table and image runs. and no model/")):
        assert main(["predict", "--run", str(tmp_path / run), "--data", "x.csv"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and re.search(match, err), err


@pytest.fixture(scope="module")
def table_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("table")
    rng = np.random.default_rng(0)
    rows = 600
    frame = pd.DataFrame({"age": rng.integers(18, 90, rows), "colour": rng.choice(["red", "blue"], rows),
                          "label": rng.choice(["no", "yes"], rows)})
    frame.to_csv(folder / "t.csv", index=False)
    assert main(["train", "--dataset", str(folder / "t.csv"), "--epsilon", "inf", "--steps", "2",
                 "--quiet", "--seed", "0", "--out", str(folder / "run")]) == 0
    return folder


@pytest.mark.slow
def test_predict_counts_unseen_categories_and_suggests_only_its_own_flags(table_run, tmp_path, capsys):
    capsys.readouterr()
    new = pd.DataFrame({"age": [30, 40, 50, 60], "colour": ["red", "green", "violet", "blue"]})
    new.to_csv(tmp_path / "new.csv", index=False)
    assert main(["predict", "--run", str(table_run / "run"), "--data", str(tmp_path / "new.csv"),
                 "--output", str(tmp_path / "p.csv")]) == 0
    assert ("note: column 'colour': 2 of 4 rows hold values the training rows' private selection did not "
            "keep; they are encoded as '(other)'") in capsys.readouterr().err
    options = {o for action in predict_parser()._actions for o in action.option_strings}
    bad = {"missing": pd.DataFrame({"age": [30, None], "colour": ["red", "blue"]}),
           "text": pd.DataFrame({"age": ["30", "?"], "colour": ["red", "blue"]}),
           "absent": pd.DataFrame({"colour": ["red", "blue"]})}
    for name, frame in bad.items():
        frame.to_csv(tmp_path / f"{name}.csv", index=False)
        data = str(tmp_path / f"{name}.csv")
        assert main(["predict", "--run", str(table_run / "run"), "--data", data]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        suggested = set(re.findall(r"--[a-z][a-z-]+", err))
        assert suggested <= options, (name, err)
        if name == "text":
            assert "pass --na-values '?' if it marks a missing value" in err


def predict_parser():
    import argparse

    from tunefree.cli import predict

    return predict.add_parser(argparse.ArgumentParser().add_subparsers())


# ---------------------------------------------------------------------------- the majority rate, one class
def test_majority_class_rate_against_a_count():
    from tunefree.cli.report import majority_class_rate

    labels = torch.tensor([2, 0, 2, 1, 2, 0])
    assert majority_class_rate(labels, ["a", "b", "c"]) == {"class": "c", "rate": 0.5, "rows": 6}
    assert majority_class_rate([1, 0], ["a", "b"])["class"] == "a"  # a tie: the first class
    with pytest.raises(ValueError, match="at least one"):
        majority_class_rate([], ["a"])


@pytest.mark.slow
def test_every_run_shows_the_majority_rate_in_its_output_report_and_plot(short_run):
    from tunefree.cli.report import majority_class_rate, test_accuracy_figure

    _, out = short_run
    result = json.loads((out / "result.json").read_text())
    data = preprocess.load("digits", seed=1)
    assert result["test_majority_class"] == majority_class_rate(data.test.tensors[1], data.classes)
    assert "test_majority_class" in result["outside_the_guarantee"]["keys"]
    records = [json.loads(line) for line in (out / "dir" / "metrics.jsonl").read_text().splitlines()]
    baseline = [r for r in records if r["kind"] == "baseline"]
    majority = result["test_majority_class"]
    assert baseline == [{"kind": "baseline", "name": f"majority class {majority['class']!r}",
                         "test_accuracy": majority["rate"]}]
    figure = test_accuracy_figure(records)
    assert [line.get_ydata()[0] for line in figure.axes[0].lines[1:]] == [baseline[0]["test_accuracy"]]


@pytest.mark.slow
def test_a_reference_run_without_noise_is_shown_beside(table_run, tmp_path, capsys):
    capsys.readouterr()
    assert main(["train", "--dataset", str(table_run / "t.csv"), "--steps", "2", "--quiet", "--seed", "0",
                 "--reference", "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    printed = capsys.readouterr().out.splitlines()[0]
    majority = result["test_majority_class"]
    assert printed.startswith(f"test accuracy {result['test_accuracy']:.4f} on {majority['rows']} held-out "
                              f"rows; always predicting the majority class {majority['class']!r} scores "
                              f"{majority['rate']:.4f}; the same run without noise (--reference) "
                              f"{result['reference_test_accuracy']:.4f} (outside the guarantee")
    assert 0 <= result["reference_test_accuracy"] <= 1 and result["epsilon"] <= 3.0


@pytest.mark.parametrize("labels", [["--labels", "no,yes"], []])
def test_one_class_training_rows_are_refused_with_the_true_reason(tmp_path, capsys, labels):
    rng = np.random.default_rng(0)
    pd.DataFrame({"age": rng.integers(18, 90, 300), "label": "yes"}).to_csv(tmp_path / "t.csv", index=False)
    assert main(["train", "--dataset", str(tmp_path / "t.csv"), "--steps", "1", "--quiet", *labels]) == 2
    err = capsys.readouterr().err
    among = " of the declared ['no', 'yes']" if labels else ""
    assert err.strip() == (f"tunefree: error: t.csv: every training row has the label 'yes'{among}: a "
                           "classifier needs training rows of at least two classes — add rows of the other "
                           "classes")


@pytest.mark.slow
def test_small_epsilon_calibrates_in_the_calculator_and_in_training(tmp_path, capsys):
    """Issue 30's examples: PLD did not converge at ε = 0.1 (q = 0.01, 1,000 steps), nor training at
    ε ≤ 0.15."""
    assert main(["epsilon", "--target-epsilon", "0.1", "--sample-rate", "0.01", "--steps", "1000",
                 "--delta", "1e-5"]) == 0
    sigma = float(re.search(r"noise multiplier ([0-9.e+-]+)", capsys.readouterr().out).group(1))
    spent = tunefree.epsilon(noise_multiplier=sigma, sample_rate=0.01, steps=1000, delta=1e-5)
    assert 0.099 <= spent <= 0.1
    assert main(["train", "--epsilon", "0.1", "--steps", "3", "--quiet",
                 "--json", str(tmp_path / "r.json")]) == 0
    assert 0.099 <= json.loads((tmp_path / "r.json").read_text())["epsilon"] <= 0.1
