"""One source of randomness per run: Poisson sampling and every noise draw derive from it.

By default every random number comes from the operating system's cryptographically secure generator
(``os.urandom``): nobody can replay the noise, and a resumed run continues from the ledger and the
sampler's position. A seed is the user's explicit request for a reproducible run: sampling and noise then
come from ``torch.Generator`` streams derived from it (``numpy.random.SeedSequence``) — the batch of
logical step ``t`` from its own stream keyed by ``t`` (so loader prefetching never changes which examples
a step sees), noise from one generator per device whose state is checkpointed, so that a resumed run
continues bit for bit. Anyone who knows the seed can replay the noise and remove it.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

_SAMPLING, _NOISE = 1, 2
SEEDED_WARNING = "seeded (reproducible: anyone who knows the seed can remove the noise)"


def _derive(seed: int, *key: int) -> int:
    return int(np.random.SeedSequence([seed, *key]).generate_state(1, np.uint64)[0] >> 1)


def _secure_uniform(count: int) -> torch.Tensor:
    """Uniform floats in (0, 1) with 53 random bits each, from ``os.urandom``."""
    raw = np.frombuffer(os.urandom(8 * count), dtype=np.uint64) >> np.uint64(11)
    return torch.from_numpy((raw.astype(np.float64) + 0.5) / float(2**53))


def _secure_normal(count: int) -> torch.Tensor:
    """``count`` standard normals (float64) from ``os.urandom``: Box-Muller, both of each pair used."""
    half = (count + 1) // 2
    uniform = _secure_uniform(2 * half)  # one read of the OS generator
    radius = uniform[:half].log_().mul_(-2).sqrt_()
    angle = uniform[half:].mul_(2 * math.pi)
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:count]


def _draw_normals(count: int) -> torch.Tensor:
    return _secure_normal(count)  # looked up at each draw, so that a test can replace it


def _draw_uniforms(count: int) -> torch.Tensor:
    return _secure_uniform(count)


class _SecureDrawAhead:
    """Secure draws (``draw(count)``: normals for the noise, uniforms for Poisson sampling) made one use
    ahead, on a background thread, while the model computes.

    Each block of ``count`` values is an independent draw from ``os.urandom``, handed out once and then
    forgotten; the next block of the same size is drawn at once in the background, for the next use of
    that size. Drawing early changes nothing of the values' distribution or secrecy (they never leave this
    process before they are used). A forked process never takes over a block drawn before the fork (both
    processes would hold the same values): it draws its own."""

    SIZES = (1024, 1 << 22)  # block sizes drawn ahead: large enough to matter, small enough to hold twice

    def __init__(self, draw: Callable[[int], torch.Tensor]) -> None:
        self._draw = draw
        self._forget()

    def _forget(self) -> None:
        self._pid = os.getpid()
        self._executor: ThreadPoolExecutor | None = None
        self._ahead: dict[int, Future] = {}

    def take(self, count: int) -> torch.Tensor:
        """``count`` fresh values."""
        if self._pid != os.getpid():  # a forked child: drop what the parent drew ahead
            self._forget()
        ahead = self._ahead.pop(count, None)
        z = ahead.result() if ahead is not None else self._draw(count)
        if self.SIZES[0] <= count <= self.SIZES[1]:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tunefree-draw")
            self._ahead[count] = self._executor.submit(self._draw, count)
        return z


class Randomness:
    """Samples and noise for one run.

    Args:
        seed: ``None`` (default): every draw is secret, from ``os.urandom``. An int makes the run
            reproducible (and resumable bit for bit) — and its noise removable by anyone who knows it.
        secure: force secret draws even if ``seed`` is given (the seed is then unused;
            :func:`run_randomness` refuses that pair from a user).
    """

    def __init__(self, seed: int | None = None, secure: bool = False):
        self.secure = secure or seed is None
        self.seed = None if self.secure else int(seed)  # type: ignore[arg-type]
        self._noise: dict[str, torch.Generator] = {}
        self._normals_ahead = _SecureDrawAhead(_draw_normals)
        self._uniforms_ahead = _SecureDrawAhead(_draw_uniforms)

    @property
    def description(self) -> str:
        """How this run draws its randomness, as reports and checkpoints say it."""
        return "secure" if self.secure else SEEDED_WARNING

    def inclusion(self, step: int, num_examples: int, sample_rate: float) -> torch.Tensor:
        """Which examples logical step ``step`` includes: each independently with ``sample_rate``."""
        if self.secure:
            uniform = self._uniforms_ahead.take(num_examples)
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
        return self.normals([shape], device, dtype)[0]

    def normals(self, shapes: list[torch.Size], device: torch.device, dtype: torch.dtype
                ) -> list[torch.Tensor]:
        """Independent standard normal noise of each shape; secure draws are made in one piece (one
        read of the OS generator and one transfer to ``device`` for all of them)."""
        if not self.secure:
            generator = self._generator(device)
            return [torch.randn(shape, generator=generator, device=device, dtype=dtype) for shape in shapes]
        sizes = [math.prod(shape) for shape in shapes]
        z = self._normals_ahead.take(sum(sizes))
        if device.type == "cuda":  # a copy from pinned memory does not wait for the GPU's queued work
            z = z.pin_memory().to(device=device, dtype=dtype, non_blocking=True)
        else:
            z = z.to(device=device, dtype=dtype)
        return [chunk.reshape(shape) for chunk, shape in zip(z.split(sizes), shapes)]

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "secure": self.secure, "randomness": self.description,
                "noise": {k: g.get_state() for k, g in self._noise.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["secure"] != self.secure:
            saved, here = ("secure", "seeded") if state["secure"] else ("seeded", "secure")
            raise ValueError(
                f"this checkpoint is of a {saved} run and this run is {here}: resume it as it was made "
                f"({'without seed=' if state['secure'] else 'with seed= (the checkpoint seed is used)'})")
        self.seed = state["seed"]
        self._noise = {}
        for key, generator_state in state["noise"].items():
            self._generator(torch.device(key)).set_state(generator_state)


def run_randomness(seed: int | None, secure_rng: bool) -> Randomness:
    """The randomness of a run from ``make_private``'s ``seed`` and ``secure_rng``: secret unless a seed
    asks for a reproducible run; both together contradict each other and are refused."""
    if secure_rng and seed is not None:
        raise ValueError(
            f"secure_rng=True and seed={seed!r} contradict each other: a seed makes the noise reproducible "
            "by anyone who knows it. Drop seed for a secret run (the default) or drop secure_rng for a "
            "reproducible one")
    return Randomness(seed)


def side_randomness(seed: int | None, stream: int) -> Randomness:
    """A source for a release made outside the training run (e.g. the CLI's private standardisation):
    secure when ``seed`` is ``None``; otherwise a stream derived from the seed and ``stream`` that no other
    release of the run draws from."""
    return Randomness() if seed is None else Randomness(_derive(int(seed), stream))
