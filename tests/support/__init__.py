"""Helpers shared by the tests (new tests import from here; the older helper modules sit beside the tests)."""

from __future__ import annotations

import torch
from torch import nn

from tunefree.persample.engine import ClippingEngine


def pop_step(engine: ClippingEngine) -> tuple[dict[nn.Parameter, torch.Tensor], int, dict[str, torch.Tensor]]:
    """A standalone engine's bookings so far — clipped sums, example count, per-group norms — handed over
    (a private run's optimizer pops its accumulator itself)."""
    result = engine.accumulator.pop()
    return result.sums, result.examples, result.group_norms


def captured_calls(engine: ClippingEngine) -> int:
    """Layer calls of the engine's current forward pass captured and awaiting their backward pass."""
    return len(engine._pass.uses)
