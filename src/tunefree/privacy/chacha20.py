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
counters. ``torch``'s own generators (Philox, Mersenne Twister) are not cryptographic and are not used.

Three paths compute the same layout (``PATHS``): OpenSSL on the CPU (through ``cryptography``); on a
CUDA device, one Triton kernel per draw (``chacha20_triton``) — used once a probe draw under a public
key has built, run and matched the CPU path on that device and dtype (once per process) — else the
block function in torch integer operations on the device (:func:`device_keystream`), whose keystream
is OpenSSL's bit for bit. The generator says which path made each device's noise (:attr:`paths`).

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
import warnings
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
_DEVICE_CHUNK_GROUPS = 1024  # torch-operations path: groups per chunk (≈ 80 MiB of work tensors)
CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # RFC 8439 §2.3: "expand 32-byte k"
_MASK = 0xFFFFFFFF

OPENSSL, KERNEL, TORCH_OPS = "openssl", "triton", "torch-ops"
PATHS = {
    OPENSSL: "ChaCha20 by OpenSSL on the CPU",
    KERNEL: "ChaCha20 by the Triton kernel on the device",
    TORCH_OPS: "ChaCha20 in torch operations on the device",
}
# Device types whose noise is made on the device (by the kernel, else by torch operations); elsewhere
# it is made on the CPU and copied.
DEVICE_NOISE = frozenset({"cuda"})
PROBE_KEY = bytes(range(32))  # the probe draw's key: public, its numbers are thrown away


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
        self.paths: dict[str, str] = {}  # device → the path (a PATHS key) that made its noise, and why

    def __getstate__(self) -> dict:
        """A pickled (or deep-copied) generator carries no key: the copy reads its own at its first draw."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self._process, self.paths = None, {}

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
        """The key as 8 little-endian int32 words on ``device`` (for the on-device paths)."""
        state = self._state()
        if device not in state.device_keys:
            state.device_keys[device] = torch.frombuffer(bytearray(state.key), dtype=torch.int32).to(device)
        return state.device_keys[device]

    def path(self, device: torch.device, dtype: torch.dtype) -> str:
        """Which path makes the noise of ``dtype`` on ``device`` (a ``PATHS`` key), recorded in
        :attr:`paths` with the reason when the kernel is not used."""
        if device.type not in DEVICE_NOISE:
            return OPENSSL
        failure = kernel_failure(device, dtype)
        path = KERNEL if failure is None else TORCH_OPS
        said = PATHS[path] + ("" if failure is None else f" (the Triton kernel is not used: {failure})")
        if self.paths.get(str(device)) != said:
            if failure is not None:
                warnings.warn(f"secret noise on {device}: {said}; it is as secret and exact as the kernel, "
                              "and slower (docs/randomness.md, Paths)", RuntimeWarning, stacklevel=3)
            self.paths[str(device)] = said
        return path

    def normals(self, count: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``count`` independent standard Gaussians of ``dtype`` on ``device``, flat."""
        device = _concrete(device)
        if count == 0:
            return torch.empty(0, device=device, dtype=dtype)
        return self.normals_by(self.path(device, dtype), count, device, dtype)

    def normals_by(self, path: str, count: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`normals` by ``path`` (a ``PATHS`` key): the same numbers on every path (up to the
        rounding of ln, √, cos and sin in each library), each drawing the next draw numbers."""
        groups, per_group = -(-count // (2 * PAIRS)), group_blocks(dtype)
        state = self._state()
        work = torch.float64 if dtype == torch.float64 else torch.float32
        if path == KERNEL:
            from . import chacha20_triton

            key = self.device_key(device)
            out = torch.empty(groups * 2 * PAIRS, device=device, dtype=dtype)
            with state.lock:
                for draw, first, blocks in self._segments(state, groups * per_group, per_group):
                    start = first // per_group * 2 * PAIRS
                    chacha20_triton.normals(out[start:start + blocks // per_group * 2 * PAIRS], key, draw)
            return out[:count]
        if path == TORCH_OPS:
            key = self.device_key(device)
            out = torch.empty(groups, 2, PAIRS, device=device, dtype=work)
            with state.lock:
                for draw, first, blocks in self._segments(state, groups * per_group, per_group):
                    for start in range(0, blocks, per_group * _DEVICE_CHUNK_GROUPS):
                        length = min(per_group * _DEVICE_CHUNK_GROUPS, blocks - start)
                        words = device_keystream(key, start, nonce_words(draw), length)
                        group = (first + start) // per_group
                        normals_from_words(words.view(-1, per_group * 16),
                                           out[group:group + length // per_group],
                                           _Scratch(length // per_group, work, device))
            return out.view(-1)[:count].to(dtype)
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


def _concrete(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` → ``cuda:<current>``): one key tensor and one path per device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@functools.cache
def kernel_failure(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the Triton kernel cannot make the noise of ``dtype`` on ``device`` — or ``None`` when it can:
    it builds (Triton's compiler, and its launcher built by the machine's C compiler against
    ``Python.h``), runs, and its probe draw (one group under the public ``PROBE_KEY``) gives the CPU
    path's numbers within a few units of rounding. Probed once per process, device and dtype (one
    host read), at the first draw there."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        import triton

        if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 2):
            return f"triton {triton.__version__} is older than 3.2"
        kernel = _triton_kernel()
        out = torch.empty(2 * PAIRS, device=device, dtype=dtype)
        kernel.normals(out, torch.frombuffer(bytearray(PROBE_KEY), dtype=torch.int32).to(device), 0)
        got = out.cpu().double()
    except Exception as error:  # noqa: BLE001 - any failure to build or run means: not this path
        return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:160]}"
    work = torch.float64 if dtype == torch.float64 else torch.float32
    expected = torch.empty(1, 2, PAIRS, dtype=work)
    (_, words), = Keystream(PROBE_KEY, 0, nonce_words(0), group_blocks(dtype)).chunks()
    normals_from_words(words.view(1, -1), expected, _Scratch(1, work))
    expected = expected.view(-1).to(dtype).double()
    tolerance = 8 * torch.finfo(dtype).eps * expected.abs().clamp_min(1)
    if not bool(((got - expected).abs() <= tolerance).all()):
        return "its probe draw differs from the CPU path's numbers"
    return None


def _triton_kernel():
    """The kernel module (imported on first use: importing triton is slow)."""
    from . import chacha20_triton

    return chacha20_triton


def device_keystream(key: torch.Tensor, counter: int, nonce: tuple[int, int, int], blocks: int
                     ) -> torch.Tensor:
    """``blocks`` blocks of keystream (int32 ``[blocks, 16]``) on ``key``'s device in torch integer
    operations: block ``i`` under block counter ``counter + i`` (< 2³²) and nonce words ``nonce`` (state
    words 13-15), under ``key`` (8 int32 words). RFC 8439 §2.3's block function on 32-bit words held in
    int64 (every sum masked to 32 bits), the four quarter rounds of a column or diagonal round at once."""
    device = key.device
    initial = torch.empty(16, blocks, dtype=torch.int64, device=device)
    initial[:4] = torch.tensor(CONSTANTS, dtype=torch.int64, device=device)[:, None]
    initial[4:12] = (key.to(torch.int64) & _MASK)[:, None]
    torch.arange(counter, counter + blocks, out=initial[12])
    initial[13:] = torch.tensor(nonce, dtype=torch.int64, device=device)[:, None]
    x = initial.clone()
    rows = x.view(4, 4, blocks)  # rows a, b, c, d: [4, blocks] each, word i of row r is state word 4r + i
    for _ in range(10):
        _quarter_rounds(rows)  # columns (0, 4, 8, 12), (1, 5, 9, 13), …
        for r in (1, 2, 3):  # diagonals: row r turned left by r words, so that they become columns
            rows[r] = rows[r].roll(-r, 0)
        _quarter_rounds(rows)  # (0, 5, 10, 15), (1, 6, 11, 12), …
        for r in (1, 2, 3):
            rows[r] = rows[r].roll(r, 0)
    x.add_(initial).bitwise_and_(_MASK)
    return (x - ((x >> 31) << 32)).to(torch.int32).t().contiguous()  # [0, 2³²) read as signed int32


def _quarter_rounds(rows: torch.Tensor) -> None:
    """RFC 8439 §2.1's quarter round on the four columns (a, b, c, d) of ``rows`` at once, in place."""
    a, b, c, d = rows
    for (p, q, r), shift in zip(((a, b, d), (c, d, b), (a, b, d), (c, d, b)), (16, 12, 8, 7)):
        p.add_(q).bitwise_and_(_MASK)
        r.bitwise_xor_(p)
        spill = r >> (32 - shift)
        r.bitwise_left_shift_(shift).bitwise_and_(_MASK).bitwise_or_(spill)


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
    """Work buffers of a draw (on the CPU, reused from chunk to chunk: no allocation per chunk)."""

    def __init__(self, groups: int, work: torch.dtype, device: torch.device | str = "cpu"):
        self.log_u = torch.empty(groups, PAIRS, dtype=torch.float64, device=device)
        self.radius = torch.empty(groups, PAIRS, dtype=work, device=device)
        self.angle = torch.empty(groups, PAIRS, dtype=work, device=device)
        self.trig = torch.empty(groups, PAIRS, dtype=work, device=device)


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
