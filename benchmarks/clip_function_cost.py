"""What evaluating a clip function one example at a time (``torch.vmap``) would cost the built-in ones.

A user's clip function runs one example at a time, so that no weight can read another example's norm
(``clipping/functions.py``); the built-in ones are elementwise and run on the whole batch. This measures,
on a private step of a deep narrow MLP with per-layer clip groups (one ``weights`` call per group and
backward pass), the step time with AutoS evaluated directly and with the same function evaluated one
example at a time (a subclass, which takes the user's path). Rounds interleave the two.

    OMP_NUM_THREADS=1 python benchmarks/clip_function_cost.py --layers 20 --width 64 --batch 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tunefree.clipping.functions import AutoS
from tunefree.clipping.groups import make_groups
from tunefree.persample.engine import ClippingEngine


@dataclass(frozen=True)
class AutoSOneAtATime(AutoS):
    """AutoS through the path a user's function takes (one example at a time)."""


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())],
                         nn.Linear(width, 10))


def _time_step(clip, layers: int, width: int, batch: int, steps: int) -> float:
    """Seconds per captured forward + backward (per-sample norms, clip weights, clipped sums)."""
    model = _model(layers, width)
    engine = ClippingEngine(model, make_groups(model, "per-layer", 1.0), clip, loss_reduction="sum")
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    for _ in range(3):
        F.cross_entropy(model(x), y, reduction="sum").backward()
        engine.accumulator.pop()
    start = time.perf_counter()
    for _ in range(steps):
        F.cross_entropy(model(x), y, reduction="sum").backward()
        engine.accumulator.pop()
    engine.detach()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"direct": [], "one at a time": []}
    for _ in range(args.rounds):
        for name, clip in (("direct", AutoS()), ("one at a time", AutoSOneAtATime())):
            times[name].append(_time_step(clip, args.layers, args.width, args.batch, args.steps))
    direct, vmapped = (statistics.median(times[k]) for k in ("direct", "one at a time"))
    groups = args.layers + 1
    print(f"threads {torch.get_num_threads()}, {groups} clip groups, batch {args.batch}, width {args.width}")
    print(f"private step (forward + backward, clipped): direct {direct * 1e3:.2f} ms, one example at a time "
          f"{vmapped * 1e3:.2f} ms: +{(vmapped / direct - 1) * 100:.1f}% "
          f"({(vmapped - direct) / groups * 1e6:.0f} µs per clip group)")


if __name__ == "__main__":
    main()
