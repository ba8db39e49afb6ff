"""ChaCha20 Gaussians on a CUDA device: one Triton kernel per draw computes the keystream blocks and turns
them into Gaussians of the output's dtype, with the layout and arithmetic of ``chacha20.py`` (its
docstring is the specification; the CPU path computes the same uniforms bit for bit).

Work and stores (docs/gpu.md, *The noise kernel*). A group of 2048 Gaussians is 64 *lanes* of work: lane
k computes radius blocks 2k and 2k + 1 and its angle block(s), and makes pairs 16k … 16k + 15. A program
of ``warps`` warps runs one lane per thread (``warps / 2`` groups), so no two threads compute the same
block. Each lane's 16 Gaussians are joined into one row of a ``[lanes, 16]`` tile whose row ``k`` is
output elements 16k … 16k + 15: consecutive lanes write consecutive 64-byte rows, which Triton stores
as wide, coalesced writes (through shared memory where its layout needs it) instead of 16 scalar stores
strided 64 bytes apart.

Launched on the output tensor's device and its current stream (:func:`normals` and :func:`keystream`
make that device current around the launch: Triton launches on the current device's current stream).

Imported only for a CUDA draw (CUDA builds of torch bring triton); the tests run the same kernel in
Triton's interpreter on the CPU."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # RFC 8439 §2.3: "expand 32-byte k"
_TWO_PI = tl.constexpr(6.283185307179586)  # a global a kernel reads must be a constexpr
_BLOCKS_PER_PROGRAM = 256  # keystream kernel
LANES_PER_GROUP = 64  # threads of work per group of 2048 Gaussians
WARPS = 4  # the default launch: 128 threads, two groups per program
LAUNCH_WARPS = (2, 4, 8)  # the launch configurations benchmarks/gpu_session.py times


@triton.jit
def _rotl(x, n: tl.constexpr):
    return (x << n) | (x >> (32 - n))


@triton.jit
def _quarter(a, b, c, d):
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


@triton.jit
def _word(key_ptr, i: tl.constexpr):
    return tl.load(key_ptr + i).to(tl.uint32, bitcast=True)


@triton.jit
def _blocks(key_ptr, counter, nonce13, nonce14, nonce15, C0: tl.constexpr, C1: tl.constexpr,
            C2: tl.constexpr, C3: tl.constexpr):
    """The 16 output words (uint32 vectors) of the blocks ``counter`` (uint32) under the key and the
    nonce words (uint32; RFC 8439 §2.3: the block function)."""
    zero = counter * 0
    s0, s1, s2, s3 = zero + C0, zero + C1, zero + C2, zero + C3
    s4, s5, s6, s7 = zero + _word(key_ptr, 0), zero + _word(key_ptr, 1), zero + _word(key_ptr, 2), \
        zero + _word(key_ptr, 3)
    s8, s9, s10, s11 = zero + _word(key_ptr, 4), zero + _word(key_ptr, 5), zero + _word(key_ptr, 6), \
        zero + _word(key_ptr, 7)
    s12, s13, s14, s15 = counter, zero + nonce13, zero + nonce14, zero + nonce15
    x0, x1, x2, x3, x4, x5, x6, x7 = s0, s1, s2, s3, s4, s5, s6, s7
    x8, x9, x10, x11, x12, x13, x14, x15 = s8, s9, s10, s11, s12, s13, s14, s15
    for _ in tl.static_range(10):  # 20 rounds: a column round and a diagonal round each time
        x0, x4, x8, x12 = _quarter(x0, x4, x8, x12)
        x1, x5, x9, x13 = _quarter(x1, x5, x9, x13)
        x2, x6, x10, x14 = _quarter(x2, x6, x10, x14)
        x3, x7, x11, x15 = _quarter(x3, x7, x11, x15)
        x0, x5, x10, x15 = _quarter(x0, x5, x10, x15)
        x1, x6, x11, x12 = _quarter(x1, x6, x11, x12)
        x2, x7, x8, x13 = _quarter(x2, x7, x8, x13)
        x3, x4, x9, x14 = _quarter(x3, x4, x9, x14)
    return (x0 + s0, x1 + s1, x2 + s2, x3 + s3, x4 + s4, x5 + s5, x6 + s6, x7 + s7,
            x8 + s8, x9 + s9, x10 + s10, x11 + s11, x12 + s12, x13 + s13, x14 + s14, x15 + s15)


@triton.jit
def _row(w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15, LANES: tl.constexpr):
    """The ``[LANES]`` vectors ``w0 … w15`` as one ``[LANES, 16]`` tile whose column j is ``wj`` (each
    lane's values stay in its own registers)."""
    p0, p1, p2, p3 = tl.join(w0, w8), tl.join(w1, w9), tl.join(w2, w10), tl.join(w3, w11)
    p4, p5, p6, p7 = tl.join(w4, w12), tl.join(w5, w13), tl.join(w6, w14), tl.join(w7, w15)
    q0, q1, q2, q3 = tl.join(p0, p4), tl.join(p1, p5), tl.join(p2, p6), tl.join(p3, p7)
    return tl.reshape(tl.join(tl.join(q0, q2), tl.join(q1, q3)), (LANES, 16))


@triton.jit
def _signed64(low, high):
    """The 64-bit numbers ``high·2³² + low`` of uint32 words, as int64 (two's complement)."""
    return ((high.to(tl.uint64) << 32) | low.to(tl.uint64)).to(tl.int64, bitcast=True)


@triton.jit(do_not_specialize=["draw_lo", "draw_hi"])
def _normals_kernel(out_ptr, groups, key_ptr, draw_lo, draw_hi, C0: tl.constexpr, C1: tl.constexpr,
                    C2: tl.constexpr, C3: tl.constexpr, ANGLE64: tl.constexpr, GROUP_BLOCKS: tl.constexpr,
                    LANES: tl.constexpr):
    """``LANES // 64`` groups of 2048 Gaussians per program, one lane per thread: lane k of a group makes
    pairs 16k … 16k + 15 from its radius blocks 2k, 2k + 1 and its angle block(s) 128 + k (32-bit
    angles) or 128 + 2k, 129 + 2k, and stores them as row k of two ``[64, 16]`` tiles per group (the
    cosines at 16k …, the sines at 1024 + 16k …)."""
    lane = tl.arange(0, LANES)
    group = tl.program_id(0).to(tl.int64) * (LANES // 64) + lane // 64
    k = lane % 64
    first = group * GROUP_BLOCKS
    nonce13, nonce14, nonce15 = 0, draw_lo.to(tl.uint32), draw_hi.to(tl.uint32)
    ra = _blocks(key_ptr, (first + 2 * k).to(tl.uint32), nonce13, nonce14, nonce15, C0, C1, C2, C3)
    rb = _blocks(key_ptr, (first + 2 * k + 1).to(tl.uint32), nonce13, nonce14, nonce15, C0, C1, C2, C3)
    # radius number j of the lane: words 2j, 2j + 1 of block 2k (j < 8) or of block 2k + 1 (j ≥ 8)
    radius = _row(_signed64(ra[0], ra[1]), _signed64(ra[2], ra[3]), _signed64(ra[4], ra[5]),
                  _signed64(ra[6], ra[7]), _signed64(ra[8], ra[9]), _signed64(ra[10], ra[11]),
                  _signed64(ra[12], ra[13]), _signed64(ra[14], ra[15]), _signed64(rb[0], rb[1]),
                  _signed64(rb[2], rb[3]), _signed64(rb[4], rb[5]), _signed64(rb[6], rb[7]),
                  _signed64(rb[8], rb[9]), _signed64(rb[10], rb[11]), _signed64(rb[12], rb[13]),
                  _signed64(rb[14], rb[15]), LANES)
    if ANGLE64:
        aa = _blocks(key_ptr, (first + 128 + 2 * k).to(tl.uint32), nonce13, nonce14, nonce15,
                     C0, C1, C2, C3)
        ab = _blocks(key_ptr, (first + 129 + 2 * k).to(tl.uint32), nonce13, nonce14, nonce15,
                     C0, C1, C2, C3)
        numbers = _row(_signed64(aa[0], aa[1]), _signed64(aa[2], aa[3]), _signed64(aa[4], aa[5]),
                       _signed64(aa[6], aa[7]), _signed64(aa[8], aa[9]), _signed64(aa[10], aa[11]),
                       _signed64(aa[12], aa[13]), _signed64(aa[14], aa[15]), _signed64(ab[0], ab[1]),
                       _signed64(ab[2], ab[3]), _signed64(ab[4], ab[5]), _signed64(ab[6], ab[7]),
                       _signed64(ab[8], ab[9]), _signed64(ab[10], ab[11]), _signed64(ab[12], ab[13]),
                       _signed64(ab[14], ab[15]), LANES)
        scale = tl.full((), _TWO_PI * 5.421010862427522e-20, tl.float64)  # 2π·2⁻⁶⁴ (a bare float is float32)
        angle = numbers.to(tl.float64) * scale
        work = tl.float64
    else:
        a = _blocks(key_ptr, (first + 128 + k).to(tl.uint32), nonce13, nonce14, nonce15, C0, C1, C2, C3)
        words = _row(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12],
                     a[13], a[14], a[15], LANES)
        scale32 = _TWO_PI * 2.3283064365386963e-10  # 2π·2⁻³², rounded to float32 as the CPU does
        angle = words.to(tl.int32, bitcast=True).to(tl.float32) * scale32
        work = tl.float32
    # ln(|R + ½|·2⁻⁶³) in float64, the rest in the working precision; √ rounded to nearest, as on the
    # CPU (tl.sqrt of float32 is an approximation; of float64, exact)
    square = tl.log(tl.abs(radius.to(tl.float64) + 0.5) * 1.0842021724855044e-19).to(work) * -2.0
    r = tl.sqrt(square) if ANGLE64 else tl.sqrt_rn(square)
    offsets = (group * 2048 + 16 * k)[:, None] + tl.arange(0, 16)[None, :]
    inside = (group < groups)[:, None]
    tl.store(out_ptr + offsets, (r * tl.cos(angle)).to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(out_ptr + offsets + 1024, (r * tl.sin(angle)).to(out_ptr.dtype.element_ty), mask=inside)


@contextlib.contextmanager
def on_device_of(tensor: torch.Tensor):
    """Make ``tensor``'s CUDA device the current one for a launch (Triton launches on the current
    device and on that device's current stream, which is the stream torch's own work on the tensor
    uses); nothing to do for a CPU tensor (the interpreter)."""
    if tensor.device.type != "cuda":
        yield
        return
    with torch.cuda.device(tensor.device):
        yield


def normals(out: torch.Tensor, key: torch.Tensor, draw: int, warps: int = WARPS) -> None:
    """Fill ``out`` (flat, a whole number of groups of 2048, on the key's device) with the Gaussians of
    draw number ``draw`` under ``key`` (8 int32 words): one kernel launch on ``out``'s device and its
    current stream, ``warps`` warps (``32·warps`` lanes, ``warps / 2`` groups) per program."""
    if key.device != out.device:
        raise ValueError(f"the key is on {key.device} and the output on {out.device}: put both on one device")
    lanes = 32 * warps
    if lanes % LANES_PER_GROUP:
        raise ValueError(f"warps must be even (a group is {LANES_PER_GROUP} lanes), got {warps}")
    groups = out.numel() // 2048
    angle64 = out.dtype == torch.float64
    with on_device_of(out):
        _normals_kernel[(triton.cdiv(groups, lanes // LANES_PER_GROUP),)](
            out, groups, key, draw & 0x7FFFFFFF, draw >> 31, *CONSTANTS, ANGLE64=angle64,
            GROUP_BLOCKS=256 if angle64 else 192, LANES=lanes, num_warps=warps)


@triton.jit
def _keystream_kernel(out_ptr, blocks, key_ptr, first, nonce13, nonce14, nonce15, C0: tl.constexpr,
                      C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, BLOCKS: tl.constexpr):
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    w = _blocks(key_ptr, (block + first).to(tl.uint32), nonce13.to(tl.uint32), nonce14.to(tl.uint32),
                nonce15.to(tl.uint32), C0, C1, C2, C3)
    for i in tl.static_range(16):
        tl.store(out_ptr + block * 16 + i, w[i].to(tl.int32, bitcast=True), mask=block < blocks)


def keystream(out: torch.Tensor, key: torch.Tensor, counter: int, nonce: tuple[int, int, int]) -> None:
    """The raw keystream (RFC 8439 §2.4) into ``out`` (int32 ``[blocks, 16]``, on the key's device): block
    ``i`` under block counter ``counter + i`` and nonce words ``nonce`` (state words 13-15) — the words
    the Gaussians are made from, against which the RFC's test vectors are checked."""
    blocks = out.shape[0]
    with on_device_of(out):
        _keystream_kernel[(triton.cdiv(blocks, _BLOCKS_PER_PROGRAM),)](
            out, blocks, key, counter, *nonce, *CONSTANTS, BLOCKS=_BLOCKS_PER_PROGRAM)
