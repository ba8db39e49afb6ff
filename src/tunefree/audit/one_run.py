"""The one-run white-box audit (Steinke, Nasr & Jagielski 2023) of a configuration.

m gradient canaries, each included in the private data set independently with probability ½; one real
training run; each canary scored by the likelihood ratio of its coordinate's releases; the k highest
guessed "in", the k lowest "out"; ε_LB from the number of right guesses, the larger of the (ε, δ) bound
(:mod:`.bounds`) and the f-DP bound on the ledger's curve (:mod:`.fdp`, :mod:`.combined`). It also runs
the noise and separation checks (:mod:`.checks`) on the same coordinates.
"""

from __future__ import annotations

import numpy as np

from ..run import DPEngine
from .checks import noise_check, separation_check
from .combined import one_run_bounds
from .design import design_generator
from .result import AuditResult
from .whitebox import AuditSettings, Observation, build_run, observe


def one_run_audit(settings: AuditSettings) -> AuditResult:
    """Audit ``settings`` in one training run: ε_LB ≤ ε with probability ``settings.confidence`` when
    the run keeps its (ε, δ) guarantee (the claimed ε is the run's own ledger's)."""
    design = design_generator(settings.seed)
    included = design.random(settings.canaries) < 0.5
    engine, model = build_run(settings, included, design)
    seen = observe(engine, model, settings.steps)
    return audit_observation("one-run white-box", engine, seen, included, settings.confidence)


def audit_observation(kind: str, engine: DPEngine, seen: Observation, included: np.ndarray,
                      confidence: float) -> AuditResult:
    """The one-run audit's result from what the auditor saw of ``engine``'s run: both bounds (against
    the run's ledger) and both checks, every one of them valid at ``confidence``."""
    delta = engine.target_delta
    bounds = one_run_bounds(seen.scores(), included, engine.ledger.event(), delta, confidence)
    checks = []
    if 2 <= included.sum() <= len(included) - 2:
        each = 1 - (1 - confidence) / 2  # both checks pass a correct run w.p. ≥ confidence
        checks = [noise_check(seen.z[:, ~included], each),
                  separation_check(seen.z, included, float(np.mean(seen.sample_rate * seen.shift)), each)]
    return AuditResult(kind=kind, epsilon=engine.epsilon(), delta=delta, epsilon_lower_bound=bounds.best,
                       confidence=confidence, canaries=len(included), guesses=bounds.guesses.guesses,
                       correct=bounds.guesses.correct, steps=len(seen.z), recorded_steps=seen.recorded_steps,
                       checks=checks, steinke_bound=bounds.steinke, fdp_bound=bounds.fdp)
