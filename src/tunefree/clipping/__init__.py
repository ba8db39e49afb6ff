"""What "clipped" means: clip functions (``functions.py``) and clip groups with their thresholds
(``groups.py``). Pure: no hooks, no noise."""

from .functions import CLIP_FUNCTIONS, ClipFunction, register_clip_function
from .groups import GROUPINGS, ClipGroup, register_grouping

__all__ = ["CLIP_FUNCTIONS", "GROUPINGS", "ClipFunction", "ClipGroup", "register_clip_function",
           "register_grouping"]
