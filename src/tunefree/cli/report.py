"""The run directory: ``metrics.jsonl`` (one line per step, plus one per epoch), ``report.json`` and
PNG plots.

The training loss, accuracy and per-sample norm statistics are computed on the private data without
noise: they are diagnostics for the data's owner, not private outputs, and the report says so.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

QUANTILES = (0.1, 0.5, 0.9)


def norm_statistics(group_norms: dict[str, torch.Tensor], thresholds: dict[str, float]
                    ) -> dict[str, Any]:
    """Per clip group: fraction of examples whose norm exceeds the threshold, and norm quantiles."""
    stats: dict[str, Any] = {}
    for name, norms in group_norms.items():
        norms = norms.detach().to("cpu", torch.float64)
        if norms.numel() == 0:
            continue
        values = torch.quantile(norms, torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
        stats[name] = {"clip_fraction": float((norms > thresholds[name]).double().mean()),
                       "norm_quantiles": dict(zip([f"q{int(q * 100)}" for q in QUANTILES], values)),
                       "threshold": thresholds[name]}
    return stats


class RunDirectory:
    """Writes the metrics of a run as they come and the report and plots at the end."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.path / "metrics.jsonl", "w")  # noqa: SIM115 - open for the run
        self.records: list[dict[str, Any]] = []

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()

    def save_model(self, model: Any) -> str:
        """The trained model's weights (its ``state_dict``), as ``model.pt``; returns the file's name."""
        import torch

        torch.save(model.state_dict(), self.path / "model.pt")
        return "model.pt"

    def finish(self, report: dict[str, Any]) -> None:
        self._metrics.close()
        (self.path / "report.json").write_text(json.dumps(report, indent=2) + "\n")
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


def loss_accuracy_figure(records: list[dict[str, Any]]):
    plt = _pyplot()
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    _raw_and_smoothed(ax_loss, *_series(records, "step", "loss"), label="train loss (batch)")
    ax_loss.plot(*_series(records, "epoch", "train_loss"), "o-", ms=3, label="train loss (epoch)")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize=8)
    _raw_and_smoothed(ax_acc, *_series(records, "step", "train_accuracy"), label="train (batch)")
    ax_acc.plot(*_series(records, "epoch", "test_accuracy"), "o-", ms=3, label="test")
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("accuracy")
    ax_acc.legend(fontsize=8)
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


def learning_rate_figure(records: list[dict[str, Any]]):
    """The learning rate; beside it the loss clipping threshold R_l when the lr is automatic. A fixed lr
    is one panel saying its value."""
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
    if rates and min(rates) == max(rates):
        ax_lr.set_title(f"fixed learning rate {rates[0]:.3g}", fontsize=10)
    elif rates and min(rates) > 0:
        ax_lr.set_yscale("log")
    fig.tight_layout()
    return fig


def clipping_figure(records: list[dict[str, Any]], max_groups: int = 12):
    """Per clip group: the fraction clipped, and the median per-sample norm (its 10–90% band) with the
    threshold dashed, each smoothed over the run."""
    plt = _pyplot()
    step_records = [r for r in records if r["kind"] == "step"]
    groups = sorted({g for r in step_records for g in r.get("groups", {})})
    fig, (ax_frac, ax_norm) = plt.subplots(1, 2, figsize=(10, 4))
    for group in groups[:max_groups]:
        steps = [r["step"] for r in step_records if group in r.get("groups", {})]
        stats = [r["groups"][group] for r in step_records if group in r.get("groups", {})]
        _raw_and_smoothed(ax_frac, steps, [s["clip_fraction"] for s in stats], label=group)
        median = moving_average([s["norm_quantiles"]["q50"] for s in stats])
        line, = ax_norm.plot(steps, median, lw=1.2, label=group)
        ax_norm.plot(steps, [s["threshold"] for s in stats], lw=1, ls="--", color=line.get_color())
        ax_norm.fill_between(steps, moving_average([s["norm_quantiles"]["q10"] for s in stats]),
                             moving_average([s["norm_quantiles"]["q90"] for s in stats]), alpha=0.2,
                             color=line.get_color())
    ax_frac.set_xlabel("step")
    ax_frac.set_ylabel("fraction clipped")
    ax_frac.set_title("examples with ‖g‖ > threshold", fontsize=10)
    ax_norm.set_xlabel("step")
    ax_norm.set_ylabel("per-sample gradient norm")
    ax_norm.set_title("median, 10–90% band; threshold dashed", fontsize=10)
    ax_norm.set_yscale("log")
    if groups:
        ax_frac.legend(fontsize=7)
        ax_norm.legend(fontsize=7)
    fig.tight_layout()
    return fig


FIGURES = {"loss_accuracy.png": loss_accuracy_figure, "epsilon.png": epsilon_figure,
           "learning_rate.png": learning_rate_figure, "clipping.png": clipping_figure}


def plot(records: list[dict[str, Any]], out: Path) -> None:
    """loss_accuracy.png, epsilon.png, learning_rate.png and clipping.png in ``out``."""
    plt = _pyplot()
    for name, figure in FIGURES.items():
        fig = figure(records)
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
