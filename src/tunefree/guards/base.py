"""The guard protocol: each invariant of the private step, checked at the points of the step it needs.

A private step runs, in order (``step/private_step.py``): the training loop's forward passes (each one's
:meth:`Guard.before_forward` and :meth:`Guard.after_forward`), its backward passes (the engine books
clipped sums), then
:meth:`Guard.before_release`, the release and its record in the ledger, the step components,
:meth:`Guard.before_update`, the wrapped optimizer's update and :meth:`Guard.after_update`. A guard
refuses by raising :class:`~tunefree.errors.PrivacyError`; :class:`Guards` then drops the step's booked
sums, so that nothing of a refused step is ever released.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import PrivacyError
from ..persample.engine import ModelCall

__all__ = ["Guard", "Guards", "ModelCall"]


class Guard:
    """One invariant. Each hook does nothing unless the guard needs that point of the step."""

    def before_forward(self, call: ModelCall) -> None:
        """At the start of every training forward pass of the model (grad enabled, train mode)."""

    def after_forward(self, output: object) -> None:
        """At the end of every training forward pass of the model, with what it returned."""

    def before_release(self, step: int) -> None:
        """Before logical step ``step`` (1-based) releases anything."""

    def before_update(self, step: int) -> None:
        """After the release (recorded) and the step components, before the wrapped optimizer's update."""

    def after_update(self, step: int) -> None:
        """After the wrapped optimizer's update."""

    def carried(self, device: torch.device) -> torch.Tensor | None:
        """At the end of each backward pass: flags (a bool vector, True where refused) for the engine's one
        transfer to the host, on ``device``; ``None``: none."""
        return None

    def carried_read(self, refused: list[bool]) -> None:
        """The values of the flags :meth:`carried` gave the transfer that read them."""


class Guards:
    """The run's guards, called in order at each point of the step. A refusal drops the sums booked for
    the step (``drop``), then propagates."""

    def __init__(self, guards: Sequence[Guard], drop: Callable[[], object]):
        self.guards, self.drop = tuple(guards), drop
        self._carried: list[tuple[Guard, torch.Tensor | None]] = []

    def of(self, kind: type) -> Guard | None:
        """The run's guard of type ``kind``, if it has one."""
        return next((g for g in self.guards if isinstance(g, kind)), None)

    def before_forward(self, call: ModelCall) -> None:
        self._each("before_forward", call)

    def after_forward(self, output: object) -> None:
        self._each("after_forward", output)

    def before_release(self, step: int) -> None:
        self._each("before_release", step)

    def before_update(self, step: int) -> None:
        self._each("before_update", step)

    def after_update(self, step: int) -> None:
        self._each("after_update", step)

    def carried(self, device: torch.device) -> torch.Tensor | None:
        """The guards' flags for the engine's transfer at the end of a backward pass (``None``: none)."""
        self._carried = [(guard, guard.carried(device)) for guard in self.guards]
        flags = [f for _, f in self._carried if f is not None]
        return flags[0] if len(flags) == 1 else torch.cat(flags) if flags else None

    def carried_read(self, refused: list[bool]) -> None:
        """Hand each guard the values of its flags (a guard refuses by raising)."""
        try:
            for guard, flags in self._carried:
                if flags is not None:
                    guard.carried_read(refused[:len(flags)])
                    refused = refused[len(flags):]
        except PrivacyError:
            self.drop()
            raise

    def _each(self, point: str, argument: object) -> None:
        try:
            for guard in self.guards:
                getattr(guard, point)(argument)
        except PrivacyError:
            self.drop()
            raise
