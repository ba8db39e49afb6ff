"""The black-box input-canary audit of a user's own model and data: the realistic adversary, who sees
the final model only. LOOSE: without the intermediate releases, ε_LB is typically far below ε even for
a correct run; it catches gross leaks (a model that memorises its canaries), never proves tightness.

Canaries are examples of the user's choosing (e.g. mislabelled ones), each added to the data set
independently with probability ½; after training, the user's score (e.g. the negative loss) ranks
them; ε_LB is the larger of the one-run (ε, δ) and f-DP bounds (:mod:`.combined`) of the top-k/bottom-k
guesses.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from torch import nn
from torch.utils.data import ConcatDataset, Dataset, Subset

from ..run import DPEngine
from .combined import one_run_bounds
from .design import design_generator
from .result import AuditResult


def black_box_audit(train: Callable[[Dataset], DPEngine], data: Dataset, canaries: Dataset,
                    score: Callable[[nn.Module, Dataset], np.ndarray], confidence: float = 0.95,
                    seed: int | None = None) -> AuditResult:
    """Audit a training procedure from its final model.

    Args:
        train: trains privately (through ``make_private``) on the data set it is given and returns the
            engine after training; its ledger gives the claimed ε.
        data: the real training data.
        canaries: m candidate examples; each joins the training data with probability ½.
        score: ``score(model, canaries)`` → one number per canary, higher meaning "trained on"
            (e.g. minus its loss).
        confidence: of ε_LB.
        seed: seeds which canaries are included (``None``: secure randomness).
    """
    m = len(canaries)  # type: ignore[arg-type]
    included = design_generator(seed).random(m) < 0.5
    engine = train(ConcatDataset([data, Subset(canaries, np.flatnonzero(included).tolist())]))
    if not isinstance(engine, DPEngine):
        raise TypeError(f"train must return the DPEngine of its run, got {type(engine).__name__}")
    scores = np.asarray(score(engine.model, canaries), dtype=float)
    if scores.shape != (m,):
        raise ValueError(f"score must return one number per canary ({m}), got shape {scores.shape}")
    bounds = one_run_bounds(scores, included, engine.ledger.event(), engine.target_delta, confidence)
    return AuditResult(kind="black-box input-canary", epsilon=engine.epsilon(),
                       delta=engine.target_delta, epsilon_lower_bound=bounds.best, confidence=confidence,
                       canaries=m, guesses=bounds.guesses.guesses, correct=bounds.guesses.correct,
                       steps=engine.steps, recorded_steps=engine.steps, loose=True,
                       steinke_bound=bounds.steinke, fdp_bound=bounds.fdp)
