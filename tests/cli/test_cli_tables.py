"""`tunefree train` on real tables: the accounted private standardisation, the schema, the papers' knobs
on the command line, --hidden, progress lines in logs, the plots and the statement of δ."""

from __future__ import annotations

import io
import json
import math
import re

import dp_accounting as dpa
import numpy as np
import pandas as pd
import pytest
import torch

from tunefree import PSAC, AdaptiveQuantile, AutoS, DoG, HyFreeDP
from tunefree.cli import main, models, report, scaling
from tunefree.cli import training as training_module
from tunefree.cli.releases import CATEGORY_SHARE, LABEL_SHARE, Budget
from tunefree.cli.training import Progress
from tunefree.components.dog import INPUT_RMS_REFERENCE
from tunefree.privacy import threshold_event
from tunefree.privacy.accounting import epsilon_of, planned_event


class ConstantNoise:
    """A stand-in for the run's randomness whose every normal draw is 1: the noise added is its scale."""

    def normal(self, shape, device, dtype):
        return torch.ones(shape, device=device, dtype=dtype)


def _exact_standardisation(x: torch.Tensor):
    """The scaling the mechanism estimates, computed without noise: B = 2^⌈log₂ max|x|⌉ per column."""
    bound = 2.0 ** torch.ceil(torch.log2(x.abs().max(0).values))
    u = x / bound
    return bound, u.mean(0), u.std(0, unbiased=False)


