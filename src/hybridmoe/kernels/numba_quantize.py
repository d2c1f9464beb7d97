"""Fast Q8_0 / Q4_0 quantisation on the CPU: ggml's reference quantisers in numba, parallel over
groups of blocks (a row is whole blocks, so groups tile rows), the GIL released.

The torch code in quant/q8_0.py and quant/q4_0.py is the reference; these kernels give the same
bytes (tests/quant/test_fast_quantize.py checks them against it and against `gguf.quants`):
every step is the same float32 operation in the same order, with no fast-math (a reciprocal or a
fused multiply-add would change the last bit). Where the reference's result is not a float
operation they spell it out: C's roundf (half away from zero), the truncating casts (a product
that is not finite, which only a block of float32 subnormals makes, casts to 0 there, so it does
here), and float32 -> fp16 rounding to nearest even, subnormals included. The input is read as
stored, float32 or bfloat16 (widened exactly, bit by bit): no float32 copy of a bf16 weight.

`quantize(name, w)` returns the blocks, or raises ValueError as the reference does for a block
with a non-finite weight or one whose scale overflows fp16.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from hybridmoe import env
from hybridmoe.kernels.numba_moe import start_pool
from hybridmoe.quant._blocks import CHUNK_BLOCKS

BLOCKS_PER_ITEM = 512  # 16 Ki weights per parallel work item
_FLAGS = dict(nogil=True, cache=True)  # no fastmath: every rounding step is the reference's

# one cache directory per version of this file, as kernels/numba_moe.py does for its kernels
_previous_cache_dir = numba.config.CACHE_DIR
numba.config.CACHE_DIR = str(env.kernel_cache_dir(__file__))


@njit(inline="always", **_FLAGS)
def _widen(xf, xb, block, f, bits):
    """f[:32] = the block's weights as float32: from float32 xf, or when xf is empty from the
    bfloat16 bit patterns xb (int16), each shifted into the high half of a float32 (exact)."""
    base = block * 32
    if xf.shape[0]:
        for j in range(32):
            f[j] = xf[base + j]
    else:
        for j in range(32):
            bits[j] = (np.uint32(xb[base + j]) & np.uint32(0xFFFF)) << np.uint32(16)


@njit(inline="always", **_FLAGS)
def _fp16_bits(d_bits):
    """The fp16 bit pattern of the float32 with bits `d_bits`, rounded to nearest even, as
    torch's cast: subnormal results rounded in place, overflow to inf, nan kept a nan."""
    x = np.int64(d_bits)
    sign = (x >> 16) & 0x8000
    x &= 0x7FFFFFFF
    if x >= 0x7F800000:  # inf or nan
        return sign | 0x7C00 | (0x200 if x > 0x7F800000 else 0)
    if x >= 0x477FF000:  # >= 65520: rounds to inf
        return sign | 0x7C00
    if x >= 0x38800000:  # a normal fp16: drop 13 mantissa bits
        half = ((((x >> 23) - 112) << 10) | ((x & 0x7FFFFF) >> 13)) & 0xFFFF
        rest = x & 0x1FFF
        if rest > 0x1000 or (rest == 0x1000 and (half & 1)):
            half += 1  # a carry into the exponent is the right result
        return sign | half
    exponent = x >> 23  # a subnormal fp16 (or zero): value * 2^24, rounded to an integer
    shift = 126 - exponent  # value * 2^24 = mantissa * 2^-shift; shift >= 14
    if exponent == 0 or shift >= 32:  # below half the smallest fp16 subnormal
        return sign
    mantissa = (x & 0x7FFFFF) | 0x800000
    half = mantissa >> shift
    rest, midpoint = mantissa & ((1 << shift) - 1), 1 << (shift - 1)
    if rest > midpoint or (rest == midpoint and (half & 1)):
        half += 1
    return sign | half


@njit(inline="always", **_FLAGS)
def _store_scale(out, block, d_bits, bad, item):
    """The block's fp16 scale into out[block, :2] (little-endian); bad[item, 1] = the first block
    of the item whose scale is not a finite fp16."""
    half = _fp16_bits(d_bits)
    out[block, 0], out[block, 1] = half & 0xFF, half >> 8
    if (half & 0x7C00) == 0x7C00 and bad[item, 1] < 0:
        bad[item, 1] = block


@njit(inline="always", **_FLAGS)
def _roundf(v):
    """C's roundf(v) for a float32 v (halves away from zero), as an int; 0 when v is not finite
    (the reference's cast)."""
    if not abs(v) < np.float32(8388608.0):  # 2^23: only inf and nan get here
        return 0
    t = int(v)  # truncates
    frac = v - t  # exact
    if frac >= 0.5:
        return t + 1
    if frac <= -0.5:
        return t - 1
    return t


