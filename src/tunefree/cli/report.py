"""The run directory: ``metrics.jsonl`` (one line per step, plus one per epoch), ``report.json``, the model
(``model.pt`` and ``model.json``, what ``tunefree predict`` needs) and PNG plots.

Every value written is public (the run's settings, or declared by the user), released (ε, the learning
rate and clip thresholds, set from released values) or a metric on the held-out test rows, which the
guarantee does not cover: ``metrics.jsonl`` opens with a line that says which keys those are,
``report.json`` lists them under ``outside_the_guarantee``, and the plots say it in their titles. Nothing
is computed from the training rows without noise (no training loss, accuracy or gradient norm).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# Values computed from the held-out test rows (or the run's timing) without noise, and why they are shown.
OUTSIDE_THE_GUARANTEE = {
    "keys": ["test_accuracy", "test_loss", "test_perplexity", "dataset.test_examples", "test_majority_class",
             "reference_test_accuracy", "train_seconds"],
    "why": "computed from the held-out test rows (or the run's timing) without noise — and the reference "
           "run's accuracy from the training rows without noise: the guarantee covers the training rows, "
           "not the test rows, and not a run without noise. They are for you, the data's owner: do not "
           "publish them",
}
TEST_LABEL = "held-out rows, outside the guarantee"


def majority_class_rate(labels: Sequence[int] | torch.Tensor, classes: Sequence[str]) -> dict[str, Any]:
    """The most frequent class among the held-out rows' labels (class indices into ``classes``) and its
    share of them: the test accuracy of a model that always predicts it, so that a run "at the majority
    rate" shows as one. Computed from the test rows without noise: outside the guarantee, like the test
    accuracy (``report.json``'s ``test_majority_class``)."""
    counts = Counter(int(label) for label in labels)
    if not counts:
        raise ValueError("no held-out rows: the majority rate needs at least one")
    index, count = max(counts.items(), key=lambda item: (item[1], -item[0]))
    return {"class": classes[index], "rate": count / sum(counts.values()), "rows": sum(counts.values())}


def accuracy_line(test_accuracy: float, majority: dict[str, Any], reference: float | None = None) -> str:
    """The output's line about the test accuracy, beside the majority rate (and the non-private reference
    run's accuracy when one was run), all labelled outside the guarantee."""
    line = (f"test accuracy {test_accuracy:.4f} on {majority['rows']} held-out rows; always predicting the "
            f"majority class {majority['class']!r} scores {majority['rate']:.4f}")
    if reference is not None:
        line += f"; the same run without noise (--reference) {reference:.4f}"
    return line + " (outside the guarantee: computed from held-out rows without noise)"


def jsonable(value: Any) -> Any:
    """``value`` with every non-finite float written as a string ("inf", "nan"): strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(value), indent=2) + "\n")


PREDICT_DATA = {"table": "TABLE (rows with the training columns)",
                "image": "IMAGES ('digits', a .npy array or a folder of image files)"}


def where_results_went(out: Path | None, json_path: Path | None, text_model: bool = False,
                       kind: str = "table") -> str:
    """The last line of a run: where its model and results are, or that they were kept nowhere.
    ``text_model``: a text run, whose model is the directory ``model/``; ``kind``: the data of a table or
    image run, which says what ``tunefree predict`` takes."""
    if out and text_model:
        return f"run directory: {out} (model/, report.json, metrics.jsonl, plots)"
    if out:
        return (f"run directory: {out} (model.pt and model.json — `tunefree predict --run {out} --data "
                f"{PREDICT_DATA[kind]}` applies them —, report.json, metrics.jsonl, plots)")
    kept = f"the result is in {json_path}; " if json_path else ""
    return (f"no --out: {kept}the model was not saved and no metrics or plots were written — pass --out DIR "
            "to keep them")


class RunDirectory:
    """Writes the metrics of a run as they come and the report and plots at the end."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.path / "metrics.jsonl", "w")  # noqa: SIM115 - open for the run
        self.records: list[dict[str, Any]] = []
        self.log({"kind": "run", "outside_the_guarantee": OUTSIDE_THE_GUARANTEE["keys"],
                  "why": OUTSIDE_THE_GUARANTEE["why"]})

    def baseline(self, name: str, accuracy: float) -> None:
        """A test accuracy to compare the run's with (the majority rate, a reference run): a flat line in
        ``test_accuracy.png`` and a ``baseline`` record in ``metrics.jsonl``."""
        self.log({"kind": "baseline", "name": name, "test_accuracy": accuracy})

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._metrics.write(json.dumps(jsonable(record)) + "\n")
        self._metrics.flush()

    def save_model(self, model: Any, description: dict[str, Any]) -> str:
        """The trained model's weights (its ``state_dict``) as ``model.pt``, and ``model.json``: the model's
        description and the preprocessing of its inputs and classes; returns the weights' file name."""
        torch.save(model.state_dict(), self.path / "model.pt")
        write_json(self.path / "model.json", description)
        return "model.pt"

    def finish(self, report: dict[str, Any]) -> None:
        self._metrics.close()
        write_json(self.path / "report.json", report)
        plot(self.records, self.path)


def _series(records: list[dict[str, Any]], kind: str, key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r["kind"] == kind and key in r
              and r[key] is not None and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


SMOOTHING_POINTS = 50  # a moving average over about 1/50 of the run: readable at 100 or 10,000 steps


def moving_average(values: list[float], window: int | None = None) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start); by default the
    window is 1/``SMOOTHING_POINTS`` of the series, at least 1."""
    if window is None:
        window = max(1, len(values) // SMOOTHING_POINTS)
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(window, i + 1) for i in range(len(values))]


def _raw_and_smoothed(ax, steps: list[int], values: list[float], label: str, **style: Any) -> None:
    """The raw per-step curve, faint, with its moving average drawn over it."""
    if not steps:
        return
    raw, = ax.plot(steps, values, lw=0.5, alpha=0.3, **style)
    window = max(1, len(values) // SMOOTHING_POINTS)
    ax.plot(steps, moving_average(values, window), lw=1.5, color=raw.get_color(),
            label=f"{label} (moving average of {window})" if window > 1 else label)


def _pyplot():
    """pyplot drawing to files only (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def test_accuracy_figure(records: list[dict[str, Any]]):
    """The test accuracy of the weights the run keeps, after each epoch (held-out rows: outside the
    guarantee)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot(*_series(records, "epoch", "test_accuracy"), "o-", ms=3, label="this run")
    for record, style in zip((r for r in records if r["kind"] == "baseline"), ("--", ":", "-.")):
        ax.axhline(record["test_accuracy"], ls=style, lw=1, color="grey",
                   label=f"{record['name']}: {record['test_accuracy']:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"test accuracy ({TEST_LABEL})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def epsilon_figure(records: list[dict[str, Any]]):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot(*_series(records, "epoch", "epsilon"), "o-", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("ε spent")
    fig.tight_layout()
    return fig


CONSTANT = 1e-3  # a learning rate that moves by less than this fraction is drawn as a constant


def learning_rate_figure(records: list[dict[str, Any]]):
    """The learning rate; beside it the loss clipping threshold R_l when HyFreeDP sets the rate. A rate
    that stays within 0.1% of its value is one flat line from 0 up, its value in the title; one that
    moves is on a log scale when it spans more than a factor 10, else on a linear scale without offset."""
    from matplotlib.ticker import ScalarFormatter

    plt = _pyplot()
    steps, rates = _series(records, "step", "lr")
    bound_steps, bounds = _series(records, "step", "loss_bound")
    if not bound_steps:
        fig, ax_lr = plt.subplots(figsize=(5, 4))
    else:
        fig, (ax_lr, ax_bound) = plt.subplots(1, 2, figsize=(10, 4))
        _raw_and_smoothed(ax_bound, bound_steps, bounds, label="R_l")
        ax_bound.set_xlabel("step")
        ax_bound.set_ylabel("loss clipping threshold R_l")
        ax_bound.legend(fontsize=8)
    ax_lr.plot(steps, rates, lw=1)
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    if rates and min(rates) > 0:
        spread = max(rates) / min(rates)
        if spread <= 1 + CONSTANT:
            ax_lr.set_ylim(0, 1.25 * max(rates))
            within = "" if spread == 1 else " within 0.1%"
            ax_lr.set_title(f"learning rate {rates[0]:.3g}, constant{within}", fontsize=10)
        elif spread > 10:
            ax_lr.set_yscale("log")
        else:
            ax_lr.yaxis.set_major_formatter(ScalarFormatter(useOffset=False))
    fig.tight_layout()
    return fig


def thresholds_figure(records: list[dict[str, Any]], max_groups: int = 12):
    """Per clip group, the threshold of each step (adaptive thresholds: released by noisy counts)."""
    plt = _pyplot()
    step_records = [r for r in records if r["kind"] == "step" and "thresholds" in r]
    groups = sorted({g for r in step_records for g in r["thresholds"]})
    fig, ax = plt.subplots(figsize=(5, 4))
    for group in groups[:max_groups]:
        points = [(r["step"], r["thresholds"][group]) for r in step_records if group in r["thresholds"]]
        ax.plot([p[0] for p in points], [p[1] for p in points], lw=1, label=group)
    ax.set_xlabel("step")
    ax.set_ylabel("clip threshold")
    ax.set_yscale("log")
    if groups:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _has_test_accuracy(records: list[dict[str, Any]]) -> bool:
    return bool(_series(records, "epoch", "test_accuracy")[0])


def _thresholds_move(records: list[dict[str, Any]]) -> bool:
    seen = [r["thresholds"] for r in records if r["kind"] == "step" and "thresholds" in r]
    return any(t != seen[0] for t in seen)


# name: (figure, whether the run has something to draw in it)
FIGURES = {"test_accuracy.png": (test_accuracy_figure, _has_test_accuracy),
           "epsilon.png": (epsilon_figure, lambda records: True),
           "learning_rate.png": (learning_rate_figure, lambda records: True),
           "thresholds.png": (thresholds_figure, _thresholds_move)}


def plot(records: list[dict[str, Any]], out: Path) -> None:
    """The figures of ``FIGURES`` that have something to draw, as PNG files in ``out``."""
    plt = _pyplot()
    for name, (figure, drawn) in FIGURES.items():
        if not drawn(records):
            continue
        fig = figure(records)
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
