"""tunefree: differentially private deep learning in PyTorch with no DP hyperparameters to tune."""

from .api import DPEngine, Guarantee, make_private
from .clipping import CLIP_FUNCTIONS
from .errors import PrivacyError
from .grouping import GROUPINGS
from .optim import DPOptimizer, StepReport
from .privacy.calculator import epsilon, noise_multiplier

__all__ = [
    "CLIP_FUNCTIONS", "DPEngine", "DPOptimizer", "GROUPINGS", "Guarantee", "PrivacyError",
    "StepReport", "epsilon", "make_private", "noise_multiplier",
]
__version__ = "0.1.0"
