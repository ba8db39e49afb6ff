"""ChaCha20 Gaussians on a CUDA device: one Triton kernel per draw computes the keystream blocks and turns
them into Gaussians of the output's dtype, with the layout and arithmetic of ``chacha20.py`` (its
docstring is the specification; the CPU path computes the same uniforms bit for bit).

Imported only for a CUDA draw (CUDA builds of torch bring triton); the tests run the same kernel in
Triton's interpreter on the CPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # RFC 8439 §2.3: "expand 32-byte k"
_TWO_PI = tl.constexpr(6.283185307179586)  # a global a kernel reads must be a constexpr
_BLOCKS_PER_PROGRAM = 256  # keystream kernel


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
def _signed64(low, high):
    """The 64-bit number ``high·2³² + low`` of two uint32 words, as int64 (two's complement)."""
    return ((high.to(tl.uint64) << 32) | low.to(tl.uint64)).to(tl.int64, bitcast=True)


@triton.jit
def _pairs(out_ptr, n, base, radius_low, radius_high, angle, dtype: tl.constexpr):
    """Gaussians ``base`` (r cos θ) and ``base + 1024`` (r sin θ) of the pairs of one radius number (two
    words) and its angle (in ``dtype``, already scaled to radians)."""
    r = tl.sqrt(tl.log(tl.abs(_signed64(radius_low, radius_high).to(tl.float64) + 0.5)
                       * 1.0842021724855044e-19).to(dtype) * -2.0)  # ln(|R + ½|·2⁻⁶³) in float64
    tl.store(out_ptr + base, (r * tl.cos(angle)).to(out_ptr.dtype.element_ty), mask=base < n)
    tl.store(out_ptr + base + 1024, (r * tl.sin(angle)).to(out_ptr.dtype.element_ty), mask=base + 1024 < n)


@triton.jit(do_not_specialize=["draw_lo", "draw_hi"])
def _normals_kernel(out_ptr, n, key_ptr, draw_lo, draw_hi, C0: tl.constexpr, C1: tl.constexpr,
                    C2: tl.constexpr, C3: tl.constexpr, ANGLE64: tl.constexpr, GROUP_BLOCKS: tl.constexpr):
    """One group of 2048 Gaussians per program; lane k makes pairs 16k … 16k + 15 of the group from its
    radius blocks 2k, 2k + 1 and its angle block(s) 128 + k (32-bit angles) or 128 + 2k, 129 + 2k."""
    group = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, 64)
    first = group * GROUP_BLOCKS
    nonce13, nonce14, nonce15 = 0, draw_lo.to(tl.uint32), draw_hi.to(tl.uint32)
    ra = _blocks(key_ptr, (first + 2 * lane).to(tl.uint32), nonce13, nonce14, nonce15, C0, C1, C2, C3)
    rb = _blocks(key_ptr, (first + 2 * lane + 1).to(tl.uint32), nonce13, nonce14, nonce15, C0, C1, C2, C3)
    base = group * 2048 + 16 * lane
    if ANGLE64:
        aa = _blocks(key_ptr, (first + 128 + 2 * lane).to(tl.uint32), nonce13, nonce14, nonce15,
                     C0, C1, C2, C3)
        ab = _blocks(key_ptr, (first + 129 + 2 * lane).to(tl.uint32), nonce13, nonce14, nonce15,
                     C0, C1, C2, C3)
        scale = tl.full((), _TWO_PI * 5.421010862427522e-20, tl.float64)  # 2π·2⁻⁶⁴ (a bare float is float32)
        for q in tl.static_range(8):
            _pairs(out_ptr, n, base + q, ra[2 * q], ra[2 * q + 1],
                   _signed64(aa[2 * q], aa[2 * q + 1]).to(tl.float64) * scale, tl.float64)
        for q in tl.static_range(8):
            _pairs(out_ptr, n, base + 8 + q, rb[2 * q], rb[2 * q + 1],
                   _signed64(ab[2 * q], ab[2 * q + 1]).to(tl.float64) * scale, tl.float64)
    else:
        a = _blocks(key_ptr, (first + 128 + lane).to(tl.uint32), nonce13, nonce14, nonce15, C0, C1, C2, C3)
        scale32 = _TWO_PI * 2.3283064365386963e-10  # 2π·2⁻³², rounded to float32 as the CPU does
        for q in tl.static_range(8):
            _pairs(out_ptr, n, base + q, ra[2 * q], ra[2 * q + 1],
                   a[q].to(tl.int32, bitcast=True).to(tl.float32) * scale32, tl.float32)
        for q in tl.static_range(8):
            _pairs(out_ptr, n, base + 8 + q, rb[2 * q], rb[2 * q + 1],
                   a[8 + q].to(tl.int32, bitcast=True).to(tl.float32) * scale32, tl.float32)


def normals(out: torch.Tensor, key: torch.Tensor, draw: int) -> None:
    """Fill ``out`` (flat, a whole number of groups of 2048, on the key's device) with the Gaussians of
    draw number ``draw`` under ``key`` (8 int32 words): one kernel launch, one program per group."""
    angle64 = out.dtype == torch.float64
    _normals_kernel[(out.numel() // 2048,)](out, out.numel(), key, draw & 0x7FFFFFFF, draw >> 31, *CONSTANTS,
                                            ANGLE64=angle64, GROUP_BLOCKS=256 if angle64 else 192)


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
    _keystream_kernel[(triton.cdiv(blocks, _BLOCKS_PER_PROGRAM),)](
        out, blocks, key, counter, *nonce, *CONSTANTS, BLOCKS=_BLOCKS_PER_PROGRAM)
