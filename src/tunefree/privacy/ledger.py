"""The ledger: every release of private data, recorded as its ``dp_accounting`` DpEvent, in order.

ε is computed from the ledger only. Identical consecutive events are stored once with a count, and ε
composes each distinct event once with its total count, so a run of a million steps stays small.
"""

from __future__ import annotations

import json
from typing import Any

import dp_accounting as dpa

from .accounting import epsilon_of


class Ledger:
    """Releases of one training run.

    Its caveats hold for every release recorded: ``poisson_approximation`` when some were made from a
    loader that is not Poisson-sampled (the events are still those of Poisson sampling, and every report
    says that it is an approximation); ``seeded`` when some noise was drawn from a seeded generator
    (whoever knows the seed can remove it). A ledger loaded into another keeps the caveats of both.
    """

    def __init__(self, poisson_approximation: bool = False, seeded: bool = False):
        self.poisson_approximation, self.seeded = poisson_approximation, seeded
        self._runs: list[list[Any]] = []  # [event, count]

    def record(self, event: dpa.DpEvent) -> None:
        if self._runs and self._runs[-1][0] == event:
            self._runs[-1][1] += 1
        else:
            self._runs.append([event, 1])

    def record_step(self, sample_rate: float, releases: list[dpa.DpEvent]) -> dpa.DpEvent:
        """Record the releases made on one Poisson-sampled batch as one sampled event."""
        event = _sampled(sample_rate, releases)
        self.record(event)
        return event

    def amend_last_step(self, sample_rate: float, releases: list[dpa.DpEvent]) -> dpa.DpEvent:
        """Replace the step recorded last by one with ``releases``: the step's first release is recorded
        the moment it is made, and each later release of the same batch joins its sampled event."""
        event = _sampled(sample_rate, releases)
        if not self._runs or not isinstance(self._runs[-1][0], dpa.PoissonSampledDpEvent):
            raise ValueError("no step was recorded to amend")
        if self._runs[-1][1] == 1:
            self._runs.pop()
        else:
            self._runs[-1][1] -= 1
        self.record(event)
        return event

    @property
    def steps(self) -> int:
        """Number of sampled events recorded (training steps)."""
        return sum(count for event, count in self._runs
                   if isinstance(event, dpa.PoissonSampledDpEvent))

    def event(self) -> dpa.DpEvent:
        """Everything recorded, as one event. Composition does not depend on the order, so each
        distinct event appears once with its total count (a run alternating two kinds of steps stays
        two self-compositions)."""
        totals: dict[str, list[Any]] = {}
        for event, count in self._runs:
            key = json.dumps(to_dict(event), sort_keys=True)
            totals.setdefault(key, [event, 0])[1] += count
        return dpa.ComposedDpEvent([
            event if count == 1 else dpa.SelfComposedDpEvent(event, count)
            for event, count in totals.values()
        ])

    def epsilon(self, delta: float, accountant: str = "pld") -> float:
        """ε at ``delta`` spent by everything recorded so far (0 before the first release)."""
        if not self._runs:
            return 0.0
        return epsilon_of(self.event(), delta, accountant)

    def state_dict(self) -> dict[str, Any]:
        return {"poisson_approximation": self.poisson_approximation, "seeded": self.seeded,
                "runs": [(to_dict(event), count) for event, count in self._runs]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the recorded releases by ``state``'s. Caveats are never dropped: those of ``state``
        join this ledger's own (a ledger carried into a new run keeps the old run's caveats, and the
        new run's hold for the releases still to come)."""
        missing = {"poisson_approximation", "seeded", "runs"} - set(state)
        if missing:
            raise ValueError(f"this ledger state lacks {sorted(missing)}: it was saved by an older version "
                             "of tunefree, whose caveats cannot be known; resume from a newer checkpoint")
        self.poisson_approximation = self.poisson_approximation or bool(state["poisson_approximation"])
        self.seeded = self.seeded or bool(state["seeded"])
        self._runs = [[from_dict(event), count] for event, count in state["runs"]]


def _sampled(sample_rate: float, releases: list[dpa.DpEvent]) -> dpa.PoissonSampledDpEvent:
    if not releases:
        raise ValueError("a step must release something to be recorded")
    inner = releases[0] if len(releases) == 1 else dpa.ComposedDpEvent(list(releases))
    return dpa.PoissonSampledDpEvent(sample_rate, inner)


def to_dict(event: dpa.DpEvent) -> dict[str, Any]:
    """A plain, checkpointable description of an event."""
    if isinstance(event, dpa.GaussianDpEvent):
        return {"gaussian": event.noise_multiplier}
    if isinstance(event, dpa.LaplaceDpEvent):
        return {"laplace": event.noise_multiplier}
    if isinstance(event, dpa.PoissonSampledDpEvent):
        return {"poisson": event.sampling_probability, "event": to_dict(event.event)}
    if isinstance(event, dpa.ComposedDpEvent):
        return {"composed": [to_dict(e) for e in event.events]}
    if isinstance(event, dpa.SelfComposedDpEvent):
        return {"repeat": event.count, "event": to_dict(event.event)}
    if isinstance(event, dpa.NonPrivateDpEvent):  # inside a (0, p) release: partition selection
        return {"non_private": True}
    raise TypeError(f"the ledger cannot store {event!r}")


def from_dict(data: dict[str, Any]) -> dpa.DpEvent:
    if "gaussian" in data:
        return dpa.GaussianDpEvent(data["gaussian"])
    if "laplace" in data:
        return dpa.LaplaceDpEvent(data["laplace"])
    if "poisson" in data:
        return dpa.PoissonSampledDpEvent(data["poisson"], from_dict(data["event"]))
    if "composed" in data:
        return dpa.ComposedDpEvent([from_dict(e) for e in data["composed"]])
    if "non_private" in data:
        return dpa.NonPrivateDpEvent()
    return dpa.SelfComposedDpEvent(from_dict(data["event"]), data["repeat"])
