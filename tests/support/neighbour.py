"""Neighbour sensitivity of private steps through the public API: max_j ‖release(D) − release(D∖{j})‖.

A step runs with noise 0, Abadi clipping at R over one all-layer group, SGD(lr=1) and sampling rate 1, so
the update times the expected batch size is exactly the released clipped sum. A correct private step keeps
the neighbour distance ≤ R for every j. Everything is seeded: the same call gives the same release.

Multi-step runs (``compare_runs``): state may carry from one batch into the next, so step t's release
must be a function of the public weights and step t's batch alone. A run records every release (and the
model's state at the end) as a ``RunTrace``; the weights stay public by construction (the caller's
learning rate is 0, so they never move). Then (1) every step of the run on D∖{j} stays within R of the
same step on D; (2) the model's state after the run (parameters, buffers, tensor and number attributes)
is the same bit for bit on D and D∖{j} — it is released with the model, unnoised; (3) a run whose earlier
steps saw other data releases, at its last step on D, exactly what the run on D releases there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from support.brute_force import per_example_grads
from tunefree.clipping.functions import clip_function


@dataclass
class StepContext:
    """What a custom training step may touch: the private run, the model, the user's ORIGINAL optimizer
    and the (full) Poisson batch of the step."""

    engine: tunefree.DPEngine
    model: nn.Module
    optimizer: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor


TrainStep = Callable[[StepContext], None]


def loss_step(loss_fn: Callable) -> TrainStep:
    """The ordinary step: one forward, one backward of ``loss_fn(model(x), y)``."""
    def step(ctx: StepContext) -> None:
        loss_fn(ctx.model(ctx.x), ctx.y).backward()
    return step


def release_of_step(model_factory: Callable[[], nn.Module], train_step: TrainStep, x: torch.Tensor,
                    y: torch.Tensor, max_grad_norm: float) -> dict[str, torch.Tensor]:
    """The released noisy sum (noise 0) of one step over all of (x, y), by parameter name: the SGD(lr=1)
    update times the expected batch size len(x). ``train_step`` runs everything before
    ``engine.optimizer.step()``; parameters it adds to the optimizer are named ``optimizer[i][j]``."""
    torch.manual_seed(0)
    model = model_factory().train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    engine = tunefree.make_private(model, optimizer, loader, target_delta=1e-1 / len(x),
                                   noise_multiplier=0.0, steps=1, clipping="abadi",
                                   max_grad_norm=max_grad_norm, loss_reduction="sum", seed=0)
    updates: dict[str, torch.Tensor] = {}
    for xb, yb in engine.data_loader:
        torch.manual_seed(1)
        train_step(StepContext(engine, model, optimizer, xb, yb))
        params = dict(model.named_parameters())
        known = set(params.values())
        for i, group in enumerate(engine.optimizer.param_groups):
            params.update({f"optimizer[{i}][{j}]": p for j, p in enumerate(group["params"])
                           if p not in known})
        before = {name: p.detach().clone() for name, p in params.items()}
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        updates = {name: (before[name] - p.detach()) * len(x) for name, p in params.items()}
    return updates


def flat(release: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([u.flatten() for u in release.values()])


def neighbour_distance_of_step(model_factory: Callable[[], nn.Module], train_step: TrainStep,
                               x: torch.Tensor, y: torch.Tensor, max_grad_norm: float) -> float:
    """max over j of ‖release(D) − release(D∖{j})‖ for a custom training step."""
    full = flat(release_of_step(model_factory, train_step, x, y, max_grad_norm))
    keep = torch.ones(len(x), dtype=torch.bool)
    worst = 0.0
    for j in range(len(x)):
        keep[j] = False
        neighbour = flat(release_of_step(model_factory, train_step, x[keep], y[keep], max_grad_norm))
        worst = max(worst, (full - neighbour).norm().item())
        keep[j] = True
    return worst


def neighbour_distance(model_factory: Callable[[], nn.Module], loss_fn: Callable, x: torch.Tensor,
                       y: torch.Tensor, max_grad_norm: float) -> float:
    """max over j of ‖release(D) − release(D∖{j})‖; a correct private step keeps it ≤ max_grad_norm."""
    return neighbour_distance_of_step(model_factory, loss_step(loss_fn), x, y, max_grad_norm)


def brute_force_release(model_factory: Callable[[], nn.Module], loss_fn: Callable, x: torch.Tensor,
                        y: torch.Tensor, max_grad_norm: float) -> dict[str, torch.Tensor]:
    """The release a correct step makes: each example's gradient from a batch-size-1 autograd loop on the
    same initial model, clipped (Abadi, one all-layer group) at ``max_grad_norm`` and summed."""
    torch.manual_seed(0)
    model = model_factory().train()
    names = {p: n for n, p in model.named_parameters()}
    total = {n: torch.zeros_like(p) for p, n in names.items()}
    for grads in per_example_grads(model, loss_fn, x, y):
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
        weight = clip_function("abadi").weights(norm.reshape(1), max_grad_norm)[0]
        for p, g in grads.items():
            total[names[p]] += weight * g
    return total


def relative_error(release: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """‖release − expected‖ / ‖expected‖ over the expected parameters."""
    got = torch.cat([release[n].flatten() for n in expected])
    want = flat(expected)
    return ((got - want).norm() / want.norm()).item()


# ------------------------------------------------------------------------------------ multi-step runs
@dataclass
class RunTrace:
    """What one private run gave out: each logical step's released sum (noise 0) by parameter name, and
    the model's state after the last step (``None`` if the run stopped early). ``error`` is the exception
    that stopped it (a refusal, or a crash)."""

    releases: list[dict[str, torch.Tensor]] = field(default_factory=list)
    state: dict[str, object] | None = None
    error: BaseException | None = None
    ledger_steps: int | None = None               # steps the run's ledger holds at the end
    poisson_approximation: bool | None = None     # what the run's guarantee says of its sampling


def release_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """‖a − b‖ over the parameters of both (a parameter missing from one side counts as zero there)."""
    total = torch.zeros((), dtype=torch.float64)
    for name in a.keys() | b.keys():
        x = a[name].double() if name in a else torch.zeros_like(b[name], dtype=torch.float64)
        y = b[name].double() if name in b else torch.zeros_like(x)
        total += ((x - y) ** 2).sum()
    return total.sqrt().item()


def same_value(a: object, b: object) -> bool:
    """Bit-identical tensors (NaN where the other has NaN) or equal numbers."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():
            return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))
        return bool(torch.equal(a, b))
    return a == b


