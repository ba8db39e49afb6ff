"""Where tunefree's fixed per-step time goes on a small model (issue 15, item 1): a breakdown in ms.

A training loop on the digits MLP (64 → 128 → 128 → 10, N examples, expected batch B, SGD, AUTO-S) over
the Poisson loader: each step is ``next(loader)`` + zero_grad + forward + backward + ``optimizer.step()``.
Each part of tunefree's work is timed *exclusively* (a timer around its methods, minus the time of any
other timed part inside it), so the parts add up to the step; "model forward + backward (torch)" is what
is left, the model's own arithmetic. The same loop is timed without instrumentation, and a non-private
step on a fixed batch (and over a shuffled ``DataLoader``) gives the reference.

    OMP_NUM_THREADS=1 python benchmarks/step_tax.py --groups all-layer --randomness secure
    OMP_NUM_THREADS=1 python benchmarks/step_tax.py --groups per-layer --randomness seeded --ops

Each configuration runs in this process only; run it several times on a quiet machine (``uptime``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.guards.base import Guards
from tunefree.persample.booking import Booking
from tunefree.persample.engine import ClippingEngine
from tunefree.privacy.ledger import Ledger
from tunefree.privacy.mechanisms import GradientRelease
from tunefree.rules.base import PerSampleGrad
from tunefree.step.optimizer import DPOptimizer
from tunefree.step.private_step import PrivateStep

CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}

# Category → the (class, method) pairs whose exclusive time it counts.
PARTS: dict[str, list[tuple[type, str]]] = {
    "forward hooks": [(ClippingEngine, m) for m in
                      ("_new_forward", "_pre_forward", "_post_forward", "_end_forward")],
    "backward hooks (bookkeeping)": [(ClippingEngine, m) for m in ("_on_grad", "_process")],
    "per-sample norms (rules)": [(ClippingEngine, "_per_sample"),
                                 (Booking, "_add_use")],
    "clip weights": [(Booking, "clip_group")],
    "end of backward (finite check)": [(ClippingEngine, "_end_of_backward")],
    "privacy checks (guards: trainable set, state, function, independence)": [
        (Guards, "before_forward"), (Guards, "before_release"), (Guards, "before_update"),
        (Guards, "after_update")],
    "release (noise)": [(GradientRelease, "release")],
    "ledger": [(Ledger, "record_step")],
    "zero_grad + optimizer bookkeeping": [(DPOptimizer, "step"), (PrivateStep, "run"),
                              (DPOptimizer, "zero_grad")],
}


def _weighted_sum_classes() -> list[type]:
    found, todo = [], [PerSampleGrad]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "weighted_sum" in vars(cls):
            found.append(cls)
    return found


class ExclusiveTimers:
    """Patches methods with timers; each call's time, less that of timed calls inside it, goes to its
    category."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.totals: dict[str, float] = defaultdict(float)
        self._inner = [0.0]
        self._restore: list[tuple[type, str, Callable]] = []

    def timed(self, category: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            self._inner.append(0.0)
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = self.clock() - start
                self.totals[category] += elapsed - self._inner.pop()
                self._inner[-1] += elapsed
        return run

    def patch(self, owner: type | object, name: str, category: str) -> None:
        original = getattr(owner, name)
        self._restore.append((owner, name, vars(owner).get(name) if isinstance(owner, type) else None))
        setattr(owner, name, self.timed(category, original))

    def install(self, optimizer: torch.optim.Optimizer) -> None:
        for category, methods in PARTS.items():
            for owner, name in methods:
                self.patch(owner, name, category)
        for cls in _weighted_sum_classes():
            self.patch(cls, "weighted_sum", "weighted sums Σ wᵢgᵢ")
        self.patch(optimizer, "step", "wrapped optimizer update")

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._restore):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._restore.clear()


def digits_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def synthetic_digits(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))


def endless(loader) -> Iterator:
    while True:
        yield from loader


