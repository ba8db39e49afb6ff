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

    def finish(self, report: dict[str, Any]) -> None:
        self._metrics.close()
        (self.path / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        plot(self.records, self.path)


def _series(records: list[dict[str, Any]], kind: str, key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r["kind"] == kind and key in r
              and r[key] is not None and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def plot(records: list[dict[str, Any]], out: Path) -> None:
    """loss_accuracy.png, epsilon.png, learning_rate.png and clipping.png in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(*_series(records, "step", "loss"), lw=0.8, label="train loss (batch)")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_acc.plot(*_series(records, "step", "train_accuracy"), lw=0.8, alpha=0.6,
                label="train (batch)")
    ax_acc.plot(*_series(records, "epoch", "test_accuracy"), "o-", label="test")
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("accuracy")
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_accuracy.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot(*_series(records, "epoch", "epsilon"), "o-")
    ax.set_xlabel("step")
    ax.set_ylabel("ε spent")
    fig.tight_layout()
    fig.savefig(out / "epsilon.png", dpi=100)
    plt.close(fig)

    fig, (ax_lr, ax_bound) = plt.subplots(1, 2, figsize=(10, 4))
    ax_lr.plot(*_series(records, "step", "lr"), lw=0.8)
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_yscale("log")
    steps, bounds = _series(records, "step", "loss_bound")
    ax_bound.plot(steps, bounds, lw=0.8)
    ax_bound.set_xlabel("step")
    ax_bound.set_ylabel("loss clipping threshold R_l (lr=auto)")
    fig.tight_layout()
    fig.savefig(out / "learning_rate.png", dpi=100)
    plt.close(fig)

    groups = sorted({g for r in records if r["kind"] == "step" for g in r.get("groups", {})})
    fig, (ax_frac, ax_norm) = plt.subplots(1, 2, figsize=(10, 4))
    for group in groups[:12]:
        steps = [r["step"] for r in records if r["kind"] == "step" and group in r.get("groups", {})]
        stats = [r["groups"][group] for r in records
                 if r["kind"] == "step" and group in r.get("groups", {})]
        ax_frac.plot(steps, [s["clip_fraction"] for s in stats], lw=0.8, label=group)
        line, = ax_norm.plot(steps, [s["norm_quantiles"]["q50"] for s in stats], lw=0.8,
                             label=group)
        ax_norm.plot(steps, [s["threshold"] for s in stats], lw=0.8, ls="--",
                     color=line.get_color())
        ax_norm.fill_between(steps, [s["norm_quantiles"]["q10"] for s in stats],
                             [s["norm_quantiles"]["q90"] for s in stats], alpha=0.2,
                             color=line.get_color())
    ax_frac.set_xlabel("step")
    ax_frac.set_ylabel("fraction of examples clipped (‖g‖ > threshold)")
    ax_norm.set_xlabel("step")
    ax_norm.set_ylabel("per-sample gradient norm (10–50–90%); threshold dashed")
    ax_norm.set_yscale("log")
    if groups:
        ax_norm.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "clipping.png", dpi=100)
    plt.close(fig)
