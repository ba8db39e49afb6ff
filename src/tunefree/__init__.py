"""tunefree: differentially private deep learning in PyTorch with no DP hyperparameters to tune."""

from . import audit, extend
from .api import make_private
from .clipping.functions import CLIP_FUNCTIONS
from .clipping.groups import GROUPINGS
from .config import PSAC, Abadi, AdaptiveQuantile, AutoS, AutoV, DoG, Fixed, HyFreeDP
from .errors import ModelRefused, PrivacyError, SettingsRefused
from .guards.independence import verify_example_independence
from .persample.model_loss import token_losses_per_example
from .pipeline import PrivatePipelineStage, make_private_pipeline
from .privacy.calculator import epsilon, noise_multiplier
from .run import DPEngine, Guarantee
from .step.component import StepReport
from .step.optimizer import DPOptimizer

__all__ = [
    "CLIP_FUNCTIONS", "DPEngine", "DPOptimizer", "GROUPINGS", "PSAC", "Abadi", "AdaptiveQuantile",
    "AutoS", "AutoV", "DoG", "Fixed", "HyFreeDP", "audit", "extend", "Guarantee", "ModelRefused",
    "PrivacyError", "SettingsRefused", "StepReport", "epsilon", "token_losses_per_example",
    "make_private", "make_private_pipeline", "noise_multiplier", "PrivatePipelineStage",
    "verify_example_independence",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``tunefree.PrivateTrainer`` (a private ``transformers.Trainer``), imported on first use so that
    ``import tunefree`` never needs ``transformers``."""
    if name == "PrivateTrainer":
        from .integrations.hf_trainer import PrivateTrainer
        return PrivateTrainer
    raise AttributeError(f"module 'tunefree' has no attribute {name!r}")
