"""docs/cli.md, claim by claim: the flags it names exist, the flags the command line's messages suggest exist,
and the claims that no other test of tests/cli checks (issue 30: "docs/cli.md matches what the CLI does")."""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import math
import re
import struct
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tunefree import PSAC, AdaptiveQuantile, AutoS, HyFreeDP
from tunefree.cli import main, models, preprocess, report
from tunefree.cli import training as training_module
from tunefree.cli.main import parser
from tunefree.cli.report import OUTSIDE_THE_GUARANTEE
from tunefree.cli.tables import DataError, Schema
from tunefree.cli.training import batch_size_for
from tunefree.privacy import epsilon

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "cli.md"
CLI_SOURCES = sorted((ROOT / "src" / "tunefree" / "cli").glob("*.py"))
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
DOCUMENTED_COMMANDS = ("train", "predict", "epsilon")  # `tunefree audit` is docs/audit.md's


def _options() -> tuple[set[str], dict[str, set[str]]]:
    """The root parser's options and each command's."""
    root = parser()
    commands = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return (
        {o for a in root._actions for o in a.option_strings},
        {name: {o for a in sub._actions for o in a.option_strings} for name, sub in commands.choices.items()},
    )


def _doc_paragraphs() -> list[tuple[str, str]]:
    """(command of its section, text) for each paragraph and each table row of docs/cli.md: a section whose
    heading names `tunefree predict` or `tunefree epsilon` is about that command, the others about train."""
    command, paragraphs, lines = "train", [], []
    for line in DOC.read_text().splitlines() + [""]:
        if line.startswith("#"):
            command = next((c for c in ("predict", "epsilon") if f"`tunefree {c}`" in line), "train")
        if not line.strip() or line.startswith("|") or line.startswith("#"):
            if lines:
                paragraphs.append((command, "\n".join(lines)))
            lines = []
            if line.startswith("|"):
                paragraphs.append((command, line))
            continue
        lines.append(line)
    return paragraphs


def test_every_flag_the_docs_name_exists_in_the_parser_of_its_command():
    root, commands = _options()
    missing = []
    for command, text in _doc_paragraphs():
        named = {c for c in commands if f"tunefree {c}" in text}  # e.g. a `tunefree train ...` example
        allowed = root.union(commands[command], *(commands[c] for c in named))
        missing += [(flag, text[:80]) for flag in FLAG.findall(text) if flag not in allowed]
    assert not missing


def test_every_option_of_the_documented_commands_is_in_the_docs():
    documented = set(FLAG.findall(DOC.read_text()))
    _, commands = _options()
    for command in DOCUMENTED_COMMANDS:
        assert commands[command] - {"-h", "--help"} <= documented, command


def _strings(node: ast.AST) -> str:
    return " ".join(
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    )