def private_loop(args, timers: ExclusiveTimers | None) -> tuple[float, dict[str, float]]:
    clock = CLOCKS[args.clock]
    torch.manual_seed(0)
    model = digits_mlp()
    data = synthetic_digits(args.examples)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine = tunefree.make_private(model, optimizer, DataLoader(data, batch_size=args.batch),
                                   noise_multiplier=1.0, target_delta=1e-5, groups=args.groups,
                                   seed=0 if args.randomness == "seeded" else None)
    batches = endless(engine.data_loader)

    def step() -> None:
        start = clock()
        x, y = next(batches)
        if timers is not None:
            timers.totals["sampler / loader"] += clock() - start
        engine.optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        engine.optimizer.step()

    for _ in range(args.warmup):
        step()
    if timers is not None:
        timers.install(engine.optimizer.original)
    times = []
    for _ in range(args.steps):
        start = clock()
        step()
        times.append(clock() - start)
    if timers is None:
        return 1000 * statistics.median(times), {}
    timers.uninstall()
    parts = {k: 1000 * v / args.steps for k, v in timers.totals.items()}
    parts["model forward + backward (torch, the rest)"] = 1000 * sum(times) / args.steps - sum(parts.values())
    return 1000 * statistics.median(times), parts


def non_private(args, shuffled_loader: bool) -> float:
    clock = CLOCKS[args.clock]
    torch.manual_seed(0)
    model = digits_mlp()
    data = synthetic_digits(args.examples)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    fixed = data[:args.batch]
    batches = endless(DataLoader(data, batch_size=args.batch, shuffle=True)) if shuffled_loader else None

    def step() -> None:
        x, y = next(batches) if batches is not None else fixed
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        start = clock()
        step()
        times.append(clock() - start)
    return 1000 * statistics.median(times)


def aten_ops_per_step(args) -> tuple[float, list[tuple[str, int]]]:
    """Operator calls per private step (torch.profiler), with the most frequent."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = digits_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine = tunefree.make_private(model, optimizer, DataLoader(synthetic_digits(args.examples),
                                                                batch_size=args.batch),
                                   noise_multiplier=1.0, target_delta=1e-5, groups=args.groups,
                                   seed=0 if args.randomness == "seeded" else None)
    batches = endless(engine.data_loader)
    steps = 10
    for _ in range(3):
        x, y = next(batches)
        engine.optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        engine.optimizer.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            x, y = next(batches)
            engine.optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            engine.optimizer.step()
    counts = defaultdict(int)
    for event in prof.events():
        if event.name.startswith("aten::"):
            counts[event.name] += 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:12]
    return sum(counts.values()) / steps, [(name, n // steps) for name, n in top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", default="all-layer", help="all-layer (default) or per-layer")
    parser.add_argument("--randomness", choices=("secure", "seeded"), default="secure")
    parser.add_argument("--examples", type=int, default=1797, help="data set size N (digits: 1797)")
    parser.add_argument("--batch", type=int, default=256, help="expected batch size q·N")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="wall time, or the main thread's CPU time (less distorted by other load; "
                             "it leaves out waiting, e.g. for the noise drawn on a background thread)")
    parser.add_argument("--ops", action="store_true", help="also count aten operators per step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    fixed = non_private(args, shuffled_loader=False)
    shuffled = non_private(args, shuffled_loader=True)
    plain, _ = private_loop(args, None)
    instrumented, parts = private_loop(args, ExclusiveTimers(CLOCKS[args.clock]))
    print(f"digits MLP, N {args.examples}, B {args.batch}, {args.groups}, {args.randomness} randomness, "
          f"{args.threads} thread(s), {args.clock} clock;"
          f" medians over {args.steps} steps after {args.warmup}")
    print(f"non-private step, fixed batch: {fixed:.3f} ms; over a shuffled DataLoader: {shuffled:.3f} ms")
    print(f"private step over the Poisson loader: {plain:.3f} ms (instrumented: {instrumented:.3f} ms)")
    print("| part | ms / step (mean) |\n|---|---|")
    rest = parts.pop("model forward + backward (torch, the rest)")
    for name, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {ms:.3f} |")
    print(f"| all tunefree parts | {sum(parts.values()):.3f} |")
    print(f"| model forward + backward (torch, the rest) | {rest:.3f} |")
    if args.ops:
        mean, top = aten_ops_per_step(args)
        print(f"aten operators per private step: {mean:.0f}; most frequent: {top}")


if __name__ == "__main__":
    main()