def test_standardisation_with_vanishing_noise_is_the_exact_one():
    torch.manual_seed(0)
    x = torch.stack([torch.randn(400) * 300 + 50, torch.rand(400) * 0.01, torch.randn(400)], 1).double()
    released = scaling.release(x, [0, 1, 2], 1e-9, scaling.secret_randomness(3))
    bound, mean, std = _exact_standardisation(x)
    assert torch.equal(released.bound, bound)
    torch.testing.assert_close(released.mean, mean, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(released.std, std, rtol=1e-6, atol=1e-9)
    z = released.apply(x)
    torch.testing.assert_close(z.mean(0), torch.zeros(3, dtype=z.dtype), atol=1e-6, rtol=0)
    torch.testing.assert_close(z.std(0, unbiased=False), torch.ones(3, dtype=z.dtype), atol=1e-6, rtol=0)


def test_standardisation_noise_is_calibrated_to_each_release_sensitivity():
    # Histogram: one example moves one count in each of d columns (L2 √d); moments: (u, u²) per column,
    # each in [-1, 1] (L2 √(2d)). With every normal draw 1, the noise added is exactly σ√d and σ√(2d).
    x = torch.tensor([[3.0, -0.25], [1.5, 0.5], [-2.0, 0.125], [0.75, -0.5]] * 25, dtype=torch.float64)
    sigma, d, n = 0.5, 2, 100
    released = scaling.release(x, [0, 1], sigma, ConstantNoise())
    assert released.bound.tolist() == [4.0, 0.5]  # the empty bins' noise (σ√d) stays below 4σ√d
    u = torch.clamp(x / released.bound, -1, 1)
    mean = u.mean(0) + sigma * math.sqrt(2 * d) / n
    second = (u * u).mean(0) + sigma * math.sqrt(2 * d) / n
    torch.testing.assert_close(released.mean, mean)
    torch.testing.assert_close(released.std, (second - mean ** 2).sqrt())
    assert released.events() == [dpa.GaussianDpEvent(sigma)] * 2


class NegativeNoise:
    """Every normal draw is −1: the released second moment comes out below the first one squared."""

    def normal(self, shape, device, dtype):
        return -torch.ones(shape, device=device, dtype=dtype)


def test_a_spread_hidden_by_the_noise_is_never_divided_by_a_noisy_number_near_zero():
    """A column far from zero with a small spread (u ≈ 0.5 ± 0.02): at this noise the released variance
    is negative. The divisor is the variance's noise floor, so the standardised column stays within
    2/√floor instead of growing to hundreds."""
    g = torch.Generator().manual_seed(0)
    x = torch.stack([4.0 + 0.15 * torch.randn(2000, generator=g, dtype=torch.float64),
                     torch.randn(2000, generator=g, dtype=torch.float64)], 1)
    sigma, d, n = 30.0, 2, 2000
    released = scaling.release(x, [0, 1], sigma, NegativeNoise())
    u = torch.clamp(x / released.bound, -1, 1)
    raw_variance = (u * u).mean(0) - sigma * math.sqrt(2 * d) / n - released.mean ** 2
    assert raw_variance[0] < 0  # what the old divisor (1e-3) turned into |z| of hundreds
    floor = scaling.variance_noise_floor(released.mean, sigma, d, n)
    torch.testing.assert_close(released.std ** 2, torch.maximum(raw_variance, floor))
    assert released.apply(x)[:, 0].abs().max() <= 2 / floor[0].sqrt()
    assert released.std[1] ** 2 == raw_variance[1] > floor[1]  # a resolved spread is used as released


def test_standardisation_budget_is_its_share_of_mu_squared():
    budget = Budget(3.0, 1e-5, "pld")
    sigma = scaling.noise_for_share(budget)
    assert 2 / sigma ** 2 == pytest.approx(scaling.SHARE * budget.mu ** 2)  # two releases, μ² adding up
    # alone, the two releases are a Gaussian of μ = √SHARE·μ of the budget: well below ε
    spent = epsilon_of(dpa.ComposedDpEvent([dpa.GaussianDpEvent(sigma)] * 2), 1e-5)
    assert spent == pytest.approx(epsilon_of(dpa.GaussianDpEvent(1 / (scaling.SHARE ** 0.5 * budget.mu)),
                                             1e-5), rel=1e-3)
    assert spent < 3.0 * scaling.SHARE ** 0.5


def test_a_table_too_small_to_standardise_privately_is_refused_before_any_release():
    sigma = scaling.noise_for_share(Budget(3.0, 1e-3, "rdp"))
    needed = scaling.minimum_rows(2, sigma)
    assert needed == math.ceil(16 * sigma * math.sqrt(2))
    scaling.check_enough_rows(needed, 2, sigma, 3.0)
    with pytest.raises(ValueError, match=r"too few to standardise 2 numeric column\(s\).*--schema"):
        scaling.check_enough_rows(needed - 1, 2, sigma, 3.0)


def test_a_small_table_with_many_columns_pays_a_larger_share_rather_than_be_refused():
    """Where SHARE leaves too few rows for d columns, the standardisation takes the least share, up to
    SHARE_CAP, with which the rows suffice; beyond the cap the table is refused as before."""
    budget = Budget(3.0, 1e-3, "rdp")
    columns = 30
    enough = scaling.minimum_rows(columns, scaling.noise_for_share(budget))
    assert scaling.share_for_table(budget, enough, columns) == scaling.SHARE  # enough rows: as before
    at_cap = scaling.minimum_rows(columns, scaling.noise_for_share(budget, scaling.SHARE_CAP))
    for rows in (enough - 1, (enough + at_cap) // 2, at_cap):
        share = scaling.share_for_table(budget, rows, columns)
        sigma = scaling.noise_for_share(budget, share)
        scaling.check_enough_rows(rows, columns, sigma, 3.0)  # not refused
        assert scaling.minimum_rows(columns, sigma) == rows  # the least share that suffices
        assert scaling.SHARE < share <= scaling.SHARE_CAP
    assert scaling.share_for_table(budget, at_cap - 1, columns) == scaling.SHARE_CAP
    assert scaling.share_for_table(budget, 0, columns) == scaling.SHARE_CAP  # refused next, not a crash
    sigma = scaling.noise_for_share(budget, scaling.SHARE_CAP)
    with pytest.raises(ValueError, match=r"too few to standardise 30 numeric column\(s\).*40% of the budget"):
        scaling.check_enough_rows(at_cap - 1, columns, sigma, 3.0)


@pytest.mark.slow
def test_a_small_wide_table_trains_and_its_larger_share_is_in_the_ledger(tmp_path):
    """A table like scikit-learn's breast cancer data (about 450 training rows, 30 numeric columns) was
    refused at SHARE; it now trains, the standardisation's share as reported, and the run spends the
    target ε with the releases in its ledger."""
    rng = np.random.default_rng(0)
    rows = 560
    x = rng.lognormal(2, 1, (rows, 30))
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(30)])
    frame["label"] = (x[:, 0] > np.median(x[:, 0])).astype(int)
    frame.to_csv(tmp_path / "wide.csv", index=False)
    code, result = _run(tmp_path, "--dataset", str(tmp_path / "wide.csv"), "--labels", "0,1")
    assert code == 0
    (standardisation,) = result["preprocessing"]
    assert scaling.SHARE < standardisation["share"] <= scaling.SHARE_CAP
    budget = Budget(3.0, result["delta"], "rdp")
    share = scaling.share_for_table(budget, result["dataset"]["train_examples"], 30)
    assert standardisation["share"] == share
    assert standardisation["noise_multiplier"] == scaling.noise_for_share(budget, share)
    assert 0.99 * 3.0 <= result["epsilon"] <= 3.0