@njit(parallel=True, **_FLAGS)
def quantize_q8_0_blocks(xf, xb, out, bad):
    """out [B, 34] = Q8_0 blocks of the B * 32 weights in xf (float32) or, xf empty, xb (bf16
    bits); bad [items, 2] (-1 filled): per work item the first block with a non-finite weight,
    the first whose scale overflows fp16. ggml's quantize_row_q8_0_ref: d = max|x| / 127,
    q = roundf(x * (1 / d))."""
    n_blocks = out.shape[0]
    for item in prange((n_blocks + BLOCKS_PER_ITEM - 1) // BLOCKS_PER_ITEM):
        bits = np.empty(32, np.uint32)
        f = bits.view(np.float32)
        d_bits = np.empty(1, np.float32)
        for block in range(item * BLOCKS_PER_ITEM, min(n_blocks, (item + 1) * BLOCKS_PER_ITEM)):
            _widen(xf, xb, block, f, bits)
            amax, nonfinite = np.float32(0.0), np.float32(0.0)
            for j in range(32):
                a = abs(f[j])
                nonfinite += a - a  # nan once any |x| is inf or nan
                if a > amax:
                    amax = a
            if nonfinite != 0 and bad[item, 0] < 0:
                bad[item, 0] = block
            d = amax / np.float32(127.0)
            inv_d = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            for j in range(32):
                out[block, 2 + j] = _roundf(f[j] * inv_d) & 0xFF
            d_bits[0] = d
            _store_scale(out, block, d_bits.view(np.uint32)[0], bad, item)


@njit(parallel=True, **_FLAGS)
def quantize_q4_0_blocks(xf, xb, out, bad):
    """As quantize_q8_0_blocks, out [B, 18] Q4_0: ggml's quantize_row_q4_0_ref. m = the weight
    of largest |x| (the first on ties, +0.0 for a block of zeros), d = m / -8, v = min(15,
    trunc(x * (1 / d) + 8.5)); byte j holds weight j (low nibble) and weight j + 16."""
    n_blocks = out.shape[0]
    for item in prange((n_blocks + BLOCKS_PER_ITEM - 1) // BLOCKS_PER_ITEM):
        bits = np.empty(32, np.uint32)
        f = bits.view(np.float32)
        d_bits = np.empty(1, np.float32)
        for block in range(item * BLOCKS_PER_ITEM, min(n_blocks, (item + 1) * BLOCKS_PER_ITEM)):
            _widen(xf, xb, block, f, bits)
            amax, m, nonfinite = np.float32(0.0), np.float32(0.0), np.float32(0.0)
            for j in range(32):
                a = abs(f[j])
                nonfinite += a - a
                if amax < a:
                    amax, m = a, f[j]
            if nonfinite != 0 and bad[item, 0] < 0:
                bad[item, 0] = block
            d = m / np.float32(-8.0)
            inv_d = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            for j in range(16):
                low = _nibble(f[j] * inv_d + np.float32(8.5))
                high = _nibble(f[j + 16] * inv_d + np.float32(8.5))
                out[block, 2 + j] = low | (high << 4)
            d_bits[0] = d
            _store_scale(out, block, d_bits.view(np.uint32)[0], bad, item)


@njit(inline="always", **_FLAGS)
def _nibble(v):
    """min(15, trunc(v)) for v = x * id + 8.5 (in [0.49, 16.5] when finite); 0 when not finite,
    as the reference's cast."""
    if not abs(v) < np.float32(256.0):
        return 0
    return min(15, int(v))


_KERNELS = {"q8_0": (quantize_q8_0_blocks, 34), "q4_0": (quantize_q4_0_blocks, 18)}
numba.config.CACHE_DIR = _previous_cache_dir  # every cached function above is decorated


def quantize(name: str, w: torch.Tensor) -> torch.Tensor:
    """Host float w [..., n] (n a multiple of 32; float32 and bfloat16 read as stored, any other
    float dtype cast to float32 first, as the reference does) -> new uint8 [..., n // 32 *
    block_bytes], the reference's bytes. ValueError naming the row for a non-finite weight or
    a scale beyond fp16."""
    kernel, block_bytes = _KERNELS[name]
    n = w.shape[-1]
    if w.dtype not in (torch.float32, torch.bfloat16):
        w = w.to(torch.float32)
    flat = w.contiguous().view(-1)  # a view when w is contiguous
    empty_f32, empty_bf16 = np.empty(0, np.float32), np.empty(0, np.int16)
    xf = flat.numpy() if flat.dtype == torch.float32 else empty_f32
    xb = flat.view(torch.int16).numpy() if flat.dtype == torch.bfloat16 else empty_bf16
    out = torch.empty(flat.numel() // 32, block_bytes, dtype=torch.uint8)  # [B, block_bytes]
    items = -(-out.shape[0] // BLOCKS_PER_ITEM)
    bad = np.full((items, 2), -1, np.int64)
    if out.shape[0]:
        start_pool()
        with numba.parallel_chunksize(1):  # items one at a time: a preempted thread delays one
            kernel(xf, xb, out.numpy(), bad)
    _raise_first_bad(name, bad, n // 32)
    return out.reshape(*w.shape[:-1], n // 32 * block_bytes)


def _raise_first_bad(name: str, bad: np.ndarray, blocks_per_row: int) -> None:
    """The reference's ValueError, if any: it checks CHUNK_BLOCKS blocks at a time, first for a
    non-finite weight, then for an fp16 overflow, and names the first such block's row."""
    firsts = [int(col[col >= 0].min()) if (col >= 0).any() else None for col in bad.T]
    reasons = (
        "has a non-finite weight (inf or nan)",
        "has a block scale beyond the fp16 range (weights too large)",
    )
    found = [
        (block // CHUNK_BLOCKS, kind, block)
        for kind, block in enumerate(firsts)
        if block is not None
    ]
    if found:
        _, kind, block = min(found)
        raise ValueError(
            f"quantize_{name}: the input's row {block // blocks_per_row} {reasons[kind]}"
        )