def state_differences(a: dict[str, object], b: dict[str, object]) -> list[str]:
    """The entries of two model states that differ (or exist on one side only)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not same_value(a[k], b[k]))


@dataclass
class StepExcess:
    """The largest neighbour distance of a multi-step comparison, where it happened."""

    distance: float = 0.0
    step: int = -1
    removed: int = -1


@dataclass
class MultiStepReport:
    """``compare_runs``' measurements; a correct run has ``worst.distance ≤ R``, no ``state_diffs`` and
    ``carry_distance == 0``. ``carry_distance`` is ``None`` when the carry run was not compared (it or
    the run on D stopped before the last step, or there is a single step)."""

    worst: StepExcess
    state_diffs: dict[int, list[str]]
    carry_distance: float | None
    full: RunTrace
    neighbours: list[RunTrace]
    carry: RunTrace | None


RunFn = Callable[[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None], RunTrace]


def compare_runs(run: RunFn, x: torch.Tensor, y: torch.Tensor,
                 history: tuple[torch.Tensor, torch.Tensor] | None,
                 full: RunTrace | None = None) -> MultiStepReport:
    """Run on D = (x, y), on every D∖{j}, and (if ``history`` is given) on ``history`` for all steps but the
    last, which sees D; compare what they released. ``run(x, y, history)`` returns a ``RunTrace``;
    ``full``: the run on D, if already made."""
    full = full if full is not None else run(x, y, None)
    worst, state_diffs, neighbours = StepExcess(), {}, []
    keep = torch.ones(len(x), dtype=torch.bool)
    for j in range(len(x)):
        keep[j] = False
        neighbour = run(x[keep], y[keep], None)
        keep[j] = True
        neighbours.append(neighbour)
        for t, (a, b) in enumerate(zip(full.releases, neighbour.releases)):
            distance = release_distance(a, b)
            if distance > worst.distance:
                worst = StepExcess(distance, t, j)
        if full.state is not None and neighbour.state is not None:
            diffs = state_differences(full.state, neighbour.state)
            if diffs:
                state_diffs[j] = diffs
    carry, carry_distance = None, None
    if history is not None:
        carry = run(x, y, history)
        last = len(full.releases) - 1
        if full.state is not None and carry.state is not None and last >= 0:
            # exact in float64 for float32 and float64 releases: 0 only when they are identical
            carry_distance = release_distance(full.releases[last], carry.releases[last])
    return MultiStepReport(worst, state_diffs, carry_distance, full, neighbours, carry)
