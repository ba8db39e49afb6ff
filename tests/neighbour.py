"""Neighbour sensitivity of one private step through the public API: max_j ‖release(D) − release(D∖{j})‖.

A step runs with noise 0, Abadi clipping at R over one all-layer group, SGD(lr=1) and sampling rate 1, so
the update times the expected batch size is exactly the released clipped sum. A correct private step keeps
the neighbour distance ≤ R for every j. Everything is seeded: the same call gives the same release.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from brute_force import per_example_grads
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
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
