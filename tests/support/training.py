"""The ordinary private training loop the tests run, written once."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import tunefree


def cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def train(engine: tunefree.DPEngine, steps: int | None = None,
          loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy) -> int:
    """Trains ``engine.model`` on ``engine.data_loader`` for ``steps`` logical steps (passes over the
    loader as many as needed), or for one pass over the loader when ``steps`` is None: per physical batch
    ``zero_grad``, ``loss(model, x, y).backward()``, ``step``. Returns the logical steps taken."""
    taken = 0
    while steps is None or taken < steps:
        for x, y in engine.data_loader:
            engine.optimizer.zero_grad()
            loss(engine.model, x, y).backward()
            engine.optimizer.step()
            taken += engine.schedule.ends_logical
            if taken == steps:
                return taken
        if steps is None:
            break
    return taken
