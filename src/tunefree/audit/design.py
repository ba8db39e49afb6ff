"""The audit's model and data: real examples, and gradient canaries on coordinates of their own.

Canary j's gradient is ``−κ·eⱼ`` on row j of an embedding that only canaries use (real examples look up
its padding row, which gets no gradient), and zero everywhere else: the body has no biases and a
canary's features are zero. κ is large, so every clip function clips a canary to its group's full
threshold: an included canary adds exactly its sensitivity to coordinate j of the released sum.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
import torch.nn.functional as F
from numpy.random import PCG64, Generator
from torch import nn
from torch.utils.data import TensorDataset

CANARY_GRADIENT = 1e4  # κ: far above any threshold, so that each clip function gives the full threshold
FEATURES = 8
HIDDEN = 16
MAX_DENOMINATOR = 10_000  # the sampling rate must be a fraction a/b with b at most this (q·N whole)


class CanaryModel(nn.Module):
    """``body(x) + canary[id]``: a small bias-free MLP for the real examples and one embedding row per
    canary (row ``canaries`` is the padding row that real examples look up)."""

    def __init__(self, canaries: int):
        super().__init__()
        self.canaries = canaries
        self.body = nn.Sequential(nn.Linear(FEATURES, HIDDEN, bias=False), nn.Tanh(),
                                  nn.Linear(HIDDEN, 1, bias=False))
        self.canary = nn.Embedding(canaries + 1, 1, padding_idx=canaries)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(-1) + self.canary(ids).squeeze(-1)


def per_example_losses(model: CanaryModel, x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor
                       ) -> torch.Tensor:
    """Logistic loss for real examples; ``−κ·output`` for canaries (a constant gradient ``−κ·eⱼ``)."""
    out = model(x, ids)
    is_canary = ids < model.canaries
    return torch.where(is_canary, -CANARY_GRADIENT * out, F.softplus(-y * out))


def design_generator(seed: int | None) -> Generator:
    """The auditor's own random choices (which canaries are in, the synthetic real examples): the
    design of the experiment, not release noise — nothing drawn here is released or touches private
    data. Secure seeding unless ``seed`` asks for a reproducible audit."""
    return Generator(PCG64(secrets.randbits(63) if seed is None else seed))


@dataclass(frozen=True)
class CanaryData:
    """The audit's private data set: ``real`` real examples and the included canaries."""

    dataset: TensorDataset
    batch_size: int
    real: int


def canary_data(included: torch.Tensor, sample_rate: float, min_real: int,
                generator: Generator) -> CanaryData:
    """Real examples (at least ``min_real``, more so that q·N is a whole batch size) and the canaries
    with ``included[j]``; each canary is an example of its own, absent when not included."""
    rate = Fraction(sample_rate).limit_denominator(MAX_DENOMINATOR)
    if not 0 < sample_rate <= 1 or abs(float(rate) - sample_rate) > 1e-12:
        raise ValueError(f"the audit needs a sampling rate in (0, 1] that is a fraction with a "
                         f"denominator of at most {MAX_DENOMINATOR}, got {sample_rate}")
    present = torch.nonzero(included).flatten()
    total = min_real + len(present)
    total += -total % rate.denominator  # N a multiple of the denominator: q·N is whole
    real = total - len(present)
    teacher = torch.from_numpy(generator.standard_normal(FEATURES, dtype=np.float32))
    features = torch.from_numpy(generator.standard_normal((real, FEATURES), dtype=np.float32))
    x = torch.cat([features, torch.zeros(len(present), FEATURES)])
    y = torch.cat([torch.sign(x[:real] @ teacher), torch.zeros(len(present))])
    ids = torch.cat([torch.full((real,), len(included)), present])
    return CanaryData(TensorDataset(x, ids, y), int(rate * total), real)
