"""What a text classification run trains, and for how long, when the user does not say: chosen from the
public N (training rows) and the privacy budget, before any private value is read.

**Which weights** (``--train-weights auto``). Under AUTO-S every example's clipped gradient has norm at most
1, so the mean of a batch's clipped gradients — the signal of a step — has norm at most 1, while the noise
added to that mean has expected norm about ``σ·√d / B`` over d trained weights at expected batch B (RESULTS
§5f: at N ≈ 1,900 and ε = 8, 12.4 for all 22.7M weights of all-MiniLM-L6-v2, against a measured signal of
0.12: the run learnt the class prior only). The rule trains every weight only where that noise is at most
:data:`NOISE_TO_SIGNAL_MAX` (1: no larger than the largest signal possible), and otherwise a linear head on
the frozen encoder's mean-pooled token states (the pooling sentence encoders are trained with; the
[CLS]/pooler output of such a model carries little label signal, §5f). A reference run (``--epsilon inf``) has
no noise to weigh: it trains what a private run at :data:`REFERENCE_EPSILON`, the command line's default,
would, so that the two runs differ by the noise alone.

**How long** (a batch size or a length not given). A head is cheap (its inputs are computed once), so the
compute budget is not what binds: the batch is ``N/4`` (4 steps an epoch, at least 64 and at most
:data:`MAX_BATCH`) and the run is :data:`HEAD_STEPS` steps — RESULTS §5g: with the head on mean-pooled states,
runs of 6–12 steps stayed near the class prior (and AdamW's at 20–21 steps in 4 of 6 settings), while every
run of 40–450 steps reached 0.72–0.77 (validation) at batch sizes 128 to 1,024 and ε 1 to 8; §5i: on the
centred inputs of ``text_head.py``, 300 steps of N/4 were 0.4 validation points above 100 of N/8 on average
over five generated review sets at ε = 3 and 8 (up to 1.6 at N = 1,200–2,000, ε = 3). Every weight
costs a backward pass of the whole model per example, so there the command line's own defaults (batch 256, 3
epochs) stand, and ``--batch-size``/``--epochs``/``--steps`` set a larger compute budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import noise_multiplier
from ..privacy import planned_steps

TRAIN_WEIGHTS = ("auto", "head", "all")
NOISE_TO_SIGNAL_MAX = 1.0
HEAD_STEPS = 300
STEPS_PER_EPOCH = 4
MIN_BATCH, MAX_BATCH = 64, 1024
ALL_BATCH, ALL_EPOCHS = 256, 3.0  # every weight trained: the command line's defaults
# A reference run (ε = ∞) trains what a private run at the command line's default ε would, without noise:
# its accuracy is then what that private run's noise costs (a reference that fine-tuned every weight where the
# private run trains a head measured something else: 12 minutes, and the majority rate, issue 30).
REFERENCE_EPSILON = 3.0


@dataclass(frozen=True)
class Schedule:
    """The expected batch size and the run's length (``epochs`` or ``steps``, the other None)."""

    batch_size: int
    epochs: float | None
    steps: int | None

    def planned_steps(self, num_train: int) -> int:
        return planned_steps(self.epochs, self.steps, self.batch_size / num_train)


def schedule(weights: str, num_train: int, batch_size: int | None, epochs: float | None,
             steps: int | None) -> Schedule:
    """The batch size and length of a run training ``weights`` (``"head"`` or ``"all"``): what the user
    gave, the rest by the rules above."""
    if weights == "head":
        batch = batch_size or min(MAX_BATCH, max(MIN_BATCH, num_train // STEPS_PER_EPOCH))
        batch = min(batch, num_train)
        if epochs is None and steps is None:
            steps = HEAD_STEPS
    else:
        batch = batch_size or min(ALL_BATCH, num_train)
        if epochs is None and steps is None:
            epochs = ALL_EPOCHS
    return Schedule(batch, epochs, steps)


def noise_to_signal(weights: int, epsilon: float, delta: float, run: Schedule, num_train: int,
                    accountant: str = "pld") -> float:
    """E‖noise‖ on the mean clipped gradient, ``σ·√d/B``, of a run training ``weights`` weights at a finite
    ``epsilon``; at most 1 is the signal's largest norm under AUTO-S."""
    rate = run.batch_size / num_train
    sigma = noise_multiplier(target_epsilon=epsilon, sample_rate=rate, delta=delta, accountant=accountant,
                             steps=run.planned_steps(num_train))
    return sigma * math.sqrt(weights) / run.batch_size


def choose_weights(requested: str, all_weights: int, num_train: int, epsilon: float, delta: float,
                   batch_size: int | None, epochs: float | None, steps: int | None,
                   accountant: str = "pld") -> tuple[str, str]:
    """``"head"`` or ``"all"`` for ``--train-weights requested``, and why, as the output states it."""
    if requested != "auto":
        return requested, f"--train-weights {requested}, given"
    reference = not math.isfinite(epsilon)
    if reference:  # no noise: the recipe of a private run at the default budget, so that the two compare
        epsilon = REFERENCE_EPSILON
    run = schedule("all", num_train, batch_size, epochs, steps)
    ratio = noise_to_signal(all_weights, epsilon, delta, run, num_train, accountant)
    at = f" at ε = {epsilon:g}" if reference else ""
    if ratio <= NOISE_TO_SIGNAL_MAX:
        weights, why = "all", (f"every weight: the noise on a step's mean gradient{at}, σ√d/B = "
                               f"{ratio:.3g} for its {all_weights:,} weights, is at most "
                               f"{NOISE_TO_SIGNAL_MAX:g} (the largest signal)")
    else:
        weights, why = "head", (f"a linear head on the frozen model's mean-pooled states: training all "
                                f"{all_weights:,} weights at N = {num_train}{at} would add noise σ√d/B = "
                                f"{ratio:.3g} to each step's mean gradient, whose norm is at most "
                                f"{NOISE_TO_SIGNAL_MAX:g}; --train-weights all trains them anyway")
    if reference:
        why = (f"what a private run at the default ε = {epsilon:g} trains, without noise (a reference run): "
               f"{why}")
    return weights, why
