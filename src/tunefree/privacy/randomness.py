"""A run's noise source: Poisson sampling and every noise draw come from one object.

Two kinds, told apart by what they promise (not by a flag to fork on):

- :class:`SecretSource` (the default): every number comes from ChaCha20, a cryptographically secure
  generator, under a key that each process reads from the operating system (``os.urandom``) and never
  writes anywhere (``chacha20.py``; docs/randomness.md). Nobody can replay the noise — not the run
  itself, not whoever reads its checkpoint — and a resumed run continues from the ledger and the
  sampler's position.
- :class:`SeededSource`: a seed is the user's explicit request for a reproducible run. Sampling and noise
  come from ``torch.Generator`` streams derived from it (``numpy.random.SeedSequence``): the batch of
  logical step ``t`` from its own stream keyed by ``t`` (so loader prefetching never changes which
  examples a step sees), noise from one generator per device whose state is checkpointed, so that a
  resumed run continues bit for bit. Anyone who knows the seed can replay the noise and remove it.

Every source says ``secret`` (what the guarantee may claim: the noise cannot be removed by anyone) and
``replayable`` (every process holding the same source draws the same numbers, so ranks can replay one
stream instead of splitting the draws).
"""

from __future__ import annotations

import math
import secrets
import zlib
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from .chacha20 import ChaCha20Generator

_SAMPLING, _NOISE = 1, 2
SECRET_DESCRIPTION = "secure"
SEEDED_WARNING = "seeded (reproducible: anyone who knows the seed can remove the noise)"


