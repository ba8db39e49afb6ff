"""The guard protocol: each invariant of the private step, checked at the points of the step it needs.

A private step runs, in order (``step/private_step.py``): the training loop's forward passes (each one's
:meth:`Guard.before_forward`), its backward passes (the engine books clipped sums), then
:meth:`Guard.before_release`, the release and its record in the ledger, the step components,
:meth:`Guard.before_update`, the wrapped optimizer's update and :meth:`Guard.after_update`. A guard
refuses by raising :class:`~tunefree.errors.PrivacyError`; :class:`Guards` then drops the step's booked
sums, so that nothing of a refused step is ever released.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import PrivacyError
from ..persample.engine import ModelCall

__all__ = ["Guard", "Guards", "ModelCall"]


class Guard:
    """One invariant. Each hook does nothing unless the guard needs that point of the step."""

    def before_forward(self, call: ModelCall) -> None:
        """At the start of every training forward pass of the model (grad enabled, train mode)."""

    def before_release(self, step: int) -> None:
        """Before logical step ``step`` (1-based) releases anything."""

    def before_update(self, step: int) -> None:
        """After the release (recorded) and the step components, before the wrapped optimizer's update."""

    def after_update(self, step: int) -> None:
        """After the wrapped optimizer's update."""


class Guards:
    """The run's guards, called in order at each point of the step. A refusal drops the sums booked for
    the step (``drop``), then propagates."""

    def __init__(self, guards: Sequence[Guard], drop: Callable[[], object]):
        self.guards, self.drop = tuple(guards), drop

    def of(self, kind: type) -> Guard | None:
        """The run's guard of type ``kind``, if it has one."""
        return next((g for g in self.guards if isinstance(g, kind)), None)

    def before_forward(self, call: ModelCall) -> None:
        self._each("before_forward", call)

    def before_release(self, step: int) -> None:
        self._each("before_release", step)

    def before_update(self, step: int) -> None:
        self._each("before_update", step)

    def after_update(self, step: int) -> None:
        self._each("after_update", step)

    def _each(self, point: str, argument: object) -> None:
        try:
            for guard in self.guards:
                getattr(guard, point)(argument)
        except PrivacyError:
            self.drop()
            raise
