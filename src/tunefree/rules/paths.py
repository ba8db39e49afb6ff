"""The choice between the two exact ways of computing a layer's per-sample norms: ghost norm or
materialised per-sample gradients, by measured time.

Both paths give the same norms and the same clipped sum (up to float rounding); only their cost differs,
and a multiply-add count predicts it poorly where memory traffic dominates (wide
convolutions at small spatial size, large-vocabulary heads). A :class:`PathChooser` times both paths
on the layer's real tensors the first time it meets a layer kind and per-example shape (two runs each,
interleaved, under ``no_grad``; the faster minimum wins) and reuses the choice after that. The key
leaves out the batch size, so Poisson batches of varying size do not calibrate again.

Without timing — cheap layers (the choice barely matters there, and small models stay deterministic),
paths whose estimated costs are far apart, or ``measure=False`` — the path with the lower estimate is
taken. The choice never affects privacy: each path computes the exact per-sample norms of the gradients
it sums.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch

GHOST, MATERIALISE = "ghost", "materialise"
PATHS = (GHOST, MATERIALISE)


class PathChooser:
    """Picks the faster norm path per (layer kind, per-example shape, dtype, device, mode).

    Args:
        measure: time both paths once per key (True), or always follow the cost estimates (False:
            deterministic, no timing).
        fixed: always take this path (``"ghost"`` or ``"materialise"``), e.g. to test both.
        min_cost: layers whose cheaper estimate is below this many multiply-adds follow the estimates
            untimed (the choice barely matters there).
        max_ratio: paths whose estimates differ by more than this factor are not timed either (the
            slow one would cost seconds to time on a large layer).
        repeats: timed runs per path.
    """

    def __init__(self, measure: bool = True, fixed: str | None = None, min_cost: float = 2.0**24,
                 max_ratio: float = 8.0, repeats: int = 2):
        if fixed is not None and fixed not in PATHS:
            raise ValueError(f"fixed must be one of {PATHS} or None, got {fixed!r}")
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats}")
        self.measure, self.fixed, self.repeats = measure, fixed, repeats
        self.min_cost, self.max_ratio = min_cost, max_ratio
        self.choices: dict[Hashable, str] = {}
        self.timings_ms: dict[Hashable, dict[str, float]] = {}  # what each measured choice saw

    def choose(self, key: Hashable, estimates: dict[str, float], run: Callable[[str], object],
               device: torch.device, timeable: bool = True) -> str:
        """The path for ``key``: ``fixed`` if set, else the cached choice, else the faster of
        ``run(path)`` timed for each path — or the one with the lower cost estimate (ghost on a tie)
        when measuring is off, the layer is cheap, the estimates are far apart, or not ``timeable``
        (the caller's say: e.g. a path that would hold more memory than the estimate's pick)."""
        if self.fixed is not None:
            return self.fixed
        if key in self.choices:
            return self.choices[key]
        low, high = min(estimates.values()), max(estimates.values())
        if not (self.measure and timeable) or low < self.min_cost or high > self.max_ratio * low:
            choice = min(PATHS, key=estimates.__getitem__)
        else:
            best = {path: float("inf") for path in PATHS}
            for _ in range(self.repeats):
                for path in PATHS:
                    best[path] = min(best[path], _seconds(run, path, device))
            self.timings_ms[key] = {path: 1000 * t for path, t in best.items()}
            choice = min(PATHS, key=best.__getitem__)
        self.choices[key] = choice
        return choice


# A pass that writes each element once (copying convolution patches from their strided view) costs about
# this many multiply-adds per element on the CPU: it is bound by memory, not arithmetic (RESULTS §8.5).
UNFOLD_COST = 2


def factored_estimates(examples: int, positions: int, d_in: int, d_out: int,
                       unfolded: bool = False) -> dict[str, float]:
    """Multiply-adds of each path for ``examples`` × channel groups of a factored gradient
    ``Σₜ bₜ aₜᵀ``: the ghost norm's two Gram matrices ~T²(d_in + d_out), materialising ~T·d_in·d_out.
    ``unfolded``: both paths first copy the T·d_in input patches (convolutions)."""
    unfold = UNFOLD_COST * positions * d_in if unfolded else 0
    return {GHOST: examples * (positions * positions * (d_in + d_out) + unfold),
            MATERIALISE: examples * (positions * d_in * d_out + unfold)}


def _seconds(run: Callable[[str], object], path: str, device: torch.device) -> float:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        run(path)
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


# make_private's ``norm_path``: timed (``"auto"``), the cost formula, or one path forced.
NORM_PATHS = ("auto", "formula", GHOST, MATERIALISE)


def path_chooser(norm_path: str, replayable: bool) -> PathChooser:
    """The chooser of a run's ``norm_path``; a ``replayable`` (seeded) run never times (a timing would
    make its float rounding depend on the machine's load): ``"auto"`` then follows the cost formula."""
    if norm_path in PATHS:
        return PathChooser(fixed=norm_path)
    return PathChooser(measure=norm_path == "auto" and not replayable)
