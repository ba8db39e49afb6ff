"""One source of randomness per run: Poisson sampling and every noise draw derive from it.

Seeded runs use ``torch.Generator`` streams derived from the run's seed (``numpy.random.SeedSequence``):
the batch of logical step ``t`` comes from its own stream keyed by ``t`` (so loader prefetching never
changes which examples a step sees, and resuming needs only the step count), and noise comes from one
generator per device whose state is checkpointed. ``secure=True`` draws everything from the operating
system's cryptographically secure generator (``os.urandom``) instead; such a run cannot be replayed.
"""

from __future__ import annotations

import math
import os
import zlib
from typing import Any

import numpy as np
import torch

_SAMPLING, _NOISE = 1, 2


def _derive(seed: int, *key: int) -> int:
    return int(np.random.SeedSequence([seed, *key]).generate_state(1, np.uint64)[0] >> 1)


def _secure_uniform(count: int) -> torch.Tensor:
    """Uniform floats in (0, 1) with 53 random bits each, from ``os.urandom``."""
    raw = np.frombuffer(os.urandom(8 * count), dtype=np.uint64) >> np.uint64(11)
    return torch.from_numpy((raw.astype(np.float64) + 0.5) / float(2**53))


class Randomness:
    """Samples and noise for one run.

    Args:
        seed: makes the run reproducible (and resumable bit for bit); ``None`` draws a seed from the OS.
        secure: draw every random number from ``os.urandom`` (cryptographically secure), ignoring
            ``seed``.
    """

    def __init__(self, seed: int | None = None, secure: bool = False):
        self.secure = secure
        self.seed = int.from_bytes(os.urandom(8), "little") >> 1 if seed is None else int(seed)
        self._noise: dict[str, torch.Generator] = {}

    def inclusion(self, step: int, num_examples: int, sample_rate: float) -> torch.Tensor:
        """Which examples logical step ``step`` includes: each independently with ``sample_rate``."""
        if self.secure:
            uniform = _secure_uniform(num_examples)
        else:
            generator = torch.Generator().manual_seed(_derive(self.seed, _SAMPLING, step))
            uniform = torch.rand(num_examples, generator=generator, dtype=torch.float64)
        return uniform < sample_rate

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._noise:
            kind = zlib.crc32(device.type.encode())
            generator = torch.Generator(device=device)
            generator.manual_seed(_derive(self.seed, _NOISE, kind, device.index or 0))
            self._noise[key] = generator
        return self._noise[key]

    def normal(self, shape: torch.Size, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Standard normal noise of ``shape``."""
        if self.secure:
            count = math.prod(shape)
            u1, u2 = _secure_uniform(count), _secure_uniform(count)
            z = torch.sqrt(-2 * torch.log(u1)) * torch.cos(2 * math.pi * u2)  # Box-Muller
            return z.reshape(shape).to(device=device, dtype=dtype)
        return torch.randn(shape, generator=self._generator(device), device=device, dtype=dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "secure": self.secure,
                "noise": {k: g.get_state() for k, g in self._noise.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.secure = state["seed"], state["secure"]
        self._noise = {}
        for key, generator_state in state["noise"].items():
            self._generator(torch.device(key)).set_state(generator_state)
