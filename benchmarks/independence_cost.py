"""One-time cost of the example-independence check, against one private step of the same model.

``make_private`` runs ``tunefree.verify_example_independence`` once, before the first release (and every
``verify_every`` steps if asked). This measures, for each benchmark model, the median time of one check
and of one private step (forward, backward, clipping, noise, ledger), in one process with one thread.

    python benchmarks/independence_cost.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import tunefree

sys.path.insert(0, str(Path(__file__).parent))
from models import BENCHMARKS, benchmark  # noqa: E402


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, repeats: int) -> tuple[float, float]:
    """(check seconds, step seconds) of benchmark ``name``."""
    torch.manual_seed(0)
    model, x, y, loss_fn = benchmark(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    engine = tunefree.make_private(model, optimizer, loader, noise_multiplier=1.0, target_delta=1e-3,
                                   poisson_sampling=False)

    def step():
        engine.optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        engine.optimizer.step()

    step()  # warm-up; its release ran the check once
    check = _median_seconds(lambda: tunefree.verify_example_independence(
        model, engine.clipping_engine, (x,)), repeats)
    return check, _median_seconds(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(BENCHMARKS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="poisson_sampling=False")
    print(f"{'model':<10} {'check':>10} {'step':>10} {'check/step':>11}")
    for name in args.models:
        check, step = measure(name, args.repeats)
        print(f"{name:<10} {check * 1e3:8.1f}ms {step * 1e3:8.1f}ms {check / step:10.2f}x")


if __name__ == "__main__":
    main()
