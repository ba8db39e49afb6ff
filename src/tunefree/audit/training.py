"""The one-run audit of a user's own training run, from the canaries ``make_private(...,
audit_canaries=m)`` put into it (:mod:`tunefree.privacy.canaries`): the same statistics as
:func:`.one_run_audit` — the (ε, δ) and f-DP bounds, the noise and separation checks — on the releases
the run made."""

from __future__ import annotations

import numpy as np

from ..run import DPEngine
from .one_run import audit_observation
from .result import AuditResult
from .whitebox import Observation


def audit_training(engine: DPEngine, confidence: float = 0.95) -> AuditResult:
    """Audit the run of ``engine`` (made with ``audit_canaries``) over the steps it has taken: ε_LB ≤ ε
    with probability ``confidence`` when the run keeps the guarantee its ledger claims."""
    canaries = engine.canaries
    if canaries is None:
        raise ValueError("this run has no audit canaries: make it with make_private(..., audit_canaries=m)")
    if not canaries.z:
        raise ValueError("the run has released nothing yet: audit it after training")
    seen = Observation(np.stack(canaries.z), np.array(canaries.shift), engine.sample_rate, engine.steps)
    return audit_observation("one-run white-box (training canaries)", engine, seen, canaries.included,
                             confidence)
