"""Flat vs per-layer clipping, fixed vs adaptive thresholds, on digits at ε = 3 (3 seeds).

    python benchmarks/adaptive_digits.py [--clipping auto-s abadi] [--seeds 0 1 2]

Every variant uses the CLI's default model, optimizer and learning rate; only the grouping and the
thresholds differ. Fixed per-layer thresholds are R/√L; adaptive ones start there and track the median
(target quantile 0.5) with 1% of the budget.
"""

from __future__ import annotations

import argparse
import statistics

from tunefree.cli import preprocess
from tunefree.cli.training import TrainConfig, train

VARIANTS = {
    "flat, fixed": {"groups": "all-layer", "thresholds": "fixed"},
    "per-layer, fixed (R/√L)": {"groups": "per-layer", "thresholds": "fixed"},
    "per-layer, adaptive": {"groups": "per-layer", "thresholds": "adaptive"},
    "flat, adaptive": {"groups": "all-layer", "thresholds": "adaptive"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clipping", nargs="+", default=["auto-s", "abadi"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epsilon", type=float, default=3.0)
    args = parser.parse_args()
    data = preprocess.load("digits")
    print(f"| clipping | variant | test accuracy (mean ± sd over seeds {args.seeds}) | min | ε |")
    print("|---|---|---|---|---|")
    for clipping in args.clipping:
        for name, variant in VARIANTS.items():
            results = []
            for seed in args.seeds:
                config = TrainConfig(epsilon=args.epsilon, clipping=clipping, seed=seed, quiet=True,
                                     **variant)
                results.append(train(config, data))
            accuracies = [r["test_accuracy"] for r in results]
            eps = max(r["epsilon"] for r in results)
            print(f"| {clipping} | {name} | {statistics.mean(accuracies):.4f} ± "
                  f"{statistics.stdev(accuracies):.4f} | {min(accuracies):.4f} | {eps:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
