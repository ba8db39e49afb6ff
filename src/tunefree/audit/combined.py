"""Both one-run bounds on one set of canary scores, paid for together: ε_LB is the larger of the
Steinke–Nasr–Jagielski (ε, δ) bound and the f-DP bound on the ledger's curve, each computed at confidence
``1 − (1 − confidence)/2`` (each over the same guess sizes, themselves paid for by a union bound), so that
the larger holds at ``confidence``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import dp_accounting as dpa
import numpy as np

from .bounds import Guesses, best_one_run_bound, default_guess_sizes, top_bottom_guesses
from .fdp import fdp_epsilon_bound


@dataclass(frozen=True)
class OneRunBounds:
    """``steinke``: the (ε, δ) bound with the ``guesses`` it came from; ``fdp``: the f-DP bound on the
    ledger's privacy curve. ``best`` is the one the verdict uses."""

    steinke: float
    fdp: float
    guesses: Guesses

    @property
    def best(self) -> float:
        return max(self.steinke, self.fdp)


def one_run_bounds(scores: np.ndarray, included: np.ndarray, event: dpa.DpEvent, delta: float,
                   confidence: float, sizes: Sequence[int] | None = None) -> OneRunBounds:
    """Both bounds from the scores of canaries (higher: "in") and their membership; ``event`` is the
    run's ledger (what it claims)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    each = 1 - (1 - confidence) / 2
    sizes = default_guess_sizes(len(scores)) if sizes is None else list(sizes)
    steinke, guesses = best_one_run_bound(scores, included, delta, each, sizes)
    tried = [top_bottom_guesses(np.asarray(scores, dtype=float), np.asarray(included, dtype=bool), k)
             for k in sizes]
    return OneRunBounds(steinke, fdp_epsilon_bound(tried, event, delta, each), guesses)
