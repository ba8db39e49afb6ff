"""Neighbour sensitivity of one private step through the public API: max_j ‖release(D) − release(D∖{j})‖."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree


def release(model_factory: Callable[[], nn.Module], loss_fn: Callable, x: torch.Tensor, y: torch.Tensor,
            max_grad_norm: float) -> torch.Tensor:
    """The released noisy sum (noise 0) of one step over all of (x, y): the SGD(lr=1) update times the
    expected batch size, which is len(x) since the sampling rate is 1."""
    torch.manual_seed(0)
    model = model_factory().train()
    before = [p.detach().clone() for p in model.parameters()]
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    engine = tunefree.make_private(model, torch.optim.SGD(model.parameters(), lr=1.0), loader,
                                   target_delta=1e-1 / len(x), noise_multiplier=0.0, steps=1,
                                   clipping="abadi", max_grad_norm=max_grad_norm, loss_reduction="sum",
                                   seed=0)
    for xb, yb in engine.data_loader:
        loss_fn(model(xb), yb).backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    updates = [(b - p.detach()).flatten() for b, p in zip(before, model.parameters(), strict=True)]
    return torch.cat(updates) * len(x)


def neighbour_distance(model_factory: Callable[[], nn.Module], loss_fn: Callable, x: torch.Tensor,
                       y: torch.Tensor, max_grad_norm: float) -> float:
    """max over j of ‖release(D) − release(D∖{j})‖; a correct private step keeps it ≤ max_grad_norm."""
    full = release(model_factory, loss_fn, x, y, max_grad_norm)
    keep = torch.ones(len(x), dtype=torch.bool)
    worst = 0.0
    for j in range(len(x)):
        keep[j] = False
        neighbour = release(model_factory, loss_fn, x[keep], y[keep], max_grad_norm)
        worst = max(worst, (full - neighbour).norm().item())
        keep[j] = True
    return worst
