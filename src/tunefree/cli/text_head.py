"""The inputs of a text run's head: the frozen encoder's mean-pooled states, each scaled to unit length,
centred on a private estimate of their mean and multiplied by √d (d the states' width).

Why (benchmarks/RESULTS.md §5i): a sentence encoder's pooled states share a large common direction (on the
generated reviews the mean state has norm 2.3 against a spread of 3.5 around it). Under AUTO-S every
example's clipped gradient has norm 1, whatever its loss, so a linear head moves along the classes' summed
directions weighted by their counts: with that common direction in them, the sum points towards the majority
class, and on a 70/30 data set the head predicted the majority (0.65–0.68 on validation at ε = 8 where a
non-private logistic regression reaches 0.72). Centring removes the common direction; unit length bounds
each example's contribution to the mean (sensitivity 1, whatever the model), and √d puts each coordinate at
about unit scale, as a standardised table column is.

The mean is one Gaussian release: the sum of the training rows' unit vectors has L2 sensitivity 1 (one row
adds or removes one unit vector), its noise σ·1 with σ that of a release taking :data:`CENTRE_SHARE` of the
budget's μ² (μ-GDP: docs/cli.md, *Shares are of μ²*); the event goes into the run's ledger before the
first step, and training is calibrated on the whole ledger. N is public. With ``--epsilon inf`` the mean is
exact.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..privacy import release_gaussian, side_randomness
from .releases import Budget, Release

CENTRE_SHARE = 0.05  # of the budget's μ²: the release of the states' mean
CENTRE_STREAM = 0xCE47E


def unit_rows(states: torch.Tensor) -> torch.Tensor:
    """Each row scaled to unit L2 norm (a function of that row alone; a zero row stays zero)."""
    return F.normalize(states.to(torch.float64), dim=1)


def release_centre(states: torch.Tensor, train_rows, budget: Budget, seed: int | None
                   ) -> tuple[torch.Tensor, Release]:
    """The mean of the training rows' unit-length states, released with Gaussian noise (exact with no
    privacy), and the release."""
    units = unit_rows(states[torch.as_tensor(train_rows)])
    total, count = units.sum(0), len(units)
    sigma = budget.noise(CENTRE_SHARE)
    if budget.private:
        total, event = release_gaussian(total, 1.0, sigma, side_randomness(seed, CENTRE_STREAM))
        events = (event,)
    else:
        events = ()
    centre = total / count
    return centre, Release("centre of the pooled states", CENTRE_SHARE, sigma, events,
                           {"sensitivity": 1.0, "dimensions": units.shape[1],
                            "centre_norm": float(centre.norm())})


def head_inputs(states: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """(unit-length states − centre)·√d, float32: what the head reads."""
    return ((unit_rows(states) - centre) * math.sqrt(states.shape[1])).to(torch.float32)


def fold(weight: torch.Tensor, bias: torch.Tensor, centre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and bias of the same head on the unit-length states themselves: W·(u − c)·√d + b =
    (√d·W)·u + (b − √d·W·c). The saved head reads unit-length states (no centre to keep beside it)."""
    scale = math.sqrt(weight.shape[1])
    folded = weight.to(torch.float64) * scale
    return folded.to(weight.dtype), (bias.to(torch.float64) - folded @ centre).to(bias.dtype)
