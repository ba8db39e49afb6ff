"""HyFreeDP's learning rate (GeN-DP, ``--lr hyfreedp``) against a grid of fixed learning rates, on digits
at ε = 3 with AdamW.

    python benchmarks/autolr_digits.py [--seeds 0 1 2]

Prints three tables: test accuracy of the grid and of HyFreeDP for K = 1, 5, 10 (mean ± sd over the
seeds; the same budget for all, loss probes included for auto); training time per step with the
overhead of auto against the fixed-LR runs (runs interleaved so machine noise hits all alike); and the
loss noise σ_l that one joint accountant gives against the paper's separate accounting of the probes.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import replace

import dp_accounting as dpa
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import tunefree
from tunefree.cli import models, preprocess
from tunefree.cli.training import TrainConfig, default_delta, train
from tunefree.components.hyfreedp import LossShare
from tunefree.privacy.accounting import epsilon_of
from tunefree.privacy.calibrate import calibrate
from tunefree.privacy.plan import Plan

GRID = (0.001, 0.003, 0.01, 0.02, 0.03, 0.1)
INTERVALS = (1, 5, 10)


def separate_accounting(gradient_sigma: float, loss_sigma: float, q: float, steps: int,
                        interval: int) -> dpa.DpEvent:
    """The paper's accounting: the loss probes as if each were an independently sampled release."""
    updates = math.ceil(steps / interval)
    return dpa.ComposedDpEvent([
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(gradient_sigma)),
                                steps),
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(loss_sigma)),
                                3 * updates)])


def _timed_steps(data, interval: int | None, steps: int = 60, warmup: int = 5) -> float:
    """Median seconds per training step (forward, backward, private step; no evaluation)."""
    torch.manual_seed(0)
    model = models.build("auto", data.kind, data.input_shape, data.num_classes)
    engine = tunefree.make_private(
        model, torch.optim.AdamW(model.parameters(), lr=0.02),
        DataLoader(data.train, batch_size=256), noise_multiplier=3.0, target_delta=1e-5,
        steps=steps + warmup, seed=0,
        lr=tunefree.HyFreeDP(interval=interval) if interval else None)
    times = []
    while len(times) < steps + warmup:
        for x, y in engine.data_loader:
            start = time.perf_counter()
            engine.optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            engine.optimizer.step((lambda x=x, y=y: F.cross_entropy(model(x), y, reduction="none"))
                                  if interval else None)
            times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def step_overhead(data, rounds: int = 5) -> dict[int, list[float]]:
    """Time per step of HyFreeDP for each K over a fixed learning rate, interleaved by round."""
    ratios: dict[int, list[float]] = {k: [] for k in INTERVALS}
    for _ in range(rounds):
        fixed = _timed_steps(data, None)
        for k in INTERVALS:
            ratios[k].append(_timed_steps(data, k) / fixed)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--timing-only", action="store_true", help="only the step-time table")
    args = parser.parse_args()
    data = preprocess.load("digits")
    if args.timing_only:
        for k, ratios in step_overhead(data).items():
            print(f"| {k} | {statistics.median(ratios):.3f}× ({min(ratios):.3f}–{max(ratios):.3f}) |")
        return
    runs: dict[str, list[dict]] = {}
    for seed in args.seeds:  # interleaved: every configuration once per seed
        for lr in [*GRID, *(f"auto K={k}" for k in INTERVALS)]:
            auto = isinstance(lr, str)
            config = TrainConfig(epsilon=args.epsilon, optimizer="adamw", seed=seed, quiet=True,
                                 lr="hyfreedp" if auto else lr,
                                 lr_update_interval=int(lr.split("=")[1]) if auto else None)
            runs.setdefault(str(lr), []).append(train(config, data))
            result = runs[str(lr)][-1]
            print(f"seed {seed} lr {lr}: {result['test_accuracy']:.4f} ε {result['epsilon']:.3f}",
                  flush=True)

    print("\n| learning rate | test accuracy (mean ± sd) | min | ε (max over seeds) | s/step |")
    print("|---|---|---|---|---|")
    for name, results in runs.items():
        acc = [r["test_accuracy"] for r in results]
        per_step = statistics.mean(r["train_seconds"] / r["steps"] for r in results)
        print(f"| {name} | {statistics.mean(acc):.4f} ± {statistics.stdev(acc):.4f} | "
              f"{min(acc):.4f} | {max(r['epsilon'] for r in results):.3f} | {per_step * 1e3:.1f} ms |")

    print("\n| K | training step time vs a fixed learning rate (median over rounds, min–max) |")
    print("|---|---|")
    for k, ratios in step_overhead(data).items():
        print(f"| {k} | {statistics.median(ratios):.3f}× ({min(ratios):.3f}–{max(ratios):.3f}) |")

    n = len(data.train)
    q, steps, delta = 256 / n, runs[str(GRID[0])][0]["steps"], default_delta(n)
    sigma = runs[str(GRID[0])][0]["noise_multiplier"]
    print("\n| K | σ | σ_g = 1.01σ | σ_l (one joint accountant) | σ_l (paper: probes accounted "
          "separately) | ε of the joint σ_l if accounted separately |")
    print("|---|---|---|---|---|---|")
    sigma_g = 1.01 * sigma
    for k in INTERVALS:
        joint = runs[f"auto K={k}"][0]
        plan = Plan(q, steps, n, delta, noise_multiplier=sigma, shares=(LossShare(k),))

        def with_loss_noise(noise: float, plan: Plan = plan, k: int = k) -> Plan:
            return replace(plan, shares=(LossShare(k, noise=noise),))

        sigma_l_joint = calibrate(lambda s: with_loss_noise(s).event(), args.epsilon, delta)
        sigma_l_separate = calibrate(lambda s, k=k: separate_accounting(sigma_g, s, q, steps, k),
                                     args.epsilon, delta)
        under = epsilon_of(separate_accounting(sigma_g, sigma_l_joint, q, steps, k), delta)
        assert abs(joint["epsilon"] - with_loss_noise(sigma_l_joint).epsilon()) < 0.05
        print(f"| {k} | {sigma:.3f} | {sigma_g:.3f} | {sigma_l_joint:.2f} | {sigma_l_separate:.2f} "
              f"| {under:.3f} |")


if __name__ == "__main__":
    main()
