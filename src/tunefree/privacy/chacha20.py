"""The secret source's generator: ChaCha20 (RFC 8439) in counter mode, keyed once per process from
``os.urandom``, turned into Gaussian noise and Poisson-sampling decisions on the device that uses them.

Why it is secret. The 256-bit key is read from ``os.urandom`` at a process's first draw and again in any
process forked from it (checked at every draw); it lives in this object's memory only (and, for a CUDA
draw, in a 32-byte tensor on that device) and is never written to a checkpoint: a resumed run is a new
process with a new key. ChaCha20 keyed with a secret key is a pseudorandom function of the 128-bit block
input, so as long as no input repeats under one key its output cannot be told from random bits without
the key. The input never repeats: every draw of a process takes the next *draw number* (never reused),
and within a draw every 64-byte block takes the next block counter::

    words 0-3   RFC 8439 constants          words 12   block counter, 0, 1, … within one draw
    words 4-11  the key                     word 13    0
                                            words 14, 15  the draw number, 31 bits each

A draw longer than 2³² blocks (256 GiB) continues under the next draw number. Two processes (two ranks,
or a parent and its child) hold independent keys, so their numbers are independent whatever their
counters. The same layout is computed by OpenSSL on the CPU (through ``cryptography``) and by one Triton
kernel on a CUDA device (``chacha20_triton``); ``torch``'s own generators (Philox, Mersenne Twister)
are not cryptographic and are not used.

From words to numbers (docs/randomness.md gives the reasons). Gaussians come in *groups* of 2048 (a draw
is a whole number of groups; the numbers past the count asked for are dropped), each from its own
consecutive blocks of the draw's keystream, read as 1024 *radius* numbers R (64-bit, little-endian: words
2i, 2i+1) followed by 1024 *angle* numbers A (32-bit for float32, bfloat16 and float16 outputs: a group
of 192 blocks; 64-bit for float64: 256 blocks), all read as signed integers. Pair i of the group gives
Gaussians i and 1024 + i of the group (Box–Muller, both outputs used)::

    u = |R + ½|·2⁻⁶³   (float64: uniform on the 2⁶³ points (k + ½)·2⁻⁶³, never 0, fine near 0 and 1)
    r = √(−2 ln u)     (ln u in float64; the rest in float32, or float64 for float64 outputs)
    θ = 2π·A·2⁻³²  or  2π·A·2⁻⁶⁴   (in [−π, π), in the output's working precision)
    z_i = r cos θ,  z_(1024+i) = r sin θ

Poisson sampling, 8 decisions per block: words 2i, 2i+1 as a 64-bit U (unsigned); example i is included
iff ``U < ⌊q·2⁶⁴⌋`` (an inclusion probability within 2⁻⁶⁴ of q, compared in integers).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import os
import threading
from collections.abc import Iterator

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

BLOCK_BYTES = 64
MAX_BLOCKS = 1 << 32  # blocks under one draw number (the 32-bit block counter)
PAIRS = 1024  # Box–Muller pairs per group: a group gives 2048 Gaussians
_CHUNK_GROUPS = 32  # CPU: groups turned into Gaussians at a time (their words stay in cache)
_CHUNK_BLOCKS = 256 * _CHUNK_GROUPS  # the largest CPU chunk: 512 KiB of keystream
_ZEROS = memoryview(bytes(_CHUNK_BLOCKS * BLOCK_BYTES))  # ChaCha20 of zeros is the keystream
_TWO_PI = 2 * math.pi


def group_blocks(dtype: torch.dtype) -> int:
    """Keystream blocks per group of 2048 Gaussians: 64-bit radii, and 32-bit angles (64-bit for
    float64 outputs)."""
    return 256 if dtype == torch.float64 else 192


def nonce_words(draw: int) -> tuple[int, int, int]:
    """Words 13-15 of the state of draw number ``draw`` (< 2⁶²)."""
    return 0, draw & 0x7FFFFFFF, draw >> 31


class ChaCha20Generator:
    """Secret numbers from ChaCha20 under a key of this process (see the module's docstring).

    Not replayable by design: nothing in it can be saved, and every call draws numbers never drawn
    before by this process. Calls from several threads are served one at a time."""

    def __init__(self) -> None:
        self._process: _ProcessState | None = None  # made at the first draw, again in a forked child

    def __getstate__(self) -> dict:
        """A pickled (or deep-copied) generator carries no key: the copy reads its own at its first draw."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self._process = None

    def _state(self) -> _ProcessState:
        if self._process is None or self._process.pid != os.getpid():
            self._process = _ProcessState()
        return self._process

    def _key(self) -> bytes:
        return self._state().key

    @staticmethod
    def _segments(state: _ProcessState, blocks: int, unit: int = 1) -> list[tuple[int, int, int]]:
        """``(draw number, first block, blocks)`` for a draw of ``blocks`` blocks: a new draw number for
        each run of up to 2³² blocks (cut at a multiple of ``unit`` blocks, so that no group is split)."""
        step = MAX_BLOCKS // unit * unit
        return [(next(state.draws), start, min(step, blocks - start)) for start in range(0, blocks, step)]

    def device_key(self, device: torch.device) -> torch.Tensor:
        """The key as 8 little-endian int32 words on ``device`` (for the CUDA kernel)."""
        state = self._state()
        if device not in state.device_keys:
            state.device_keys[device] = torch.frombuffer(bytearray(state.key), dtype=torch.int32).to(device)
        return state.device_keys[device]

    def normals(self, count: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``count`` independent standard Gaussians of ``dtype`` on ``device``, flat."""
        if count == 0:
            return torch.empty(0, device=device, dtype=dtype)
        groups, per_group = -(-count // (2 * PAIRS)), group_blocks(dtype)
        state = self._state()
        if device.type == "cuda" and _triton_available():
            from . import chacha20_triton

            key = self.device_key(device)
            out = torch.empty(groups * 2 * PAIRS, device=device, dtype=dtype)
            with state.lock:
                for draw, first, blocks in self._segments(state, groups * per_group, per_group):
                    start = first // per_group * 2 * PAIRS
                    chacha20_triton.normals(out[start:start + blocks // per_group * 2 * PAIRS], key, draw)
            return out[:count]
        work = torch.float64 if dtype == torch.float64 else torch.float32
        out = torch.empty(groups, 2, PAIRS, dtype=work)
        with state.lock:
            scratch = state.scratch(work)
            for draw, first, blocks in self._segments(state, groups * per_group, per_group):
                stream = Keystream(state.key, 0, nonce_words(draw), blocks, per_group * _CHUNK_GROUPS,
                                   state.buffer)
                for chunk_first, words in stream.chunks():
                    group = (first + chunk_first) // per_group
                    normals_from_words(words.view(-1, per_group * 16),
                                       out[group:group + len(words) // per_group], scratch)
        return out.view(-1)[:count].to(device=device, dtype=dtype)

    def bernoulli(self, count: int, probability: float) -> torch.Tensor:
        """``count`` independent decisions, each True with ``probability`` (within 2⁻⁶⁴), on the CPU."""
        if not 0 <= probability <= 1:
            raise ValueError(f"probability must lie in [0, 1], got {probability}")
        if count == 0:
            return torch.empty(0, dtype=torch.bool)
        blocks = -(-count // 8)
        words = torch.empty(blocks, 16, dtype=torch.int32)
        state = self._state()
        with state.lock:
            for draw, start, length in self._segments(state, blocks):
                for first, chunk in Keystream(state.key, 0, nonce_words(draw), length,
                                              buffer=state.buffer).chunks():
                    words[start + first:start + first + len(chunk)] = chunk
        unsigned = words.view(torch.int64).reshape(-1)[:count]  # U − 2⁶³·[U ≥ 2⁶³] as int64
        threshold = math.floor(probability * 2.0**64)
        if threshold >= 1 << 64:
            return torch.ones(count, dtype=torch.bool)
        # U < T in unsigned integers ⇔ (U − 2⁶³) < (T − 2⁶³) in signed ones
        return (unsigned ^ torch.tensor(-(1 << 63))) < threshold - (1 << 63)


class _ProcessState:
    """What a generator holds in one process: the key (read from ``os.urandom``), the draw counter, the
    CPU path's reused buffers and the lock that serialises draws. A forked child makes its own."""

    def __init__(self) -> None:
        self.pid, self.key = os.getpid(), os.urandom(32)
        self.draws = itertools.count()
        self.lock = threading.Lock()
        self.buffer = bytearray(_CHUNK_BLOCKS * BLOCK_BYTES)
        self.device_keys: dict[torch.device, torch.Tensor] = {}
        self._scratch: dict[torch.dtype, _Scratch] = {}

    def scratch(self, work: torch.dtype) -> _Scratch:
        if work not in self._scratch:
            self._scratch[work] = _Scratch(_CHUNK_GROUPS, work)
        return self._scratch[work]


@functools.cache
def _triton_available() -> bool:
    """Whether the CUDA kernel can run: triton 3.2 or later (CUDA builds of torch bring triton on Linux;
    without it, CUDA noise is made on the CPU and copied)."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 2)


class Keystream:
    """``blocks`` blocks of ChaCha20 keystream on the CPU (OpenSSL, through ``cryptography``): block ``i``
    under block counter ``counter + i`` and nonce words ``nonce`` (state words 13-15). Handed out in
    cache-sized chunks of words (int32, one row of 16 per block) in one buffer, overwritten from chunk to
    chunk (``buffer``: reuse the caller's)."""

    def __init__(self, key: bytes, counter: int, nonce: tuple[int, int, int], blocks: int,
                 chunk: int = _CHUNK_BLOCKS, buffer: bytearray | None = None):
        counter_and_nonce = b"".join(w.to_bytes(4, "little") for w in (counter, *nonce))
        self._cipher = Cipher(algorithms.ChaCha20(key, counter_and_nonce), mode=None).encryptor()
        self._blocks, self._chunk = blocks, min(chunk, _CHUNK_BLOCKS)
        self._buffer = bytearray(min(blocks, self._chunk) * BLOCK_BYTES) if buffer is None else buffer

    def chunks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first block, words)`` of each chunk, in order."""
        size = min(self._blocks, self._chunk)
        words = torch.frombuffer(self._buffer, dtype=torch.int32, count=size * 16).view(size, 16)
        for first in range(0, self._blocks, size):
            length = min(size, self._blocks - first)
            self._cipher.update_into(_ZEROS[:length * BLOCK_BYTES], self._buffer)  # keystream ⊕ 0
            yield first, words[:length]


class _Scratch:
    """Work buffers of one CPU draw, reused from chunk to chunk (no allocation per chunk)."""

    def __init__(self, groups: int, work: torch.dtype):
        self.log_u = torch.empty(groups, PAIRS, dtype=torch.float64)
        self.radius = torch.empty(groups, PAIRS, dtype=work)
        self.angle = torch.empty(groups, PAIRS, dtype=work)
        self.trig = torch.empty(groups, PAIRS, dtype=work)


def normals_from_words(words: torch.Tensor, out: torch.Tensor, scratch: _Scratch) -> None:
    """The Gaussians of whole groups of keystream ``words`` (int32, one row per group) into ``out``
    (``[groups, 2, 1024]``, float32 or float64), as the module's docstring lays them out."""
    groups = len(words)
    log_u, radius = scratch.log_u[:groups], scratch.radius[:groups]
    angle, trig = scratch.angle[:groups], scratch.trig[:groups]
    log_u.copy_(words[:, :2 * PAIRS].view(torch.int64)).add_(0.5).abs_().mul_(2.0**-63).log_()
    radius.copy_(log_u).mul_(-2.0).sqrt_()
    if out.dtype == torch.float64:
        angle.copy_(words[:, 2 * PAIRS:].view(torch.int64)).mul_(_TWO_PI * 2.0**-64)
    else:
        angle.copy_(words[:, 2 * PAIRS:]).mul_(_TWO_PI * 2.0**-32)
    torch.mul(radius, torch.cos(angle, out=trig), out=out[:, 0])
    torch.mul(radius, angle.sin_(), out=out[:, 1])