@runtime_checkable
class NoiseSource(Protocol):
    """Where a run's sampling and noise come from.

    ``secret``: nobody can reproduce the draws (a guarantee may then be stated without a caveat).
    ``replayable``: every process holding an equal source draws the same numbers in the same order (ranks
    may replay one stream); the seed, if any, is ``seed``."""

    secret: bool
    replayable: bool
    seed: int | None

    @property
    def description(self) -> str:
        """How the run draws its randomness, as reports and checkpoints say it."""

    def normals(self, shapes: Sequence[torch.Size], device: torch.device, dtype: torch.dtype
                ) -> list[torch.Tensor]:
        """Independent standard Gaussians of each shape, on ``device`` in ``dtype`` (one draw)."""

    def normal(self, shape: torch.Size, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``normals`` of one shape."""

    def normals_at(self, sizes: Sequence[int], ranges: Sequence[tuple[int, int]], device: torch.device,
                   dtype: torch.dtype) -> list[torch.Tensor]:
        """Gaussians for coordinates ``[a, b)`` of each of one draw's pieces of ``sizes`` coordinates (flat):
        this process's part of noise that several processes share out. Every process asking about the
        same pieces stays at the same place of a replayable stream."""

    def owned_range(self, count: int, shard: tuple[int, int]) -> tuple[int, int]:
        """Which coordinates ``[a, b)`` of ``count`` rank ``shard[0]`` of ``shard[1]`` noises when each
        coordinate must be noised by exactly one rank."""

    def inclusion(self, step: int, num_examples: int, sample_rate: float) -> torch.Tensor:
        """Poisson sampling: which examples logical step ``step`` includes (bool, CPU)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (never a secret key)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict``; a checkpoint of the other kind is refused."""


def _derive(seed: int, *key: int) -> int:
    return int(np.random.SeedSequence([seed, *key]).generate_state(1, np.uint64)[0] >> 1)


class _Source:
    """What both kinds share: the mode check of a checkpoint and the derived forms of ``normals``."""

    secret: bool
    replayable: bool
    seed: int | None

    @property
    def description(self) -> str:
        """How this run draws its randomness, as reports and checkpoints say it."""
        return SECRET_DESCRIPTION if self.secret else SEEDED_WARNING

    def normals(self, shapes: Sequence[torch.Size], device: torch.device, dtype: torch.dtype
                ) -> list[torch.Tensor]:
        raise NotImplementedError

    def normal(self, shape: torch.Size, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Standard normal noise of ``shape``."""
        return self.normals([shape], device, dtype)[0]

    def _check_mode(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint of the other kind (its ``"secure"`` key is the format of 0.1)."""
        if bool(state["secure"]) != self.secret:
            saved, here = ("secure", "seeded") if state["secure"] else ("seeded", "secure")
            raise ValueError(
                f"this checkpoint is of a {saved} run and this run is {here}: resume it as it was made "
                f"({'without seed=' if state['secure'] else 'with seed= (the checkpoint seed is used)'})")


class SecretSource(_Source):
    """Secret randomness: every number from ChaCha20 under a key read from ``os.urandom`` by this process
    (``chacha20.py``), never written anywhere, never replayable.

    Each call draws numbers never drawn before, and two processes (two ranks, or a parent and its fork)
    hold independent keys: data-parallel ranks split the coordinates between them instead of replaying
    one stream. Noise is made on the device and in the dtype it is asked for (on a CUDA device by one
    kernel per draw)."""

    secret, replayable, seed = True, False, None

    def __init__(self) -> None:
        self._generator = ChaCha20Generator()

    @property
    def description(self) -> str:
        """``"secure"``, and for each accelerator that drew noise, which path made it (the Triton kernel,
        or the torch-operations ChaCha20 and why the kernel was not used; docs/randomness.md, Paths).
        Noise on the CPU always comes from OpenSSL's ChaCha20."""
        paths = "; ".join(f"noise on {device}: {path}" for device, path in self._generator.paths.items())
        return SECRET_DESCRIPTION + (f" ({paths})" if paths else "")

    def inclusion(self, step: int, num_examples: int, sample_rate: float) -> torch.Tensor:
        """Which examples logical step ``step`` includes: each independently with ``sample_rate``
        (``step`` is not used: every call is a fresh draw)."""
        return self._generator.bernoulli(num_examples, sample_rate)

    def normals(self, shapes: Sequence[torch.Size], device: torch.device, dtype: torch.dtype
                ) -> list[torch.Tensor]:
        """Independent standard normal noise of each shape, drawn in one piece on ``device``."""
        sizes = [math.prod(shape) for shape in shapes]
        z = self._generator.normals(sum(sizes), device, dtype)
        return [chunk.view(shape) for chunk, shape in zip(z.split(sizes), shapes)]

    def normals_at(self, sizes: Sequence[int], ranges: Sequence[tuple[int, int]], device: torch.device,
                   dtype: torch.dtype) -> list[torch.Tensor]:
        """Noise for coordinates ``[a, b)`` of pieces of ``sizes`` coordinates: a secret source draws only
        those (one draw for all), since nobody else could draw the rest of them the same."""
        return [z.reshape(-1) for z in self.normals([torch.Size([b - a]) for a, b in ranges], device, dtype)]

    def owned_range(self, count: int, shard: tuple[int, int]) -> tuple[int, int]:
        """The coordinates ``[a, b)`` of ``count`` whose noise rank ``shard[0]`` of ``shard[1]`` draws: its
        own 1/W of them (no other rank can draw them, and the noise work scales out)."""
        rank, world_size = shard
        return count * rank // world_size, count * (rank + 1) // world_size

    def state_dict(self) -> dict[str, Any]:
        """Nothing to resume from (a resumed run draws with a new key); the keys are those of 0.1."""
        return {"seed": None, "secure": True, "randomness": self.description, "noise": {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_mode(state)


class SeededSource(_Source):
    """Reproducible randomness from ``seed``: replayable bit for bit by anyone who knows the seed, who can
    then remove the noise. Poisson sampling of step ``t`` from a stream of its own keyed by ``t``; noise
    from one ``torch.Generator`` per device, whose states a checkpoint holds."""

    secret, replayable = False, True

    def __init__(self, seed: int):
        self.seed: int | None = int(seed)
        self._noise: dict[str, torch.Generator] = {}

    def inclusion(self, step: int, num_examples: int, sample_rate: float) -> torch.Tensor:
        """Which examples logical step ``step`` includes: each independently with ``sample_rate``, from
        the step's own stream (the same examples whenever it is asked)."""
        generator = torch.Generator().manual_seed(_derive(self.seed, _SAMPLING, step))
        return torch.rand(num_examples, generator=generator, dtype=torch.float64) < sample_rate

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._noise:
            kind = zlib.crc32(device.type.encode())
            generator = torch.Generator(device=device)
            generator.manual_seed(_derive(self.seed, _NOISE, kind, device.index or 0))
            self._noise[key] = generator
        return self._noise[key]

    def normals(self, shapes: Sequence[torch.Size], device: torch.device, dtype: torch.dtype
                ) -> list[torch.Tensor]:
        """Independent standard normal noise of each shape, drawn shape by shape from ``device``'s
        stream."""
        generator = self._generator(device)
        return [torch.randn(shape, generator=generator, device=device, dtype=dtype) for shape in shapes]

    def normals_at(self, sizes: Sequence[int], ranges: Sequence[tuple[int, int]], device: torch.device,
                   dtype: torch.dtype) -> list[torch.Tensor]:
        """Noise for coordinates ``[a, b)`` of pieces of ``sizes`` coordinates: every piece is drawn whole,
        as :meth:`normals` would draw it, and cut, so that every process asking for any ranges of the
        same pieces stays at the same place of the stream and one process's noise is reproduced."""
        return [z[a:b] for z, (a, b) in zip(self.normals([torch.Size([n]) for n in sizes], device, dtype),
                                            ranges)]

    def owned_range(self, count: int, shard: tuple[int, int]) -> tuple[int, int]:
        """The coordinates ``[a, b)`` of ``count`` whose noise rank ``shard[0]`` adds: all of them on rank
        0, as one process with this seed adds them; every rank draws them all (:meth:`normals_at`), so
        that every rank's stream, and its checkpoint, stays where rank 0's is."""
        return (0, count) if shard[0] == 0 else (0, 0)

    def state_dict(self) -> dict[str, Any]:
        """The seed and every device stream's position (keys of 0.1): whoever reads it can remove the
        noise."""
        return {"seed": self.seed, "secure": False, "randomness": self.description,
                "noise": {k: g.get_state() for k, g in self._noise.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the checkpoint's streams (the checkpoint's seed is used)."""
        self._check_mode(state)
        self.seed = int(state["seed"])
        self._noise = {}
        for key, generator_state in state["noise"].items():
            self._generator(torch.device(key)).set_state(generator_state)


def run_randomness(seed: int | None) -> NoiseSource:
    """The noise source of a run from ``make_private``'s ``seed``: secret unless a seed asks for a
    reproducible run."""
    return SecretSource() if seed is None else SeededSource(seed)


def secret_seed() -> int:
    """A seed from the operating system's secure generator, for randomness several processes must share
    without anyone outside knowing it (the audit canaries of a data-parallel run: rank 0 draws it, every
    rank uses it)."""
    return secrets.randbits(63)


def side_randomness(seed: int | None, stream: int) -> NoiseSource:
    """A source for a release made outside the training run (e.g. the CLI's private standardisation):
    secret when ``seed`` is ``None``; otherwise a stream derived from the seed and ``stream`` that no other
    release of the run draws from."""
    return SecretSource() if seed is None else SeededSource(_derive(int(seed), stream))
