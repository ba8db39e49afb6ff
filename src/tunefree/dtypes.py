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


def working_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype a layer's per-sample arithmetic on ``tensors`` runs in: the widest of their
    accumulation dtypes (float32 for 16-bit tensors: a 16-bit output gradient is converted where it is
    used, exactly, and never rounds a clipped sum)."""
    dtype = accumulation_dtype(tensors[0].dtype)
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, accumulation_dtype(t.dtype))
    return dtype


def accumulated(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its accumulation dtype (itself if it is already there)."""
    return x.to(accumulation_dtype(x.dtype))
