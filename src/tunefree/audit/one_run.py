"""The one-run white-box audit (Steinke, Nasr & Jagielski 2023) of a configuration.

m gradient canaries, each included in the private data set independently with probability ½; one real
training run; each canary scored by the likelihood ratio of its coordinate's releases; the k highest
guessed "in", the k lowest "out"; ε_LB from the number of right guesses (:mod:`.bounds`). It also runs
the noise and separation checks (:mod:`.checks`) on the same coordinates.
"""

from __future__ import annotations

import numpy as np

from .bounds import best_one_run_bound
from .canaries import design_generator
from .checks import noise_check, separation_check
from .result import AuditResult
from .whitebox import AuditSettings, build_run, observe


def one_run_audit(settings: AuditSettings) -> AuditResult:
    """Audit ``settings`` in one training run: ε_LB ≤ ε with probability ``settings.confidence`` when
    the run keeps its (ε, δ) guarantee (the claimed ε is the run's own ledger's)."""
    design = design_generator(settings.seed)
    included = design.random(settings.canaries) < 0.5
    engine, model = build_run(settings, included, design)
    seen = observe(engine, model, settings.steps)
    delta = engine.target_delta
    bound, guesses = best_one_run_bound(seen.scores(), included, delta, settings.confidence)
    checks = []
    if 2 <= included.sum() <= len(included) - 2:
        each = 1 - (1 - settings.confidence) / 2  # both checks pass a correct run w.p. ≥ confidence
        checks = [noise_check(seen.z[:, ~included], each),
                  separation_check(seen.z, included, float(np.mean(seen.sample_rate * seen.shift)), each)]
    return AuditResult(kind="one-run white-box", epsilon=engine.epsilon(), delta=delta,
                       epsilon_lower_bound=bound, confidence=settings.confidence,
                       canaries=settings.canaries, guesses=guesses.guesses, correct=guesses.correct,
                       steps=len(seen.z), recorded_steps=seen.recorded_steps, checks=checks)
