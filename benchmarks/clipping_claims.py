"""The clipping papers' claims, measured on the four tasks of ``benchmarks/utility.py``: AUTO-S against
a tuned Abadi grid, PSAC and AUTO-V against AUTO-S, fixed and adaptive per-layer clipping against flat
(all-layer) clipping, with Abadi and with automatic clipping.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/clipping_claims.py --quick
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/clipping_claims.py --epsilons 3 --out claims.jsonl
    PYTHONPATH=src python benchmarks/clipping_claims.py --summarise claims.jsonl

Protocol. Every private run uses Poisson sampling and the σ calibrated once per (task, ε) for a plain
run of the planned length (adaptive thresholds spend the same ε: their count releases are paid inside
that σ, see ``make_private``). For each configuration the whole grid runs on seed 0 and the grid point
with the best *validation* accuracy is chosen; seeds 1 and 2 then run at that point only (more seeds
with ``--chosen``), and test accuracy is reported once, as mean ± sd over the seeds.

Grids. Automatic clipping (AUTO-S, AUTO-V, PSAC) has no threshold to tune: R = 1 (the library default;
it only rescales the update), γ = 0.01 for AUTO-S and r = 0.1 for PSAC (the library defaults, which
are the values the two papers recommend), and only the learning rate is searched, on utility.py's
grids. Abadi clipping searches R ∈ {0.1, 1, 10} and, with SGD, lr = base/R for every base of the SGD
grid: a clipped example contributes at most R, so lr·R is the step scale that AUTO-S's lr stands for,
and lr·R then covers the AUTO-S range at every R. With AdamW the update is (nearly) invariant to R, so
the AdamW grid is used unscaled. Adaptive thresholds track the median (q = 0.5, η = 0.3, 1% of the
budget; the group-wise paper's settings) and start at R's split; with Abadi clipping they use the
paper's rescaling C̃ₖ = C·Cₖ/√(Σⱼ Cⱼ²) (``AdaptiveQuantile(rescale=True)``), which the normalising
clip functions always apply.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import tunefree

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from utility import ADAMW_GRID, DELTA, SGD_GRID, TASKS, Task, accuracy  # noqa: E402

ABADI_THRESHOLDS = (0.1, 1.0, 10.0)


@dataclass(frozen=True)
class Config:
    """One way of clipping: the clip function, the grouping, fixed or adaptive thresholds, the optimizer."""

    clipping: str
    groups: str = "all-layer"
    adaptive: bool = False
    optimizer: str = "sgd"

    @property
    def name(self) -> str:
        return (f"{self.clipping} {self.groups} {'adaptive' if self.adaptive else 'fixed'} "
                f"{self.optimizer}")

    def grid(self, quick: bool = False) -> list[tuple[float, float]]:
        """(R, lr) points searched on validation."""
        base = {"sgd": SGD_GRID, "adamw": ADAMW_GRID}[self.optimizer]
        if quick:
            base = base[1:4:2]
        if self.clipping != "abadi":
            return [(1.0, lr) for lr in base]
        thresholds = ABADI_THRESHOLDS[::2] if quick else ABADI_THRESHOLDS
        if self.optimizer == "adamw":
            return [(r, lr) for r in thresholds for lr in base]
        return [(r, lr / r) for r in thresholds for lr in base]

    def thresholds(self) -> str | tunefree.AdaptiveQuantile:
        if not self.adaptive:
            return "fixed"
        return tunefree.AdaptiveQuantile(rescale=self.clipping == "abadi")


def configurations(adamw: bool) -> list[Config]:
    """Every clip function × {all-layer, per-layer} with fixed thresholds, adaptive per-layer for Abadi
    and AUTO-S; with ``adamw`` also flat Abadi and flat AUTO-S under AdamW."""
    configs = [Config(clip, groups) for clip in ("abadi", "auto-s", "auto-v", "psac")
               for groups in ("all-layer", "per-layer")]
    configs += [Config(clip, "per-layer", adaptive=True) for clip in ("abadi", "auto-s")]
    if adamw:
        configs += [Config(clip, optimizer="adamw") for clip in ("abadi", "auto-s")]
    return configs


def run(task: Task, config: Config, max_grad_norm: float, lr: float, sigma: float, seed: int) -> dict:
    """One private training run of ``task`` under ``config``; accuracies, ε from the ledger, time."""
    torch.manual_seed(seed)
    model = task.model()
    optimizer = (torch.optim.SGD if config.optimizer == "sgd" else torch.optim.AdamW)(model.parameters(),
                                                                                       lr=lr)
    loader = DataLoader(task.train, batch_size=task.batch_size)
    steps = math.ceil(task.epochs * len(task.train) / task.batch_size)
    engine = tunefree.make_private(model, optimizer, loader, noise_multiplier=sigma, target_delta=DELTA,
                                   steps=steps, clipping=config.clipping, max_grad_norm=max_grad_norm,
                                   groups=config.groups, thresholds=config.thresholds(), seed=seed)
    start, taken = time.perf_counter(), 0
    while taken < steps:
        for x, y in engine.data_loader:
            engine.optimizer.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            (losses.mean() if len(y) else losses.sum()).backward()
            engine.optimizer.step()
            taken += 1
            if taken == steps:
                break
    seconds = time.perf_counter() - start
    engine.detach()
    model.eval()
    return {"valid": accuracy(model, task.valid), "test": accuracy(model, task.test),
            "epsilon": engine.epsilon(), "steps": steps, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--epsilons", nargs="+", type=float, default=[3.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                        help="the first searches the grid; the others run at its chosen point")
    parser.add_argument("--adamw", action="store_true", help="also flat Abadi and AUTO-S under AdamW")
    parser.add_argument("--quick", action="store_true", help="digits-mlp, ε = 3, seed 0, a 2-point grid")
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    parser.add_argument("--chosen", default=None,
                        help="JSON lines of earlier runs: no search, every seed runs at their chosen points")
    parser.add_argument("--summarise", default=None, help="print the table of a JSON-lines file and exit")
    args = parser.parse_args()
    if args.summarise:
        summarise(args.summarise)
        return
    if args.quick:
        args.tasks, args.epsilons, args.seeds = ["digits-mlp"], [3.0], [0]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    chosen = chosen_runs(args.chosen) if args.chosen else {}
    sink = open(args.out, "a") if args.out else None  # noqa: SIM115
    for name in args.tasks:
        task = TASKS[name]()
        steps = math.ceil(task.epochs * len(task.train) / task.batch_size)
        for epsilon in args.epsilons:
            sigma = tunefree.noise_multiplier(target_epsilon=epsilon, sample_rate=task.batch_size
                                              / len(task.train), steps=steps, delta=DELTA)
            for config in configurations(args.adamw):
                if args.chosen:
                    best, repeats = chosen[(name, epsilon, config.name)][0], args.seeds
                else:
                    search, *repeats = args.seeds
                    results = []
                    for r, lr in config.grid(args.quick):
                        record = {"task": name, "privacy": epsilon, "sigma": sigma, "config": config.name,
                                  "R": r, "lr": lr, "seed": search, "search": True,
                                  **run(task, config, r, lr, sigma, search)}
                        results.append(_emit(record, sink))
                    best = max(results, key=lambda record: record["valid"])
                for seed in repeats:
                    _emit({**best, "seed": seed, "search": False,
                           **run(task, config, best["R"], best["lr"], sigma, seed)}, sink)
    if sink:
        sink.close()


def _emit(record: dict, sink) -> dict:
    line = json.dumps(record)
    print(line, flush=True)
    if sink:
        sink.write(line + "\n")
        sink.flush()
    return record


CLAIMS = (  # (claim, configuration, the one it is compared with); Δ = first − second
    ("AUTO-S vs tuned Abadi (SGD)", "auto-s all-layer fixed sgd", "abadi all-layer fixed sgd"),
    ("AUTO-S vs tuned Abadi (AdamW)", "auto-s all-layer fixed adamw", "abadi all-layer fixed adamw"),
    ("PSAC vs AUTO-S", "psac all-layer fixed sgd", "auto-s all-layer fixed sgd"),
    ("AUTO-V vs AUTO-S", "auto-v all-layer fixed sgd", "auto-s all-layer fixed sgd"),
    ("fixed per-layer vs flat, Abadi", "abadi per-layer fixed sgd", "abadi all-layer fixed sgd"),
    ("fixed per-layer vs flat, AUTO-S", "auto-s per-layer fixed sgd", "auto-s all-layer fixed sgd"),
    ("adaptive per-layer vs flat, Abadi", "abadi per-layer adaptive sgd", "abadi all-layer fixed sgd"),
    ("adaptive per-layer vs flat, AUTO-S", "auto-s per-layer adaptive sgd", "auto-s all-layer fixed sgd"),
)


def chosen_runs(path: str) -> dict[tuple, tuple[dict, list[dict]]]:
    """(task, ε, configuration) → (the seed-0 run chosen on validation, every run at its grid point)."""
    with open(path) as lines:
        rows = [json.loads(line) for line in lines]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["privacy"], row["config"]), []).append(row)
    chosen = {}
    for key, runs in groups.items():
        best = max((r for r in runs if r["search"]), key=lambda r: r["valid"])
        chosen[key] = best, [r for r in runs if (r["R"], r["lr"]) == (best["R"], best["lr"])]
    return chosen


def summarise(path: str) -> None:
    """For each ε a markdown table (a row per configuration, a column per task; a cell is the test accuracy
    at the valid-chosen grid point, mean ± sd over the seeds run there, then the mean validation accuracy
    and the point, ``*`` when it is at the edge of the grid), then each claim's difference in mean test
    accuracy ± its standard error (unpaired), in points."""
    chosen = chosen_runs(path)
    tasks = list(dict.fromkeys(task for task, _, _ in chosen))
    for epsilon in sorted({epsilon for _, epsilon, _ in chosen}):
        epsilons = {round(r["epsilon"], 3) for key, (_, runs) in chosen.items() if key[1] == epsilon
                    for r in runs}
        print(f"\nε = {epsilon:g} (ledger: {', '.join(map(str, sorted(epsilons)))})\n")
        print("| configuration | " + " | ".join(tasks) + " |")
        print("|---" * (len(tasks) + 1) + "|")
        for config in dict.fromkeys(c for _, e, c in chosen if e == epsilon):
            cells = [_cell(path, chosen, (task, epsilon, config)) for task in tasks]
            print(f"| {config} | " + " | ".join(cells) + " |")
        print()
        for claim, first, second in CLAIMS:
            cells = []
            for task in tasks:
                if (task, epsilon, first) in chosen and (task, epsilon, second) in chosen:
                    tests = [[r["test"] for r in chosen[(task, epsilon, c)][1]] for c in (first, second)]
                    error = (math.sqrt(sum(statistics.variance(t) / len(t) for t in tests))
                             if min(map(len, tests)) > 1 else math.nan)
                    difference = statistics.mean(tests[0]) - statistics.mean(tests[1])
                    cells.append(f"{task} {100 * difference:+.1f} ± {100 * error:.1f}")
            print(f"- {claim}: " + ", ".join(cells))


def _cell(path: str, chosen: dict, key: tuple) -> str:
    if key not in chosen:
        return "–"
    best, runs = chosen[key]
    test = [r["test"] for r in runs]
    spread = f"{statistics.stdev(test):.3f}" if len(test) > 1 else "?"
    lrs = sorted({r["lr"] for r in _searched(path, *key) if r["R"] == best["R"]})
    edge = "*" if best["lr"] in (lrs[0], lrs[-1]) else ""
    point = f"lr {best['lr']:.3g}" if key[2].startswith("auto") or key[2].startswith("psac") else \
        f"R {best['R']:g}, lr {best['lr']:.3g}"
    return (f"{statistics.mean(test):.3f} ± {spread} (v {statistics.mean(r['valid'] for r in runs):.3f}; "
            f"{point}{edge}; n={len(test)})")


def _searched(path: str, task: str, epsilon: float, config: str) -> list[dict]:
    with open(path) as lines:
        return [row for row in map(json.loads, lines) if row["search"]
                and (row["task"], row["privacy"], row["config"]) == (task, epsilon, config)]


if __name__ == "__main__":
    main()