def _messages(tree: ast.AST) -> list[str]:
    """The text of each string (a literal or an f-string, whole) in ``tree`` but its docstrings and the
    arguments of ``add_argument``/``add_parser`` (help texts, which describe rather than suggest)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("add_argument", "add_parser"):
            skipped |= {id(n) for n in ast.walk(node)}
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            skipped.add(id(body[0].value))  # a docstring
    inner = {id(n) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for n in node.values}
    return [
        _strings(n)
        for n in ast.walk(tree)
        if id(n) not in skipped | inner
        and (isinstance(n, ast.JoinedStr) or isinstance(n, ast.Constant) and isinstance(n.value, str))
    ]


def test_every_flag_a_message_of_the_command_line_suggests_exists():
    """Every ``--flag`` in the text of src/tunefree/cli/ is an option of one of the parsers; and every
    message of `tunefree predict` (predict.py, the text mode's predict_command) names only predict's own
    options, unless it sends the user to `tunefree train`."""
    root, commands = _options()
    everything = root.union(*commands.values())
    for path in CLI_SOURCES:
        flags = set(FLAG.findall(_strings(ast.parse(path.read_text()))))
        assert flags <= everything, (path.name, flags - everything)
    trees = [ast.parse((ROOT / "src/tunefree/cli/predict.py").read_text())]
    text_tree = ast.parse((ROOT / "src/tunefree/cli/text.py").read_text())
    trees += [
        f for f in ast.walk(text_tree) if isinstance(f, ast.FunctionDef) and f.name == "predict_command"
    ]
    messages = [m for tree in trees for m in _messages(tree)]
    assert sum("--na-values" in m for m in messages) >= 3  # the check reads predict's messages, not nothing
    for message in messages:
        if "tunefree train" not in message:
            assert set(FLAG.findall(message)) <= commands["predict"], message


# ---------------------------------------------------------------------------- the defaults of the flag table
class _Captured(Exception):
    pass


def _config_of(monkeypatch, *flags) -> training_module.TrainConfig:
    """The configuration `tunefree train *flags` hands to the training function."""
    seen = {}

    def capture(config, *_):
        seen["config"] = config
        raise _Captured

    monkeypatch.setattr(training_module, "train", capture)
    with pytest.raises(_Captured):
        main(["train", *flags])
    return seen["config"]


def test_the_documented_defaults_are_the_ones_used(monkeypatch):
    config = _config_of(monkeypatch)
    assert (config.dataset, config.label_column, config.model, config.hidden) == (
        "digits",
        "label",
        "auto",
        None,
    )
    assert (config.numeric_scaling, config.epsilon, config.delta) == ("private", 3.0, None)
    assert (config.epochs, config.steps, config.batch_size) == (40, None, None)  # None: 256, or N if fewer
    assert batch_size_for(config.batch_size, 10_000) == 256 and batch_size_for(config.batch_size, 123) == 123
    assert (config.clipping, config.groups, config.thresholds) == ("auto-s", "all-layer", "fixed")
    assert (config.noise_allocation, config.optimizer, config.lr, config.accountant) == (
        "global",
        "sgd",
        "auto",
        "pld",
    )
    assert (config.seed, config.out, config.quiet, config.reference, config.audit_canaries) == (
        None,
        None,
        False,
        False,
        None,
    )
    assert config.max_grad_norm == 1.0  # R = 1
    # the papers' knobs left out: make_private's typed options with their own defaults
    assert config.options() == {"clipping": "auto-s", "thresholds": "fixed"}
    assert AutoS().gamma == 0.01 and PSAC().r == 0.1 and HyFreeDP().interval == 5
    quantile = AdaptiveQuantile()
    assert (quantile.target, quantile.lr, quantile.budget) == (0.5, 0.3, 0.01)
    assert _config_of(monkeypatch, "--steps", "7").epochs is None  # --steps replaces the 40 epochs
    # --model auto: a CNN for images of at least 24 pixels a side, an MLP for tables and smaller images
    assert models.resolve("auto", "image", (1, 24, 24)) == "cnn"
    assert models.resolve("auto", "image", (3, 23, 32)) == "mlp"
    assert models.resolve("auto", "table", (5,)) == "mlp"
    args = parser().parse_args(
        ["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "1", "--delta", "1e-5"]
    )
    assert args.accountant == "pld"
    args = parser().parse_args(["predict", "--run", "r", "--data", "d"])
    assert args.output is None and args.na_values == ""


# ---------------------------------------------------------------------------- refusals
def _refusal(capsys, *argv) -> str:
    """Run ``tunefree *argv``; it must refuse in one line with exit status 2; the line."""
    try:
        code = main(list(argv))
    except SystemExit as usage_error:  # argparse's own checks
        code = usage_error.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--epsilon", "nan"], "--epsilon: must be positive, got nan"),
        (["--lr", "0"], "--lr: must be positive, got 0"),
        (["--lr", "nan"], "--lr: must be positive, got nan"),
        (["--lr", "inf"], "--lr must be a positive number, 'auto' or 'hyfreedp', got inf"),
        (["--epochs", "nan"], "--epochs: must be positive, got nan"),
        (["--epochs", "inf"], "--epochs must be a positive number, got inf"),
        (["--epochs", "-1"], "--epochs: must be positive, got -1"),
        (["--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
        (["--steps", "-3"], "--steps: must be at least 1, got -3"),
    ],
)
def test_a_bad_number_is_refused_naming_the_flag_and_what_it_got(capsys, flags, match):
    length = [] if {"--epochs", "--steps"} & set(flags) else ["--steps", "1"]
    assert match in _refusal(capsys, "train", "--quiet", *length, *flags)


@pytest.mark.parametrize(
    "knob",
    [
        ["--psac-r", "0.2"],
        ["--clipping", "abadi", "--clip-gamma", "0.1"],
        ["--quantile-lr", "0.1"],
        ["--lr-update-interval", "3"],
    ],
)
def test_a_knob_without_effect_is_refused_before_any_data_is_read(capsys, knob):
    err = _refusal(capsys, "train", "--dataset", "/nonexistent/data.csv", "--steps", "1", *knob)
    assert knob[-2] in err and "not found" not in err


def test_a_delta_not_below_one_over_n_is_refused_with_the_suggested_delta(capsys):
    err = _refusal(capsys, "train", "--delta", "0.01", "--steps", "1", "--quiet")
    n = int(re.search(r"for N = (\d+) examples", err).group(1))
    assert "allows leaking whole examples" in err
    suggested = float(re.search(r"e\.g\. ([0-9.e-]+)$", err).group(1))
    assert suggested == pytest.approx(n**-1.1, rel=0.02)  # 1/N^1.1 (2 figures), the default


def _idx(path: Path, array: np.ndarray, type_code: int = 0x08) -> None:
    dtype = {0x08: ">u1", 0x0C: ">i4"}[type_code]
    path.write_bytes(
        bytes([0, 0, type_code, array.ndim])
        + struct.pack(f">{array.ndim}I", *array.shape)
        + array.astype(dtype).tobytes()
    )


def _mnist(directory: Path, size: int, type_code: int = 0x08) -> str:
    rng = np.random.default_rng(0)
    for prefix, rows in (("train", 40), ("t10k", 10)):
        _idx(directory / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (rows, size, size)), type_code)
        _idx(directory / f"{prefix}-labels-idx1-ubyte", np.arange(rows) % 2)
    return str(directory)


def test_hidden_is_refused_where_auto_picks_a_cnn(tmp_path, capsys):
    err = _refusal(capsys, "train", "--dataset", _mnist(tmp_path, 24), "--hidden", "8", "--steps", "1")
    assert "--hidden sizes the MLP, and this run's model is the cnn: drop --hidden or pass --model mlp" in err


def test_images_stored_as_a_type_with_no_public_range_or_of_mixed_sizes_are_refused(tmp_path, capsys):
    (tmp_path / "ints").mkdir()
    err = _refusal(capsys, "train", "--dataset", _mnist(tmp_path / "ints", 8, 0x0C), "--steps", "1")
    assert (
        "pixels stored as >i4 have no public range" in err or "pixels stored as int32 have no public" in err
    )
    import datasets as hf

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (8, 8) if i else (9, 9)).astype(np.uint8) for i in range(12)]
    hf.Dataset.from_dict({"image": images, "label": [i % 2 for i in range(12)]}).save_to_disk(tmp_path / "hf")
    capsys.readouterr()  # the library's progress bar
    err = _refusal(capsys, "train", "--dataset", str(tmp_path / "hf"), "--steps", "1")
    assert (
        "image 1 is uint8 (8, 8), unlike the first (uint8 (9, 9)): every image must have one pixel type"
        in err
    )


def test_text_models_refuse_the_table_and_image_only_flags_before_loading_anything(tmp_path, capsys):
    """--reference and --audit-canaries are for table and image models; a text run refuses them."""
    model = str(tmp_path / "no-model-here")
    assert "--reference is offered for table and image models only" in _refusal(
        capsys, "train", "--model", model, "--reference", "--out", str(tmp_path / "o")
    )
    assert "--audit-canaries do not apply to text models" in _refusal(
        capsys, "train", "--model", model, "--audit-canaries", "5", "--out", str(tmp_path / "o")
    )


# ---------------------------------------------------------------------------- tables: classes and columns
def _write(path: Path, frame: pd.DataFrame) -> str:
    frame.to_csv(path, index=False)
    return str(path)


def _labelled(rows: int, seed: int = 0, **columns) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {"age": rng.integers(18, 90, rows), **columns, "label": rng.choice(["no", "yes"], rows)}
    )


def test_labels_declaring_one_class_and_training_labels_not_declared_are_refused(tmp_path, capsys):
    data = _write(tmp_path / "t.csv", _labelled(200))
    err = _refusal(capsys, "train", "--dataset", data, "--labels", "yes", "--steps", "1", "--quiet")
    assert "--labels declares a single class ['yes']; classification needs at least two" in err
    frame = _labelled(200)
    frame.loc[:, "label"] = ["maybe" if i % 3 == 0 else "no" if i % 3 == 1 else "yes" for i in range(200)]
    data = _write(tmp_path / "m.csv", frame)
    err = _refusal(capsys, "train", "--dataset", data, "--labels", "no,yes", "--steps", "1", "--quiet")
    assert "labels ['maybe'] are not among the declared classes ['no', 'yes']: add them to --labels" in err


def test_fewer_than_two_labels_selected_privately_is_refused_with_the_count_needed(tmp_path, capsys):
    train = _labelled(300)
    train["label"] = ["no"] + ["yes"] * 299  # two classes in the training rows, one of them a single row
    test = _labelled(40)
    args = [
        "--dataset",
        _write(tmp_path / "train.csv", train),
        "--test-data",
        _write(tmp_path / "test.csv", test),
    ]
    err = _refusal(capsys, "train", *args, "--steps", "1", "--quiet", "--seed", "0", "--accountant", "rdp")
    assert "only 1 class label(s) ['yes'] had enough training rows to be selected privately" in err
    assert re.search(
        r"a label needs a noisy count of \d+ rows at this ε\): declare the classes with --labels", err
    )


def test_an_infinite_feature_value_is_refused_naming_the_column_and_row(tmp_path):
    frame = _labelled(30)
    frame["income"] = [math.inf if i == 4 else float(i) for i in range(30)]
    with pytest.raises(
        DataError,
        match=r"column 'income' is missing or infinite in data row 5 .*"
        "--drop-rows-with-missing",
    ):
        preprocess.load(_write(tmp_path / "t.csv", frame))


def test_schema_categories_compare_as_text(tmp_path):
    (tmp_path / "schema.json").write_text(json.dumps({"categorical": {"code": [1, 2, 3]}}))
    frame = _labelled(60, code=[1 + i % 3 for i in range(60)])
    data = preprocess.load(
        _write(tmp_path / "t.csv", frame),
        schema=Schema.load(tmp_path / "schema.json"),
        labels=("no", "yes"),
        numeric_scaling="none",
    )
    assert data.releases == ()  # declared: nothing selected
    assert [n for n in data.feature_names if n.startswith("code")] == ["code=1", "code=2", "code=3"]
    x = data.train.tensors[0].numpy()
    assert (x[:, 1:].sum(1) == 1).all()  # every row one-hot: each cell 1, 2 or 3 matched its category


def test_a_reference_run_keeps_every_value_two_training_rows_share(tmp_path):
    train = _labelled(120, colour=["red"] * 117 + ["green", "green", "violet"])
    test = _labelled(30, seed=1, colour=["red"] * 30)
    data = preprocess.load(
        _write(tmp_path / "train.csv", train), epsilon=math.inf, test_data=_write(tmp_path / "test.csv", test)
    )
    selections = {r.name: r.report() for r in data.releases}
    assert selections["category sets"]["selected"] == {"colour": ["green", "red"]}  # violet: one row
    assert selections["class labels"]["selected"] == {"label": ["no", "yes"]}
    assert all(r.noise_multiplier == 0 for r in data.releases)


def test_test_data_gives_the_test_rows_and_every_row_of_the_dataset_trains(tmp_path, capsys):
    train, test = _labelled(150), _labelled(37, seed=1)
    assert (
        main(
            [
                "train",
                "--dataset",
                _write(tmp_path / "train.csv", train),
                "--test-data",
                _write(tmp_path / "test.csv", test),
                "--epsilon",
                "inf",
                "--steps",
                "1",
                "--quiet",
                "--batch-size",
                "50",
                "--labels",
                "no,yes",
                "--numeric-scaling",
                "none",
                "--json",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["dataset"]["train_examples"] == 150 and result["dataset"]["test_examples"] == 37
    assert result["test_majority_class"]["rows"] == 37
    assert result["guarantee"] == "no privacy: a non-private reference run (--epsilon inf), ε = ∞"
    assert f"guarantee: {result['guarantee']}" in capsys.readouterr().out


# ---------------------------------------------------------------------------- a run's outputs
@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """A short private table run with a schema, declared labels and --reference; its output captured."""
    folder = tmp_path_factory.mktemp("documented")
    frame = _labelled(400, colour=np.random.default_rng(2).choice(["red", "blue"], 400))
    _write(folder / "t.csv", frame)
    (folder / "schema.json").write_text(json.dumps({"categorical": {"colour": ["red", "blue"]}}))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(
            [
                "train",
                "--dataset",
                str(folder / "t.csv"),
                "--schema",
                str(folder / "schema.json"),
                "--labels",
                "no,yes",
                "--steps",
                "3",
                "--batch-size",
                "100",
                "--seed",
                "0",
                "--accountant",
                "rdp",
                "--reference",
                "--quiet",
                "--out",
                str(folder / "run"),
                "--json",
                str(folder / "r.json"),
            ]
        )
    assert code == 0
    return folder, out.getvalue(), err.getvalue()


JSON_KEYS = {
    "test_accuracy",
    "test_majority_class",
    "reference_test_accuracy",
    "epsilon",
    "delta",
    "noise_multiplier",
    "steps",
    "planned_steps",
    "randomness",
    "guarantee",
    "preprocessing",
    "preprocessing_epsilon",
    "public_by_declaration",
    "outside_the_guarantee",
    "note",
    "train_seconds",
    "config",
    "data_notes",
}


@pytest.mark.slow  # the fixture trains twice (about 8 s)
def test_the_result_holds_every_documented_key(reference_run):
    folder, printed, progress = reference_run
    result = json.loads((folder / "r.json").read_text())
    assert set(result) >= JSON_KEYS
    assert json.loads((folder / "run" / "report.json").read_text()).keys() == result.keys()
    assert progress == ""  # --quiet: no progress output
    assert set(OUTSIDE_THE_GUARANTEE["keys"]) == {
        "test_accuracy",
        "test_loss",
        "test_perplexity",
        "dataset.test_examples",
        "test_majority_class",
        "reference_test_accuracy",
        "train_seconds",
    }
    assert result["outside_the_guarantee"]["keys"] == OUTSIDE_THE_GUARANTEE["keys"]
    declared = result["public_by_declaration"]
    assert declared[0].startswith("the number of training rows N")
    assert any("column names" in d for d in declared)
    assert any("--schema" in d for d in declared) and any("--labels ['no', 'yes']" in d for d in declared)
    # declared: no label or category selection; the undeclared numeric column is standardised privately
    assert [r["release"] for r in result["preprocessing"]] == ["standardisation"]
    assert 0 < result["preprocessing_epsilon"] < result["epsilon"]
    assert 0.99 * 3 <= result["epsilon"] <= 3 and result["steps"] == result["planned_steps"] == 3


@pytest.mark.slow  # the fixture trains twice (about 8 s)
def test_the_reference_run_is_in_the_first_line_the_metrics_and_the_accuracy_plot(reference_run):
    folder, printed, _ = reference_run
    result = json.loads((folder / "r.json").read_text())
    reference = result["reference_test_accuracy"]
    assert f"the same run without noise (--reference) {reference:.4f}" in printed.splitlines()[0]
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    baselines = [r for r in records if r["kind"] == "baseline"]
    assert [b["test_accuracy"] for b in baselines] == [result["test_majority_class"]["rate"], reference]
    figure = report.test_accuracy_figure(records)
    axes = figure.axes[0]
    assert [line.get_ydata()[0] for line in axes.lines[1:]] == [b["test_accuracy"] for b in baselines]
    assert "outside the guarantee" in axes.get_title()
    assert (folder / "run" / "test_accuracy.png").stat().st_size > 0


def _one_reference_step(tmp_path, frame, *flags: str) -> bool:
    """One step of the reference run (ε = ∞) on ``frame`` with labels no/yes, into tmp_path/run."""
    return main(["train", "--dataset", _write(tmp_path / "t.csv", frame), "--epsilon", "inf", "--steps", "1",
                 "--batch-size", "50", "--quiet", "--labels", "no,yes", "--out", str(tmp_path / "run"),
                 *flags]) == 0


def test_non_finite_numbers_are_written_as_strings(tmp_path):
    frame = _labelled(200, colour=np.random.default_rng(2).choice(["red", "blue"], 200))
    json_path = str(tmp_path / "r.json")
    assert _one_reference_step(tmp_path, frame, "--numeric-scaling", "none", "--json", json_path)
    text = (tmp_path / "r.json").read_text()
    assert '"epsilon": "inf"' in text and "Infinity" not in text and "NaN" not in text
    assert json.loads((tmp_path / "run" / "report.json").read_text())["epsilon"] == "inf"
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))


# ---------------------------------------------------------------------------- tunefree predict
def test_predict_refuses_values_outside_what_the_schema_declared(tmp_path, capsys):
    (tmp_path / "schema.json").write_text(
        json.dumps({"categorical": {"colour": ["red", "blue"]}, "numeric": {"age": [0, 120]}})
    )
    frame = _labelled(200, colour=np.random.default_rng(2).choice(["red", "blue"], 200))
    assert _one_reference_step(tmp_path, frame, "--schema", str(tmp_path / "schema.json"))
    capsys.readouterr()
    _, commands = _options()
    for new, match in (
        (
            pd.DataFrame({"age": [30, 200], "colour": ["red", "blue"]}),
            r"column 'age' holds 200, outside its declared range \[0, 120\]: .*drop them",
        ),
        (
            pd.DataFrame({"age": [30, 40], "colour": ["red", "green"]}),
            r"column 'colour' holds 'green', which is not among its declared categories .*drop them",
        ),
    ):
        err = _refusal(
            capsys, "predict", "--run", str(tmp_path / "run"), "--data", _write(tmp_path / "n.csv", new)
        )
        assert re.search(match, err), err
        assert set(FLAG.findall(err)) <= commands["predict"] and "schema" not in err


# ---------------------------------------------------------------------------- tunefree epsilon
def test_below_the_noise_floor_the_calculator_uses_rdp(capsys):
    common = {"sample_rate": 0.01, "steps": 100, "delta": 1e-5}
    pld = epsilon(noise_multiplier=0.1, accountant="pld", **common)
    assert pld == epsilon(noise_multiplier=0.1, accountant="rdp", **common)
    assert epsilon(noise_multiplier=0.5, accountant="pld", **common) != epsilon(
        noise_multiplier=0.5, accountant="rdp", **common
    )  # above it, the PLD's own
    assert (
        main(
            [
                "epsilon",
                "--noise-multiplier",
                "0.1",
                "--sample-rate",
                "0.01",
                "--steps",
                "100",
                "--delta",
                "1e-5",
            ]
        )
        == 0
    )
    assert f"epsilon {pld:.6g}" in capsys.readouterr().out


def test_at_small_epsilon_the_pld_overstates_and_rdp_needs_far_less_noise():
    """docs/cli.md: at ε = 0.01, q = 10⁻⁴ and 10⁶ steps the PLD calibrates σ = 478 where RDP needs 28 — the
    σ that spends 0.01 bracketed on each accountant (a bracket, not the search: seconds, not a minute)."""
    common = {"sample_rate": 1e-4, "steps": 10**6, "delta": 1e-5}
    assert epsilon(noise_multiplier=470, accountant="pld", **common) > 0.01
    assert epsilon(noise_multiplier=478, accountant="pld", **common) <= 0.01
    assert epsilon(noise_multiplier=27.5, accountant="rdp", **common) > 0.01
    assert epsilon(noise_multiplier=28.1, accountant="rdp", **common) <= 0.01


def test_the_calculator_counts_epochs_as_training_does(capsys):
    """⌈epochs·round(1/q)⌉ steps: 1.5 epochs at q = 0.3 (3 steps an epoch) are 5 steps."""
    common = ["--noise-multiplier", "1", "--sample-rate", "0.3", "--delta", "1e-5"]
    assert main(["epsilon", *common, "--epochs", "1.5"]) == 0
    by_epochs = capsys.readouterr().out
    assert "5 steps" in by_epochs
    assert main(["epsilon", *common, "--steps", "5"]) == 0
    assert capsys.readouterr().out == by_epochs


def test_a_text_run_takes_its_step_on_an_empty_poisson_batch():
    """docs/cli.md (text models, Loss): an empty Poisson batch still takes its step (noise only)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import tunefree
    from tunefree.cli import text

    torch.manual_seed(0)
    head = torch.nn.Linear(4, 2)
    data = TensorDataset(torch.randn(20, 4), torch.randint(0, 2, (20,)))
    engine = tunefree.make_private(
        head,
        torch.optim.SGD(head.parameters(), lr=0.1),
        DataLoader(data, batch_size=5),
        noise_multiplier=1.0,
        target_delta=1e-3,
        steps=2,
        seed=0,
    )
    before = head.weight.detach().clone()
    text._step(
        engine, {"features": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)}, "classification"
    )
    assert engine.steps == 1  # recorded in the ledger
    assert not torch.equal(head.weight, before)  # the noise moved the weights


