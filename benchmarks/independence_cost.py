"""Cost of the checks that watch the model (example independence, the model's function): one check against
one private step, and over a whole run.

A private run checks its first step with certainty for every pair (one forward with gradients, 1 +
⌈log₆₄ n⌉ backward passes to the units' tensors, and the forward check's extra forwards, one per pass of
its partitions: 5 for 64 examples, 6 for 256), then each step with probability 1/``verify_every`` (24
by default) at steps drawn from the run's randomness, the forward check on one random half (one extra
forward; the backward passes as in the first check). On a checked step the model's function is also
probed on two rows before the step's first forward and before its release (``guards/purity.py``), the
Poisson loader hands out its float tensors as copies of leaves that require gradients and the model's
inputs are checked against them.

Default: median (and range) time of the first check and of a later check against one private step
(forward, backward, clipping, noise, ledger) of the same model, interleaved, one thread. Times are the
process's CPU time (one thread), which other processes on a shared machine disturb far less than the wall
clock.
``--run``: the time of a whole run of ``--steps`` steps through the Poisson loader (q = ¼), with the
checks at their default rate, against the same run with every check switched off, interleaved; and, in
the checked runs, the CPU time spent inside the checks (independence and the function probes: their
share of the run), what the checked steps cost beyond as many unchecked steps of the same run (the
probes, the input check and anything else: less noisy than the A/B of whole runs on a shared machine),
and the first check, at step 1 of each run, against the median step of the unchecked runs.
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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.data.poisson import StepSchedule
from tunefree.data.provenance import hand_out
from tunefree.guards import independence
from tunefree.guards.independence import Independence, verify_example_independence
from tunefree.guards.inputs import InputProvenance
from tunefree.guards.purity import Purity

sys.path.insert(0, str(Path(__file__).parent))
from models import BENCHMARKS, benchmark  # noqa: E402


def _seconds(fn) -> float:
    """CPU seconds of ``fn`` (one thread: what it costs, whatever else the machine runs)."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def _summary(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:8.1f}ms [{min(times) * 1e3:.1f}–{max(times) * 1e3:.1f}]"


KINDS = ("first check (every pair)", "later check (random half)")


def _without_checks(engine: tunefree.DPEngine) -> None:
    """For a measurement only: no step of ``engine`` is checked from now on."""
    guard = engine.guards.of(Independence)
    guard.first_done, guard.verify_every = True, 10**9
    engine.schedule.checking = False


