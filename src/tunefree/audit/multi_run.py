"""The multi-run Clopper–Pearson audit: many small trainings, each with or without one canary.

Each run includes the canary with probability ½ and is observed white-box (:mod:`.whitebox`); its score
is the canary's likelihood ratio. The first half of the runs picks the threshold, the second half tests
it: exact (Clopper–Pearson) upper bounds on its false-positive and false-negative rates give ε_LB
(:func:`.bounds.clopper_pearson_epsilon_bound`). Costly (one training per run) and, for a given number
of trainings, weaker than the one-run audit; it needs no assumption on how canaries interact.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import replace

import numpy as np

from .bounds import clopper_pearson_epsilon_bound
from .design import design_generator
from .result import AuditResult
from .whitebox import AuditSettings, build_run, observe


def _errors(scores: np.ndarray, included: np.ndarray, threshold: float) -> tuple[int, int, int, int]:
    """False positives, runs without, false negatives, runs with the canary, guessing "in" above
    ``threshold``."""
    guess = scores > threshold
    return (int((guess & ~included).sum()), int((~included).sum()),
            int((~guess & included).sum()), int(included.sum()))


def multi_run_audit(settings: AuditSettings, runs: int) -> AuditResult:
    """Audit ``settings`` (its ``canaries`` ignored: one canary per run) with ``runs`` trainings."""
    if runs < 4:
        raise ValueError(f"a multi-run audit needs at least 4 runs (2 to pick a threshold, 2 to test "
                         f"it), got {runs}")
    settings = replace(settings, canaries=1)
    seed = secrets.randbits(62) if settings.seed is None else settings.seed
    design = design_generator(seed)
    included = design.random(runs) < 0.5
    scores, epsilons = np.empty(runs), {}
    for run in range(runs):
        run_settings = settings if settings.seed is None else replace(settings, seed=seed + 1 + run)
        engine, model = build_run(run_settings, included[run:run + 1], design)
        if settings.target_epsilon is not None:  # calibrated once: the later runs reuse its σ
            settings = replace(settings, target_epsilon=None, noise_multiplier=engine.noise_multiplier)
        seen = observe(engine, model, settings.steps)
        scores[run] = seen.scores()[0]
        ledger = json.dumps(engine.ledger.state_dict(), sort_keys=True)
        if ledger not in epsilons:  # runs of one configuration record the same ledger: ε once
            epsilons[ledger] = engine.epsilon()
    delta = engine.target_delta
    half = runs // 2
    pick_scores, pick_included = scores[:half], included[:half]
    thresholds = np.concatenate([[-np.inf], np.sort(pick_scores)])
    threshold = max(thresholds, key=lambda t: clopper_pearson_epsilon_bound(
        *_errors(pick_scores, pick_included, t), delta=delta, confidence=settings.confidence))
    fp, negatives, fn, positives = _errors(scores[half:], included[half:], threshold)
    bound = 0.0
    if negatives and positives:
        bound = clopper_pearson_epsilon_bound(fp, negatives, fn, positives, delta, settings.confidence)
    return AuditResult(kind=f"multi-run Clopper–Pearson ({runs} runs)", epsilon=max(epsilons.values()),
                       delta=delta, epsilon_lower_bound=bound, confidence=settings.confidence,
                       canaries=1, guesses=runs - half, correct=runs - half - fp - fn,
                       steps=settings.steps, recorded_steps=engine.steps)
