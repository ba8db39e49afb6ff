"""Helpers shared by the tests: the oracles, model zoos and harnesses are the modules of this package."""

from __future__ import annotations

import pytest
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


def slow_case(*values):
    """One case of a ``parametrize`` list marked ``slow`` (left out of ``make test-fast``)."""
    return pytest.param(*values, marks=pytest.mark.slow)
