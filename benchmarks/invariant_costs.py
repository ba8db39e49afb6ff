"""What the invariants of issue 21 cost: the state guard per private step, and the data digest once.

Guard: a private step (q = 1 over the benchmark's batch: forward, backward, ``optimizer.step()``) on each
model; the time spent inside the guard's methods (every entry point of ``StateGuard``: the points of the
step, the flags it hands the engine's transfer, its checks and renewals; nested calls counted once) is
accumulated per step, wall and CPU (thread) time, and the same loop is timed with those methods turned into
no-ops, interleaved step by step (A/B), for the overall difference. The guard's operators per step: the aten
operators dispatched inside those methods in one more step, less views and metadata (no kernel: a view,
``detach``), i.e. the kernel launches on a GPU. Digest: ``data_digest`` of a 60 000 × 784 float32
TensorDataset (the MNIST shape) and of the same rows behind a plain map-style Dataset (one ``__getitem__``
per example).

    OMP_NUM_THREADS=1 python benchmarks/invariant_costs.py --steps 10 --digest

The tiny Hugging Face models: ``--models bert-tiny gpt2-tiny``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from contextlib import contextmanager

import torch
from models import BENCHMARKS, HF_BENCHMARKS, SMALL_BENCHMARKS, benchmark
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset, TensorDataset

import tunefree
from tunefree.guards.state import StateGuard
from tunefree.privacy.plan import data_digest

# StateGuard's entry points, each with what it returns when the guard is off (those absent are skipped)
GUARDED = {"before_forward": None, "before_release": None, "before_update": None, "after_update": None,
           "after_probes": None, "carried": None, "carried_read": None, "check": None, "updated": None,
           "snapshot": None}
_NO_KERNEL = {torch.ops.aten.detach, torch.ops.aten.lift_fresh, torch.ops.aten.alias}


class GuardClock:
    """Accumulates the wall and CPU time spent inside the guard's methods (the outermost call), and
    counts their kernel-launching operators while ``counting``; ``off`` makes them no-ops."""

    def __init__(self) -> None:
        self.seconds, self.cpu_seconds, self.off, self.depth = 0.0, 0.0, False, 0
        self.ops: Counter[str] = Counter()
        self._originals = {name: getattr(StateGuard, name) for name in GUARDED if hasattr(StateGuard, name)}

    def install(self) -> None:
        for name, method in self._originals.items():
            def timed(guard, *args, _method=method, _off=GUARDED[name], **kwargs):
                if self.off:
                    return _off
                if self.depth:
                    return _method(guard, *args, **kwargs)
                self.depth += 1
                start, cpu = time.perf_counter(), time.thread_time()
                try:
                    return _method(guard, *args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start
                    self.cpu_seconds += time.thread_time() - cpu
                    self.depth -= 1
            setattr(StateGuard, name, timed)

    def renew(self, guard: StateGuard) -> None:
        self._originals["snapshot"](guard)

    @contextmanager
    def disabled(self):
        self.off = True
        try:
            yield
        finally:
            self.off = False

    @contextmanager
    def counting(self):
        """Count the operators dispatched inside the guard's methods in the block."""
        clock = self

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if clock.depth and not func.is_view and func.overloadpacket not in _NO_KERNEL:
                    clock.ops[str(func.overloadpacket)] += 1
                return func(*args, **(kwargs or {}))

        with Count():
            yield


def private_step(engine: tunefree.DPEngine, loss_fn) -> float:
    start = time.perf_counter()
    x, y = next(iter(engine.data_loader))
    engine.optimizer.zero_grad()
    loss_fn(engine.model(x), y).backward()
    engine.optimizer.step()
    return time.perf_counter() - start


def guard_cost(name: str, steps: int, clock: GuardClock) -> dict[str, float]:
    model, x, y, loss_fn = benchmark(name)
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                   DataLoader(TensorDataset(x, y), batch_size=len(x)), target_delta=1e-5,
                                   noise_multiplier=1.0, steps=4 * steps + 4, seed=0)
    for _ in range(2):  # the first step checks example independence and times the norm paths
        private_step(engine, loss_fn)
    guarded, unguarded, inside, inside_cpu = [], [], [], []
    for _ in range(steps):
        before, before_cpu = clock.seconds, clock.cpu_seconds
        guarded.append(private_step(engine, loss_fn))
        inside.append(clock.seconds - before)
        inside_cpu.append(clock.cpu_seconds - before_cpu)
        with clock.disabled():
            unguarded.append(private_step(engine, loss_fn))
        clock.renew(engine.guards.of(StateGuard))  # untimed: the next guarded step starts from this state
    clock.ops.clear()
    private_step(engine, loss_fn)  # settle after the renewal (a step that needs no extra check)
    clock.ops.clear()
    with clock.counting():
        private_step(engine, loss_fn)
    params = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters())) + len(list(model.buffers()))
    return {"params": params, "tensors": tensors, "step_ms": 1e3 * statistics.median(guarded),
            "unguarded_ms": 1e3 * statistics.median(unguarded), "guard_ms": 1e3 * statistics.median(inside),
            "guard_cpu_ms": 1e3 * statistics.median(inside_cpu),
            "guard_min_ms": 1e3 * min(inside), "guard_max_ms": 1e3 * max(inside),
            "ops": sum(clock.ops.values()), "top_ops": clock.ops.most_common(4)}


class Rows(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def digest_cost(repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(60_000, 784, generator=g), torch.randint(0, 10, (60_000,), generator=g)
    timings: dict[str, list[float]] = {"TensorDataset": [], "map-style Dataset": []}
    for _ in range(repeats):
        for kind, data in (("TensorDataset", TensorDataset(x, y)), ("map-style Dataset", Rows(x, y))):
            start = time.perf_counter()
            data_digest(data, len(y))
            timings[kind].append(time.perf_counter() - start)
    return {kind: statistics.median(t) for kind, t in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=[*SMALL_BENCHMARKS, *BENCHMARKS],
                        help=f"of {[*SMALL_BENCHMARKS, *BENCHMARKS, *HF_BENCHMARKS]}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--digest", action="store_true", help="also time the data digest (3 repeats)")
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    clock = GuardClock()
    clock.install()
    for name in args.models:
        r = guard_cost(name, args.steps, clock)
        share = 100 * r["guard_ms"] / r["step_ms"]
        print(f"{name:11s} {r['params']:>9,d} params {r['tensors']:>4d} tensors | "
              f"step {r['step_ms']:8.1f} ms "
              f"(guard off {r['unguarded_ms']:8.1f} ms) | inside the guard {r['guard_ms']:6.2f} ms "
              f"[{r['guard_min_ms']:.2f}, {r['guard_max_ms']:.2f}] = {share:.2f}%, "
              f"CPU {r['guard_cpu_ms']:.2f} ms | {r['ops']} ops {r['top_ops']}")
    if args.digest:
        for kind, seconds in digest_cost(3).items():
            print(f"data_digest, 60 000 × 784 float32, {kind}: {seconds:.2f} s (median of 3)")


if __name__ == "__main__":
    main()