def measure_check(name: str, repeats: int) -> dict[str, list[float]]:
    """Times of the first check (the code's masks: every pair), of a later check (one random half as a
    run draws it) and of one private step of ``name``, interleaved."""
    torch.manual_seed(0)
    model, x, y, loss_fn = benchmark(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    engine = tunefree.make_private(model, optimizer, loader, noise_multiplier=1.0, target_delta=1e-3,
                                   poisson_sampling=False, seed=0)

    def step():
        engine.optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        engine.optimizer.step()

    step()  # warm-up; its release ran the first check once
    _without_checks(engine)  # the step measured below runs no check
    schedule = engine.guards.of(Independence).probes
    times: dict[str, list[float]] = {kind: [] for kind in (*KINDS, "step")}
    for k in range(repeats):
        kinds = dict(zip(KINDS, (schedule.levels(1, len(x), first=True),
                                 schedule.levels(k + 2, len(x), first=False))))
        for kind, levels in kinds.items():
            times[kind].append(_seconds(lambda levels=levels: verify_example_independence(
                model, engine.clipper, (x,), levels=levels)))
        times["step"].append(_seconds(step))
    return times


@dataclass
class Run:
    """One run: its CPU seconds, each step's (and whether it was checked), and the CPU seconds inside
    the independence checks (by step)."""

    seconds: float
    steps: list[float]
    checked_steps: list[bool]
    checks: dict[int, float]

    @property
    def checked(self) -> int:
        return sum(self.checked_steps)

    def excess(self) -> float:
        """What the checked steps cost beyond as many unchecked steps of this run (their median): the
        probes, the input check and all else a checked step does, as a share of the run."""
        unchecked = statistics.median([t for t, c in zip(self.steps, self.checked_steps) if not c])
        return sum(t - unchecked for t, c in zip(self.steps, self.checked_steps) if c) / self.seconds


def _run(name: str, steps: int, mode: str) -> Run:
    """A run of ``steps`` private steps of ``name`` through the Poisson loader (q = ¼): ``"checked"`` as
    a run is (the independence and input checks at their default rate), ``"unchecked"`` with no check at
    all (for this measurement only)."""
    torch.manual_seed(0)
    model, x, y, loss_fn = benchmark(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = TensorDataset(x.repeat(4, *[1] * (x.dim() - 1)), y.repeat(4, *[1] * (y.dim() - 1)))
    engine = tunefree.make_private(model, optimizer, DataLoader(data, batch_size=len(x)),
                                   noise_multiplier=1.0, target_delta=1e-4, steps=steps, seed=0)
    if mode != "checked":
        _without_checks(engine)
    checks: dict[int, float] = {}
    check, probe_pass = independence.check, Purity._pass

    def timed(function):
        def run(*args, **kwargs):
            start = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                step = engine.steps + 1
                checks[step] = checks.get(step, 0.0) + time.process_time() - start
        return run

    independence.check, Purity._pass = timed(check), timed(probe_pass)
    start, flags, per_step = time.process_time(), [], []
    try:
        while engine.steps < steps:
            for xb, yb in engine.data_loader:
                begin = time.process_time()
                flags.append(engine.schedule.handed_out.checking)
                engine.optimizer.zero_grad()
                loss_fn(model(xb), yb).backward()
                engine.optimizer.step()
                per_step.append(time.process_time() - begin)
                if engine.steps == steps:
                    break
    finally:
        independence.check, Purity._pass = check, probe_pass
    return Run(time.process_time() - start, per_step, flags, checks)


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


def measure_run(name: str, steps: int, repeats: int) -> dict[str, list[Run]]:
    """Runs of each mode, interleaved."""
    runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
    _run(name, 2, "unchecked")  # warm-up: the process's and the model's first steps are slower
    for _ in range(repeats):
        for mode in MODES:
            runs[mode].append(_run(name, steps, mode))
    return runs


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
    if not check:  # for this measurement only: no check
        _without_checks(engine)
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
        print(f"{'model':<10} {'checked (as a run is)':>24} {'no check':>24} {'A/B':>7} {'in checks':>16} "
              f"{'checked steps excess':>20} {'1st check/step':>17} {'checked':>8}")
        for name in args.models:
            runs = measure_run(name, args.steps, args.repeats)
            times = {mode: [r.seconds for r in runs[mode]] for mode in MODES}
            median = {mode: statistics.median(t) for mode, t in times.items()}
            share = [sum(r.checks.values()) / r.seconds for r in runs["checked"]]
            step = statistics.median([s for r in runs["unchecked"] for s in r.steps])
            first = [r.checks.get(1, 0.0) / step for r in runs["checked"]]
            excess = [r.excess() for r in runs["checked"]]
            print(f"{name:<10} " + " ".join(f"{_summary(times[mode]):>24}" for mode in MODES)
                  + f" {median['checked'] / median['unchecked'] - 1:7.1%} "
                  + f"{statistics.median(share):5.1%} [{min(share):.1%}–{max(share):.1%}] "
                  + f"{statistics.median(excess):5.1%} [{min(excess):.1%}–{max(excess):.1%}] "
                  + f"{statistics.median(first):5.2f} [{min(first):.2f}–{max(first):.2f}] "
                  + f"{runs['checked'][0].checked:>6}/{args.steps}")
        return
    print(f"{'model':<10} {'private step':>28} " + " ".join(f"{kind + ' / step':>26}" for kind in KINDS))
    for name in args.models:
        times = measure_check(name, args.repeats)
        step = statistics.median(times["step"])
        print(f"{name:<10} {_summary(times['step']):>28} " + " ".join(
            f"{_summary(times[kind]):>18} {statistics.median(times[kind]) / step:5.2f}x" for kind in KINDS))


if __name__ == "__main__":
    main()
