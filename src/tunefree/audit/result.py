"""What an audit found: the claimed ε (from the run's ledger), ε_LB, and a verdict."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .checks import Check


@dataclass(frozen=True)
class AuditResult:
    """An audit of one configuration.

    ``epsilon`` is what the run's ledger claims at ``delta``; ``epsilon_lower_bound`` holds with
    probability at least ``confidence`` whatever the run does — if it exceeds ``epsilon``, the run
    breaks its guarantee. For one-run audits it is the larger of ``steinke_bound`` (against any
    (ε, δ)-DP run) and ``fdp_bound`` (against the ledger's privacy curve), paid for together
    (:mod:`tunefree.audit.combined`). ``checks`` are estimates (see :mod:`tunefree.audit.checks`).
    """

    kind: str
    epsilon: float
    delta: float
    epsilon_lower_bound: float
    confidence: float
    canaries: int
    guesses: int
    correct: int
    steps: int  # releases the auditor observed
    recorded_steps: int  # steps in the ledger
    checks: list[Check] = field(default_factory=list)
    loose: bool = False  # a black-box audit: far below ε even for a correct run
    steinke_bound: float | None = None  # one-run audits: the (ε, δ) bound
    fdp_bound: float | None = None  # one-run audits: the f-DP bound on the ledger's curve

    @property
    def verdict(self) -> str:
        if self.epsilon_lower_bound > self.epsilon:
            return "violated"
        if self.steps != self.recorded_steps or any(not c.passed for c in self.checks):
            return "suspicious"
        return "consistent"

    def explain(self) -> str:
        lines = [f"{self.kind} audit: claimed ε = {self.epsilon:.4g} at δ = {self.delta:.3g}; "
                 f"ε_LB = {self.epsilon_lower_bound:.4g} at {self.confidence:.0%} confidence "
                 f"({self.correct} of {self.guesses} guesses right on {self.canaries} canaries)"]
        if self.steinke_bound is not None and self.fdp_bound is not None:
            lines.append(f"ε_LB is the larger of the (ε, δ) bound {self.steinke_bound:.4g} and the f-DP "
                         f"bound {self.fdp_bound:.4g} on the ledger's privacy curve")
        if self.loose:
            lines.append("black box (final model only): a loose bound, far below ε even for a correct run")
        if self.steps != self.recorded_steps:
            lines.append(f"observed {self.steps} releases, the ledger records {self.recorded_steps} steps")
        lines += [str(c) for c in self.checks]
        verdict = {"violated": "VIOLATED: ε_LB > ε, the run leaks more than its ledger claims",
                   "suspicious": "SUSPICIOUS: a check failed (an estimate, not a proof)",
                   "consistent": "consistent: ε_LB ≤ ε and every check passed"}[self.verdict]
        return "\n".join([*lines, f"verdict: {verdict}"])

    def to_dict(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "checks"}
        return {**values,
                "checks": {c.name: {"ratio": c.ratio, "low": c.low, "high": c.high, "passed": c.passed}
                           for c in self.checks},
                "verdict": self.verdict}
