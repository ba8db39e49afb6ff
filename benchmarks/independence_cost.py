"""Cost of the example-independence check: one check against one private step, and over a whole run.

A private run checks example independence on its first step and then on each step with probability
1/``verify_every`` (16 by default), at steps drawn from the run's randomness; each check perturbs a random
half of the batch in one forward pass and silences another half in one backward pass, on the whole batch.
On a checked step the Poisson loader also hands out its float tensors as copies of leaves that require
gradients and the model's inputs are checked against them (``tunefree.data.provenance``).

Default: median (and range) time of one check of each kind (a forward probe, a gradient probe, and the
first check, which runs both), each on a random half as a run draws it, against one private step
(forward, backward, clipping, noise, ledger) of the same model, interleaved, one thread. Times are the
process's CPU time (one thread), which other processes on a shared machine disturb far less than the
wall clock.
``--run``: the time of a whole run of ``--steps`` steps through the Poisson loader (q = ¼), with the
checks at their default rate, against the same run with every check switched off, interleaved.
``--provenance``: the CPU time per step of what the loader's provenance adds to an unchecked step.
``--memory``: the peak memory of three private steps with the check (the first step runs it) and
without it, each in a fresh process (glibc told to map every block over 128 KiB on its own, so that the
process's peak RSS is the memory in use rather than what the allocator kept).

    python benchmarks/independence_cost.py --repeats 5 [--run --steps 64] [--memory]
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
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.data.poisson import StepSchedule
from tunefree.data.provenance import hand_out
from tunefree.persample.independence import Probes
from tunefree.persample.inputs import InputProvenance

sys.path.insert(0, str(Path(__file__).parent))
from models import BENCHMARKS, benchmark  # noqa: E402


def _seconds(fn) -> float:
    """CPU seconds of ``fn`` (one thread: what it costs, whatever else the machine runs)."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def _summary(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:8.1f}ms [{min(times) * 1e3:.1f}–{max(times) * 1e3:.1f}]"


KINDS = ("forward probe", "gradient probe", "first check")


def measure_check(name: str, repeats: int) -> dict[str, list[float]]:
    """Times of one check of each kind (a forward probe, a gradient probe, the first check's both, each on
    a random half as a run draws it) and of one private step of ``name``, interleaved."""
    torch.manual_seed(0)
    model, x, y, loss_fn = benchmark(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    engine = tunefree.make_private(model, optimizer, loader, noise_multiplier=1.0, target_delta=1e-3,
                                   poisson_sampling=False, seed=0)
    engine.optimizer.verify_every = 10**9  # the step measured below runs no check

    def step():
        engine.optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        engine.optimizer.step()

    step()  # warm-up; its release ran the first check once
    times: dict[str, list[float]] = {kind: [] for kind in (*KINDS, "step")}
    for k in range(repeats):
        both = engine.optimizer.probes.probes(k + 2, len(x), both=True)
        kinds = {"forward probe": Probes(both.perturbed, ()), "gradient probe": Probes((), both.zeroed),
                 "first check": both}
        for kind, probes in kinds.items():
            times[kind].append(_seconds(lambda probes=probes: tunefree.verify_example_independence(
                model, engine.clipping_engine, (x,), probes=probes)))
        times["step"].append(_seconds(step))
    return times


def _run(name: str, steps: int, mode: str) -> tuple[float, int]:
    """Seconds of a run of ``steps`` private steps of ``name`` through the Poisson loader (q = ¼):
    ``"checked"`` as a run is (the independence and input checks at their default rate), ``"unchecked"``
    with no check at all (for this measurement only). Returns the CPU seconds and the checked steps."""
    torch.manual_seed(0)
    model, x, y, loss_fn = benchmark(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = TensorDataset(x.repeat(4, *[1] * (x.dim() - 1)), y.repeat(4, *[1] * (y.dim() - 1)))
    engine = tunefree.make_private(model, optimizer, DataLoader(data, batch_size=len(x)),
                                   noise_multiplier=1.0, target_delta=1e-4, steps=steps, seed=0)
    if mode != "checked":
        engine.optimizer.verified, engine.optimizer.verify_every = True, 10**9
        engine.clipping_engine.retain_inputs = engine.schedule.checking = False
    start, checked = time.process_time(), 0
    while engine.steps < steps:
        for xb, yb in engine.data_loader:
            checked += engine.schedule.handed_out.checking
            engine.optimizer.zero_grad()
            loss_fn(model(xb), yb).backward()
            engine.optimizer.step()
            if engine.steps == steps:
                break
    return time.process_time() - start, checked


MODES = ("checked", "unchecked")


def provenance_per_step(repeats: int = 2000) -> tuple[float, float]:
    """CPU µs per step of what provenance adds to an unchecked step (the loader tagging a batch of
    resnet9's shape, the model call taking the tags off and checking the batch, a loss computed with a
    tagged target), and of the same loss on plain tensors."""
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    out = torch.randn(64, 10, requires_grad=True)
    schedule = StepSchedule()
    check = InputProvenance(schedule)

    def tagged() -> None:
        (xb, yb), schedule.handed_out = hand_out([x, y], 1, len(x), checking=False)
        check.model_call((xb,), {}, training=True)
        F.cross_entropy(out, yb)

    def untagged() -> None:
        F.cross_entropy(out, y)

    def per_call(fn) -> float:
        return _seconds(lambda: [fn() for _ in range(repeats)]) / repeats * 1e6
    return per_call(tagged), per_call(untagged)


def measure_run(name: str, steps: int, repeats: int) -> tuple[dict[str, list[float]], int]:
    """Run times of each mode, interleaved, and the checked steps of the (seeded) checked run."""
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    checked = 0
    for _ in range(repeats):
        for mode in MODES:
            seconds, count = _run(name, steps, mode)
            times[mode].append(seconds)
            checked = max(checked, count)
    return times, checked


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
        engine.optimizer.verified, engine.optimizer.verify_every = True, 10**9
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
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--run", action="store_true")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--provenance", action="store_true")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="poisson_sampling=False")
    warnings.filterwarnings("ignore", message="training past the planned")
    if args.child:
        peak_memory_child(args.child[0], args.child[1] == "1")
        return
    if args.memory:
        print(f"{'model':<10} {'with check':>11} {'without':>9}")
        for name in args.models:
            print(f"{name:<10} {peak_memory(name, True):9.0f}MB {peak_memory(name, False):7.0f}MB")
        return
    if args.provenance:
        tagged, untagged = provenance_per_step()
        print(f"tagged batch, model call and loss: {tagged:.0f} µs; the loss alone: {untagged:.0f} µs")
        return
    if args.run:
        print(f"{'model':<10} {'checked (as a run is)':>28} {'no check':>28} {'checks':>7} "
              f"{'checked steps':>13}")
        for name in args.models:
            times, checked = measure_run(name, args.steps, args.repeats)
            median = {mode: statistics.median(t) for mode, t in times.items()}
            print(f"{name:<10} " + " ".join(f"{_summary(times[mode]):>28}" for mode in MODES)
                  + f" {median['checked'] / median['unchecked'] - 1:7.1%} {checked:>6}/{args.steps}")
        return
    print(f"{'model':<10} {'private step':>28} " + " ".join(f"{kind + ' / step':>26}" for kind in KINDS))
    for name in args.models:
        times = measure_check(name, args.repeats)
        step = statistics.median(times["step"])
        print(f"{name:<10} {_summary(times['step']):>28} " + " ".join(
            f"{_summary(times[kind]):>18} {statistics.median(times[kind]) / step:5.2f}x" for kind in KINDS))


if __name__ == "__main__":
    main()
