"""One-time cost of the example-independence check, against one private step of the same model.

``make_private`` runs ``tunefree.verify_example_independence`` once, before the first release (and every
``verify_every`` steps if asked). This measures, for each benchmark model, the median time of one check
and of one private step (forward, backward, clipping, noise, ledger), in one process with one thread;
and, with ``--memory``, the peak memory of three private steps with the check (the first step runs it) and
without it, each in a fresh process (glibc told to map every block over 128 KiB on its own, so that the
process's peak RSS is the memory in use rather than what the allocator kept).

    python benchmarks/independence_cost.py --repeats 3 [--memory]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
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


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory_child(name: str, check: bool) -> None:
    """Print the peak memory (MB above the model's own) of three private steps of ``name``."""
    torch.manual_seed(0)
    model, x, y, loss_fn = benchmark(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    engine = tunefree.make_private(model, optimizer, loader, noise_multiplier=1.0, target_delta=1e-3,
                                   groups="per-layer", poisson_sampling=False)
    if not check:  # for this measurement only: mark the check as done
        engine.optimizer.verified = True
    Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark
    start = _rss_mb("VmRSS")
    for _ in range(3):
        engine.optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        engine.optimizer.step()
    print(_rss_mb("VmHWM") - start)


def peak_memory(name: str, check: bool) -> float:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", name, str(int(check))], env=env,
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(BENCHMARKS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="poisson_sampling=False")
    if args.child:
        peak_memory_child(args.child[0], args.child[1] == "1")
        return
    if args.memory:
        print(f"{'model':<10} {'with check':>11} {'without':>9}")
        for name in args.models:
            print(f"{name:<10} {peak_memory(name, True):9.0f}MB {peak_memory(name, False):7.0f}MB")
        return
    print(f"{'model':<10} {'check':>10} {'step':>10} {'check/step':>11}")
    for name in args.models:
        check, step = measure(name, args.repeats)
        print(f"{name:<10} {check * 1e3:8.1f}ms {step * 1e3:8.1f}ms {check / step:10.2f}x")


if __name__ == "__main__":
    main()