# ---------------------------------------------------------------------------- the docs' example lines
def _quoted(start: str) -> str:
    """The code span of docs/cli.md that begins with ``start`` (a span may run over a line break: a space)."""
    text = " ".join(DOC.read_text().split("\n"))
    match = re.search(r"`(" + re.escape(start) + r"[^`]*)`", text)
    assert match, start
    return match.group(1)


def test_the_docs_example_lines_are_what_the_command_line_prints():
    import io
    from types import SimpleNamespace

    from tunefree.cli.releases import delta_choice
    from tunefree.cli.training import Progress, guarantee_text, loose_target_note
    from tunefree.privacy.randomness import SECRET_DESCRIPTION, SEEDED_WARNING

    assert _quoted("δ = 1/N^1.1 = ") == delta_choice(None, 1438)[1]
    majority = {"class": "no", "rate": 0.684, "rows": 975}
    assert _quoted("test accuracy 0.7012") == report.accuracy_line(0.7012, majority)
    stream = io.StringIO()
    Progress(40, 30, 1200, quiet=False, stream=stream).update(3, 30, 120, 1.234, 0.876)
    assert _quoted("step 120/1200") == stream.getvalue().strip()
    assert _quoted('"randomness": "seeded') == f'"randomness": "{SEEDED_WARNING}"'
    assert (
        _quoted('"randomness": "secure"')
        == '"randomness": "secure"'
        == f'"randomness": "{SECRET_DESCRIPTION}"'
    )
    note = _quoted("the target ε = 1e+06")
    assert note.replace("…", "12.5") == loose_target_note(1e6, 0.3, 12.5)
    reference = guarantee_text(SimpleNamespace(noise_multiplier=0.0), 1e-5, 100)
    assert _quoted("guarantee: no privacy") == f"guarantee: {reference}"
