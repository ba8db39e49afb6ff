"""Private data → released numbers, and what they cost: the noise source, the mechanisms, the planned run,
the ledger of releases, accounting and calibration.

The public part, for releases you make yourself (the command line's private preprocessing is built on
nothing else):

- **releases** (``statistics.py``): :func:`release_gaussian`, :func:`select_partitions` (with
  :func:`selection_threshold` and :func:`threshold_event`), :func:`release_quantile`; each returns its
  ``DpEvent``, to pass to ``make_private(prior_releases=[...])``;
- **their noise**: :func:`side_randomness` (a secret source, or one derived from a seed) and the
  :class:`NoiseSource` protocol;
- **accounting and calibration**: :func:`epsilon` and :func:`noise_multiplier` (a DP-SGD run),
  :func:`epsilon_of` (any composition of events), :func:`gaussian_noise_multiplier` (one Gaussian
  release of exactly (ε, δ)), :func:`planned_steps` (epochs → steps, as ``make_private`` plans them);
- the names a run accepts: :data:`ACCOUNTANTS`, :data:`NOISE_ALLOCATIONS`, and
  :data:`MIN_NOISE_MULTIPLIER`, the noise below which calibration does not go.
"""

from ..data.poisson import planned_steps
from .accounting import ACCOUNTANTS, epsilon_of
from .calculator import epsilon, gaussian_noise_multiplier, noise_multiplier
from .calibrate import MIN_NOISE_MULTIPLIER
from .mechanisms import NOISE_ALLOCATIONS
from .randomness import NoiseSource, side_randomness
from .statistics import (
    release_gaussian,
    release_quantile,
    select_partitions,
    selection_threshold,
    threshold_event,
)

__all__ = ["ACCOUNTANTS", "MIN_NOISE_MULTIPLIER", "NOISE_ALLOCATIONS", "NoiseSource", "epsilon", "epsilon_of",
           "gaussian_noise_multiplier", "noise_multiplier", "planned_steps", "release_gaussian",
           "release_quantile", "select_partitions", "selection_threshold", "side_randomness",
           "threshold_event"]
