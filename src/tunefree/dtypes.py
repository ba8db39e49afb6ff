"""The numeric precision policy: in which dtype per-sample norms, clipped sums and noise are kept."""

from __future__ import annotations

import torch


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """Per-sample norms are accumulated in float32 or wider, whatever the model's precision."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Clipped sums and noise of half-precision parameters are accumulated in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def as_norm_precision(x: torch.Tensor) -> torch.Tensor:
    return x.to(norm_dtype(x.dtype))
