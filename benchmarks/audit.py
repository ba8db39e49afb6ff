"""The audit in its full setting: power on correct runs, detection of deliberately broken ones.

    OMP_NUM_THREADS=1 python benchmarks/audit.py [--canaries 10000] [--steps 100] [--seed 0]
                                                 [--rows power,correct,broken,multi,black-box,training]

Every row is one real training run through make_private (one-run white-box audit, m canaries, T steps),
except the multi-run Clopper–Pearson rows (many runs, one canary each), the black-box row (digits,
input canaries, final model only) and the training row (digits, make_private(audit_canaries=m)). The
broken rows patch the library's classes for that run only. ε_LB is the larger of the (ε, δ) and f-DP
bounds, both shown. Prints a Markdown table (benchmarks/RESULTS.md, section 7).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.audit import AuditSettings, audit_training, black_box_audit, multi_run_audit, one_run_audit
from tunefree.privacy.mechanisms import GradientRelease
from tunefree.privacy.randomness import SeededSource

_release, _stds, _inclusion = GradientRelease.release, GradientRelease.noise_stds, SeededSource.inclusion


def _released_twice(self, sums, thresholds):
    first, event = _release(self, sums, thresholds)
    second, _ = _release(self, sums, thresholds)  # an extra release, never recorded
    return {p: (first[p] + second[p]) / 2 for p in first}, event


BROKEN = {
    "noise 4× too small": lambda: mock.patch.object(
        GradientRelease, "noise_stds", lambda self, thresholds: [s / 4 for s in _stds(self, thresholds)]),
    "release at 2× its recorded sensitivity": lambda: mock.patch.object(
        GradientRelease, "release",
        lambda self, sums, thresholds: _release(self, {p: 2 * s for p, s in sums.items()}, thresholds)),
    "extra un-recorded release": lambda: mock.patch.object(GradientRelease, "release", _released_twice),
    "sampling at 2q, accounting q": lambda: mock.patch.object(
        SeededSource, "inclusion", lambda self, step, n, rate: _inclusion(self, step, n, min(1.0, 2 * rate))),
}


def _row(name: str, result, seconds: float) -> str:
    checks = {c.name: f"{c.ratio:.3f}{'' if c.passed else ' ✗'}" for c in result.checks}
    power = result.epsilon_lower_bound / result.epsilon if result.epsilon > 0 else math.nan
    steinke = "—" if result.steinke_bound is None else f"{result.steinke_bound:.3f}"
    fdp = "—" if result.fdp_bound is None else f"{result.fdp_bound:.3f}"
    return (f"| {name} | {result.epsilon:.3f} | {result.epsilon_lower_bound:.3f} | {power:.0%} | "
            f"{steinke} | {fdp} | {result.correct}/{result.guesses} | {checks.get('noise', '—')} | "
            f"{checks.get('separation', '—')} | {result.verdict} | {seconds:.0f} s |")


def _timed(run):
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y)


def _digits_training_audit(seed: int, canaries: int, steps: int):
    """A user's own run audited from inside: the digits MLP, make_private(audit_canaries=m)."""
    x, y = _digits()
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
    engine = tunefree.make_private(model, torch.optim.Adam(model.parameters(), lr=2e-3),
                                   DataLoader(TensorDataset(x, y), batch_size=len(x) // 2),
                                   target_epsilon=8.0, target_delta=1e-5, steps=steps, seed=seed,
                                   audit_canaries=canaries)
    while engine.steps < steps:
        for xb, yb in engine.data_loader:
            engine.optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            engine.optimizer.step()
            if engine.steps == steps:
                break
    return audit_training(engine)


def _digits_black_box(seed: int):
    x, y = _digits()
    rng = np.random.default_rng(seed)
    order = torch.tensor(rng.permutation(len(x)))
    canary_index, data_index = order[:200], order[200:]
    wrong = (y[canary_index] + torch.tensor(rng.integers(1, 10, 200))) % 10  # mislabelled canaries
    canaries = TensorDataset(x[canary_index], wrong)
    data = TensorDataset(x[data_index], y[data_index])

    def train(dataset):
        model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
        engine = tunefree.make_private(model, torch.optim.Adam(model.parameters(), lr=2e-3),
                                       DataLoader(dataset, batch_size=128), target_epsilon=8.0,
                                       target_delta=1e-5, epochs=30, seed=seed)
        for _ in range(30):
            for xb, yb in engine.data_loader:
                engine.optimizer.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                engine.optimizer.step()
        return engine

    def minus_loss(model, dataset):
        xs, ys = dataset.tensors
        with torch.no_grad():
            return (-F.cross_entropy(model(xs), ys, reduction="none")).numpy()

    return black_box_audit(train, data, canaries, minus_loss, seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canaries", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--runs", type=int, default=200, help="trainings of the multi-run audit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", default="power,correct,broken,multi,black-box,training",
                        help="which rows: power (ε = 8, q = 1, 0.5, 0.1), correct (other components), "
                             "broken, multi, black-box, training")
    args = parser.parse_args()
    rows = set(args.rows.split(","))
    torch.set_num_threads(1)
    full = dict(canaries=args.canaries, steps=args.steps, seed=args.seed)
    power = [
        ("auto-s, all-layer, q = 1, ε = 8", dict(sample_rate=1.0, target_epsilon=8.0)),
        ("auto-s, all-layer, q = 0.5, ε = 8", dict(sample_rate=0.5, target_epsilon=8.0)),
        ("auto-s, all-layer, q = 0.1, ε = 8", dict(sample_rate=0.1, target_epsilon=8.0)),
    ]
    correct = [
        ("auto-s, all-layer, q = 1, ε = 2", dict(sample_rate=1.0, target_epsilon=2.0)),
        ("auto-v, q = 0.5, ε = 8", dict(sample_rate=0.5, target_epsilon=8.0, clipping="auto-v")),
        ("psac, q = 0.5, ε = 8", dict(sample_rate=0.5, target_epsilon=8.0, clipping="psac")),
        ("abadi, q = 0.5, ε = 8", dict(sample_rate=0.5, target_epsilon=8.0, clipping="abadi")),
        ("auto-s, per-layer, q = 0.5, ε = 8", dict(sample_rate=0.5, target_epsilon=8.0, groups="per-layer")),
        ("abadi, per-layer, adaptive thresholds, q = 0.5, ε = 8",
         dict(sample_rate=0.5, target_epsilon=8.0, clipping="abadi", groups="per-layer",
              thresholds="adaptive")),
        ("auto-s, adaptive thresholds, q = 0.5, ε = 8",
         dict(sample_rate=0.5, target_epsilon=8.0, thresholds="adaptive")),
        ("auto-s, HyFreeDP lr, q = 0.5, ε = 8", dict(sample_rate=0.5, target_epsilon=8.0, lr="hyfreedp")),
    ]
    print(f"m = {args.canaries} canaries, T = {args.steps} steps, δ = 1e-5, confidence 95%, "
          f"{torch.get_num_threads()} thread(s)\n")
    print("| configuration | claimed ε | ε_LB | ε_LB/ε | (ε, δ) bound | f-DP bound | right guesses | "
          "noise ratio | separation ratio | verdict | time |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    chosen = (power if "power" in rows else []) + (correct if "correct" in rows else [])
    for name, options in chosen:
        result, seconds = _timed(lambda: one_run_audit(AuditSettings(**full, **options)))  # noqa: B023
        print(_row(name, result, seconds), flush=True)
    for broken, patch in BROKEN.items() if "broken" in rows else ():
        for rate, epsilon in ((1.0, 2.0), (0.5, 2.0)):
            if broken.startswith("sampling") and rate == 1.0:
                continue
            with patch() if patch else contextlib.nullcontext():
                result, seconds = _timed(lambda: one_run_audit(AuditSettings(  # noqa: B023
                    **full, sample_rate=rate, target_epsilon=epsilon)))  # noqa: B023
            print(_row(f"BROKEN: {broken}, q = {rate}, ε = {epsilon}", result, seconds), flush=True)
    for epsilon in (2.0, 8.0) if "multi" in rows else ():
        result, seconds = _timed(lambda: multi_run_audit(AuditSettings(  # noqa: B023
            sample_rate=1.0, steps=1, target_epsilon=epsilon, real_examples=8, seed=args.seed),  # noqa: B023
            args.runs))
        print(_row(f"multi-run Clopper–Pearson, {args.runs} runs, T = 1, q = 1, ε = {epsilon:g}", result,
                   seconds), flush=True)
    if "black-box" in rows:
        result, seconds = _timed(lambda: _digits_black_box(args.seed))
        print(_row("black box: digits MLP, 200 mislabelled canaries, ε = 8 (loose)", result, seconds))
    if "training" in rows:
        result, seconds = _timed(lambda: _digits_training_audit(args.seed, args.canaries, args.steps))
        print(_row(f"training canaries: digits MLP, make_private(audit_canaries={args.canaries}), q = 0.5, "
                   "ε = 8", result, seconds))


if __name__ == "__main__":
    main()