def _table(path, rows=1200, seed=0):
    rng = np.random.default_rng(seed)
    age = rng.integers(18, 90, rows)
    colour = rng.choice(["red", "green", "blue"], rows)
    income = rng.lognormal(10, 1, rows)
    label = ((age > 50) ^ (colour == "red")).astype(int)
    pd.DataFrame({"age": age, "colour": colour, "income": income, "label": label}).to_csv(path, index=False)
    return path


def _run(tmp_path, *args):
    code = main(["train", "--steps", "3", "--batch-size", "200", "--quiet", "--seed", "0",
                 "--accountant", "rdp", "--json", str(tmp_path / "r.json"), *args])
    return code, (json.loads((tmp_path / "r.json").read_text()) if code == 0 else None)


@pytest.mark.slow
def test_a_table_with_categories_trains_and_every_release_is_in_the_ledger(tmp_path, capsys):
    code, result = _run(tmp_path, "--dataset", str(_table(tmp_path / "t.csv")))
    assert code == 0
    out = capsys.readouterr().out
    assert "the category sets of columns ['colour'] were selected privately" in out
    assert "the classes ['0', '1'] were selected privately from the training rows' labels" in out
    assert "numeric columns ['age', 'income'] were standardised by a private estimate" in out
    labels, categories, standardisation = result["preprocessing"]
    assert labels["release"] == "class labels" and labels["columns"] == ["label"]
    assert labels["selected"] == {"label": ["0", "1"]} and labels["share"] == LABEL_SHARE
    assert categories["release"] == "category sets" and categories["columns"] == ["colour"]
    assert categories["selected"] == {"colour": ["blue", "green", "red"]}
    assert categories["share"] == CATEGORY_SHARE
    assert standardisation["columns"] == ["age", "income"] and standardisation["share"] == scaling.SHARE
    assert result["dataset"]["classes"] == ["0", "1", "(other)"]
    # the automatic rate's budget saw the features' public scale: 3 columns over 2 + 3 + 1 ("other") features
    rms = math.sqrt(3 / (2 + len(categories["selected"]["colour"]) + 1))
    assert f"noise budget × {INPUT_RMS_REFERENCE / rms:.3g} for the features'" in result["learning_rate"]
    # The reported ε is the ledger's: the 3 training steps composed with every preprocessing release.
    delta, q = result["delta"], result["sample_rate"]
    training = planned_event(result["noise_multiplier"], q, 3)
    releases = [*(threshold_event(r["noise_multiplier"], r["threshold_delta"]) for r in (labels, categories)),
                *[dpa.GaussianDpEvent(standardisation["noise_multiplier"])] * 2]
    expected = epsilon_of(dpa.ComposedDpEvent([training, *releases]), delta, "rdp")
    assert result["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert result["epsilon"] > epsilon_of(training, delta, "rdp")
    # the training noise is calibrated on that composition: the whole run spends the target, not less
    assert 0.99 * 3.0 <= result["epsilon"] <= 3.0
    assert 0 < result["preprocessing_epsilon"] == pytest.approx(
        epsilon_of(dpa.ComposedDpEvent(releases), delta, "rdp"), rel=1e-9)


@pytest.mark.slow
def test_the_run_spends_the_target_with_components_that_split_the_budget_too(tmp_path):
    """HyFreeDP's loss releases and adaptive thresholds' counts are solved on the same ledger as the
    preprocessing releases: the whole run still spends the target ε."""
    code, result = _run(tmp_path, "--dataset", str(_table(tmp_path / "t.csv")), "--lr", "hyfreedp",
                        "--thresholds", "adaptive", "--epsilon", "4")
    assert code == 0 and len(result["preprocessing"]) == 3
    assert 0.99 * 4.0 <= result["epsilon"] <= 4.0


@pytest.mark.slow
def test_a_public_schema_spends_nothing_on_the_encoding(tmp_path, capsys):
    (tmp_path / "schema.json").write_text(json.dumps({
        "categorical": {"colour": ["red", "green", "blue", "violet"]},
        "numeric": {"age": [0, 120], "income": [0, 1e7]}}))
    code, result = _run(tmp_path, "--dataset", str(_table(tmp_path / "t.csv")),
                        "--schema", str(tmp_path / "schema.json"), "--labels", "0,1")
    assert code == 0 and result["preprocessing"] == [] and result["data_notes"] == []
    assert result["preprocessing_epsilon"] == 0.0 and result["dataset"]["classes"] == ["0", "1"]
    assert "note:" not in capsys.readouterr().out
    # the whole budget goes to training: ε is that of the training steps alone
    training = planned_event(result["noise_multiplier"], result["sample_rate"], 3)
    assert result["epsilon"] == pytest.approx(epsilon_of(training, result["delta"], "rdp"), rel=1e-9)


@pytest.mark.slow
def test_numeric_scaling_none_feeds_the_columns_raw_and_hidden_sizes_the_mlp(tmp_path, capsys):
    code, result = _run(tmp_path, "--dataset", str(_table(tmp_path / "t.csv")), "--numeric-scaling", "none",
                        "--hidden", "16,8")
    assert code == 0 and [r["release"] for r in result["preprocessing"]] == ["class labels", "category sets"]
    assert result["config"]["hidden"] == [16, 8]
    assert "numeric columns ['age', 'income'] reach the model unscaled" in capsys.readouterr().out


def test_a_small_table_is_refused_with_the_ways_out(tmp_path, capsys):
    code, _ = _run(tmp_path, "--dataset", str(_table(tmp_path / "t.csv", rows=40)), "--batch-size", "20")
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "too few to standardise 2 numeric column(s)" in err and "--numeric-scaling none" in err


@pytest.mark.parametrize("schema, match", [
    ({"categorical": {"colour": ["red", "green"]}}, "column 'colour' holds 'blue', which is not among"),
    ({"numeric": {"age": [20, 60]}, "categorical": {"colour": ["red", "green", "blue"]}},
     r"column 'age' holds \d+, outside its declared range \[20, 60\]"),
    ({"numeric": {"height": [0, 3]}}, r"the schema names columns \['height'\]"),
    ({"numeric": {"colour": [0, 1]}}, "'colour' is declared numeric in the schema but holds categorical"),
    ({"numeric": {"age": [5, 1]}}, "must be \\[low, high\\] with low < high"),
    ({"ranges": {}}, "a schema is an object with the keys"),
])
def test_schema_mismatches_are_one_line_errors(tmp_path, capsys, schema, match):
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    code, _ = _run(tmp_path, "--dataset", str(_table(tmp_path / "t.csv", rows=100)),
                   "--schema", str(tmp_path / "schema.json"), "--numeric-scaling", "none", "--labels", "0,1")
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(match, err), err


# ---------------------------------------------------------------------------- the papers' knobs
class _Captured(Exception):
    pass


KNOB_RUNS = [
    (["--clip-gamma", "0.05"], {"clipping": AutoS(gamma=0.05), "thresholds": "fixed"}),
    (["--clipping", "psac", "--psac-r", "0.2"], {"clipping": PSAC(r=0.2)}),
    (["--clipping", "abadi"], {"clipping": "abadi"}),
    (["--noise-allocation", "weighted", "--groups", "per-layer"],
     {"noise_allocation": "weighted", "groups": "per-layer", "clipping": "auto-s"}),
    (["--thresholds", "adaptive", "--target-quantile", "0.7", "--quantile-lr", "0.1",
      "--quantile-budget", "0.05"],
     {"thresholds": AdaptiveQuantile(target=0.7, lr=0.1, budget=0.05)}),
    (["--thresholds", "adaptive"], {"thresholds": "adaptive"}),
    ([], {"lr": DoG()}),  # the default: SGD's automatic step size
    (["--lr", "hyfreedp", "--lr-update-interval", "3"], {"lr": HyFreeDP(interval=3)}),
    (["--lr", "hyfreedp"], {"lr": HyFreeDP()}),
    (["--optimizer", "adam", "--lr", "0.01"], {"lr": None}),
]


def _auto_lr_given(monkeypatch, *args):
    """The ``lr`` keyword the command line hands to make_private for ``train *args``."""
    seen = {}

    def capture(*_, **kwargs):
        seen.update(kwargs)
        raise _Captured

    monkeypatch.setattr(training_module, "make_private", capture)
    with pytest.raises(_Captured):
        main(["train", "--steps", "1", "--quiet", "--seed", "0", "--accountant", "rdp", *args])
    return seen["lr"]


def test_the_noise_budget_sees_the_input_scale_that_the_encoding_makes_public(tmp_path, monkeypatch):
    """Standardised numeric columns (unit variance by design) and one-hot blocks (one 1 per row) fix the
    features' root mean square, √(columns / features), whatever the rows: removing one changes nothing.
    A column mapped from a declared range or fed raw has its data's scale: the budget is left as it was."""
    colours = ["red", "green", "blue", "violet"]
    (tmp_path / "schema.json").write_text(json.dumps({"categorical": {"colour": colours}}))
    table = _table(tmp_path / "t.csv")
    schema = ["--schema", str(tmp_path / "schema.json"), "--labels", "0,1"]
    public = DoG(input_rms=math.sqrt(3 / 6))  # age, income (standardised), colour (4 indicators)
    assert _auto_lr_given(monkeypatch, "--dataset", str(table), *schema) == public
    neighbour = pd.read_csv(table).iloc[1:]
    neighbour.to_csv(tmp_path / "n.csv", index=False)
    assert _auto_lr_given(monkeypatch, "--dataset", str(tmp_path / "n.csv"), *schema) == public
    raw = _auto_lr_given(monkeypatch, "--dataset", str(table), *schema, "--numeric-scaling", "none")
    assert raw == DoG()
    (tmp_path / "ranges.json").write_text(json.dumps({"numeric": {"age": [0, 120]}}))
    assert _auto_lr_given(monkeypatch, "--dataset", str(table), "--schema", str(tmp_path / "ranges.json")
                          ) == DoG()
    assert _auto_lr_given(monkeypatch, "--dataset", "digits") == DoG()  # images: the budget as it was


@pytest.mark.parametrize("flags, keywords", KNOB_RUNS)
def test_each_knob_reaches_make_private_in_its_option(monkeypatch, flags, keywords):
    seen = {}

    def capture(*args, **kwargs):
        seen.update(kwargs)
        raise _Captured

    monkeypatch.setattr(training_module, "make_private", capture)
    with pytest.raises(_Captured):
        main(["train", "--steps", "1", "--quiet", *flags])
    assert {k: seen[k] for k in keywords} == keywords
    assert not set(training_module.KNOBS) & set(seen)  # every knob is a field of a typed option


@pytest.mark.parametrize("flags, match", [
    (["--clipping", "abadi", "--clip-gamma", "0.1"], "--clip-gamma applies only to --clipping auto-s"),
    (["--psac-r", "0.1"], "--psac-r applies only to --clipping psac: drop it or add --clipping psac"),
    (["--quantile-lr", "0.1"], "--quantile-lr applies only to --thresholds adaptive"),
    (["--quantile-budget", "0.1"], "--quantile-budget applies only to --thresholds adaptive"),
    (["--target-quantile", "0.7"], "--target-quantile applies only to --thresholds adaptive"),
    (["--thresholds", "adaptive", "--target-quantile", "1.5"], r"--target-quantile must be in \(0, 1\)"),
    (["--lr-update-interval", "3"], "--lr-update-interval only apply to --lr hyfreedp"),
    (["--quantile-budget", "1.5"], r"must be in \(0, 1\)"),
    (["--hidden", "256,0"], "every width must be at least 1"),
    (["--hidden", "wide"], "expected widths like 256,256"),
    (["--model", "linear", "--hidden", "64"], "--hidden sizes the MLP, and this run's model is the linear"),
])
def test_irrelevant_or_bad_flags_are_refused_in_one_line(capsys, flags, match):
    try:
        code = main(["train", "--steps", "1", "--quiet", *flags])
    except SystemExit as usage_error:  # argparse's own checks
        code = usage_error.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(match, err), err


def test_hidden_sizes_the_mlp():
    model = models.build("auto", "table", (7,), 3, hidden=(256, 32))
    widths = [(m.in_features, m.out_features) for m in model if isinstance(m, torch.nn.Linear)]
    assert widths == [(7, 256), (256, 32), (32, 3)]
    default = models.build("mlp", "table", (7,), 3)
    assert [(m.in_features, m.out_features) for m in default if isinstance(m, torch.nn.Linear)] == [
        (7, 128), (128, 3)]


# ---------------------------------------------------------------------------- progress
class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_progress_in_a_log_is_plain_lines_every_tenth_or_ten_seconds():
    stream, clock = io.StringIO(), _Clock()
    progress = Progress(epochs=2, steps_per_epoch=50, total_steps=100, quiet=False, stream=stream,
                        clock=clock)
    for step in range(1, 101):
        clock.now += 0.1
        if step == 33:
            clock.now += 10.0  # a slow step: a line at once, whatever the fraction
        epoch, within = (step - 1) // 50 + 1, (step - 1) % 50 + 1
        progress.update(epoch, within, step, float("nan") if epoch == 1 else 1.0, 0.9)
        if within == 50:
            progress.update(epoch, within, step, 1.0 if epoch == 1 else 2.0, 0.9, final=True)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    steps = [int(line.split()[1].split("/")[0]) for line in lines]
    assert steps == [10, 20, 30, 33, 40, 50, 60, 70, 80, 90, 100]
    assert lines[-1].startswith("step 100/100 (100%) epoch   2/2 ε  2.000 | test acc 0.900")
    assert all(line.endswith("(held-out rows, outside the guarantee)") for line in lines)


def test_progress_on_a_terminal_redraws_a_bar():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    progress = Progress(epochs=1, steps_per_epoch=4, total_steps=4, quiet=False, stream=stream)
    for step in range(1, 5):
        progress.update(1, step, step, float("nan"), float("nan"))
    progress.update(1, 4, 4, 1.5, 0.9, final=True)
    text = stream.getvalue()
    assert text.count("\r") == 5 and "[#####" in text
    assert text.endswith("ε  1.500 | test acc 0.900 (held-out rows, outside the guarantee)\n")


# ---------------------------------------------------------------------------- plots
def test_moving_average_against_a_direct_mean():
    values = [float(v) for v in np.random.default_rng(0).normal(size=37)]
    for window in (1, 4, 10):
        direct = [float(np.mean(values[max(0, i - window + 1):i + 1])) for i in range(len(values))]
        assert report.moving_average(values, window) == pytest.approx(direct)
    assert len(report.moving_average(values)) == len(values)


def _records(steps: int, auto_lr: bool, lr: float = 0.02):
    rng = np.random.default_rng(0)
    records = []
    for t in range(1, steps + 1):
        record = {"kind": "step", "step": t, "lr": 0.01 * (1 + t / steps) if auto_lr else lr,
                  "thresholds": {"a long clip group name": 1.0 + float(rng.random())}}
        if auto_lr:
            record["loss_bound"] = 2.0 + float(rng.random())
        records.append(record)
    records.append({"kind": "epoch", "step": steps, "epsilon": 1.0, "test_accuracy": 0.9})
    return records


def _inside_figure(fig) -> bool:
    fig.canvas.draw()
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    for ax in fig.axes:
        for text in (ax.yaxis.label, ax.xaxis.label, ax.title):
            extent = text.get_window_extent(renderer)
            if text.get_text() and not (extent.x0 >= box.x0 and extent.x1 <= box.x1
                                        and extent.y0 >= box.y0 and extent.y1 <= box.y1):
                return False
    return True


def test_learning_rate_plot_reads_well_when_the_rate_is_constant():
    fixed = report.learning_rate_figure(_records(20, auto_lr=False))
    assert len(fixed.axes) == 1 and fixed.axes[0].get_title() == "learning rate 0.02, constant"
    assert fixed.axes[0].get_ylim() == (0, 0.025)
    # DoG's rate when it settles: equal to 5 digits, a log axis of identical tick labels before
    records = _records(20, auto_lr=False)
    for i, record in enumerate(r for r in records if r["kind"] == "step"):
        record["lr"] = 1.6274 * (1 + 1e-6 * (i % 3))
    settled = report.learning_rate_figure(records).axes[0]
    assert settled.get_title() == "learning rate 1.63, constant within 0.1%"
    assert settled.get_yscale() == "linear"
    auto = report.learning_rate_figure(_records(20, auto_lr=True))
    assert len(auto.axes) == 2 and all(ax.lines for ax in auto.axes)
    assert auto.axes[0].get_yscale() == "linear"
    assert not auto.axes[0].yaxis.get_major_formatter().get_useOffset()


@pytest.mark.slow
def test_plot_labels_fit_and_long_runs_are_smoothed():
    records = _records(10_000, auto_lr=True)
    for figure, _ in report.FIGURES.values():
        assert _inside_figure(figure(records)), figure.__name__
    bound_axes = report.learning_rate_figure(records).axes[1]
    raw, smoothed = bound_axes.lines[:2]
    assert "moving average of 200" in smoothed.get_label()
    assert np.std(smoothed.get_ydata()) < 0.3 * np.std(raw.get_ydata())


# ---------------------------------------------------------------------------- δ
@pytest.mark.slow
def test_the_default_delta_is_stated_with_how_it_was_chosen(tmp_path, capsys):
    code, result = _run(tmp_path)
    n = result["dataset"]["train_examples"]
    assert code == 0 and result["delta"] == pytest.approx(1 / n ** 1.1)
    stated = f"δ = 1/N^1.1 = {1 / n ** 1.1:.3g} for N = {n} training examples, the default"
    assert result["delta_choice"].startswith(stated) and stated in capsys.readouterr().out
    assert training_module.delta_choice(1e-5, n) == (1e-5, "δ = 1e-05, given by --delta")
