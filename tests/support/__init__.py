"""Helpers shared by the tests, imported as ``support``: the oracles, model zoos and harnesses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dp_accounting as dpa
import torch
from torch import nn

from tunefree.extend import StepContext, StepReport, UpdateControl
from tunefree.persample.engine import ClippingEngine
from tunefree.privacy.mechanisms import release_values
from tunefree.privacy.randomness import NoiseSource, SeededSource


def pop_step(engine: ClippingEngine) -> tuple[dict[nn.Parameter, torch.Tensor], int, dict[str, torch.Tensor]]:
    """A standalone engine's bookings so far — clipped sums, example count, per-group norms — handed over
    (a private run's optimizer pops its accumulator itself)."""
    result = engine.accumulator.pop()
    return result.sums, result.examples, result.group_norms


def captured_calls(engine: ClippingEngine) -> int:
    """Layer calls of the engine's current forward pass captured and awaiting their backward pass."""
    return len(engine._pass.uses)


def component_step(report: StepReport, optimizer: torch.optim.Optimizer | None = None,
                   closure: Callable[[], Any] | None = None, expected_batch_size: float = 1.0,
                   randomness: NoiseSource | None = None) -> tuple[StepContext, list[dpa.DpEvent]]:
    """A step as a component sees it, outside a run: its releases are noised from ``randomness`` (a seeded
    source by default) and their events kept in the list returned with it."""
    randomness = SeededSource(0) if randomness is None else randomness
    events: list[dpa.DpEvent] = []

    def release(sums: torch.Tensor, sensitivity: float, noise_multiplier: float) -> torch.Tensor:
        noisy, event = release_values(sums, sensitivity, noise_multiplier, randomness)
        events.append(event)
        return noisy

    update = None if optimizer is None else UpdateControl(optimizer)
    return StepContext(report, closure, update, expected_batch_size, release), events
