"""The decode attention kernel's reference (kernels/numba_attention.py): one query's attention
over its row of keys, restated in scalar code the way torch's CPU flash attention computes it
(aten/src/ATen/native/cpu/FlashAttentionKernel.cpp), with its GEMMs' summation orders as
kernels/attention_ir.py states them (QUADS or PAIRS: MKL's choice on the machine). No vectors,
no tiles, no skipping: every key of SDPA's row is visited, a masked one as a score of -inf. The
kernel must give these bits in either order on every machine and every instruction path
(tests/layers/test_decode_attention.py); where MKL's GEMM sums in one of the orders, they are
SDPA's (numba_attention.kernel_order picks the machine's).
"""

from __future__ import annotations

import math

import numpy as np

from hybridmoe.kernels.attention_ir import PAIRS
from hybridmoe.kernels.numba_cache import cached_njit
from hybridmoe.kernels.numba_glue import _bits_f32, _fma, _round
from hybridmoe.kernels.softmax_ir import (
    _FEXP,
    _FEXP_A,
    _FEXP_B,
    _U20,
    LN2,
    LN_FLT_MAX,
    LN_FLT_MIN,
    LOG2E,
)

BLOCK = 512  # torch's kvSplitSize for a decode query
_FLAGS = dict(nogil=True, fastmath=False)
_F32 = np.float32


@cached_njit(**_FLAGS)
def exp_u20(x):
    """torch's Vectorized<float>::exp_u20, one lane."""
    src = max(min(x, _F32(LN_FLT_MAX)), _F32(LN_FLT_MIN))
    fx = _F32(math.floor(_fma(src, _F32(LOG2E), _F32(0.5))))
    r = _fma(-fx, _F32(LN2), src)
    res = _fma(r, _F32(_U20[0]), _F32(_U20[1]))
    for c in _U20[2:]:
        res = _fma(r, res, _F32(c))
    power = _bits_f32(np.uint32((np.int32(fx - _F32(1)) + 127) << 23))
    if x < _F32(LN_FLT_MIN):
        power = _F32(0)
    return res * power * _F32(2)


@cached_njit(**_FLAGS)
def fexp_u20(x):
    """torch's Vectorized<float>::fexp_u20, one lane."""
    if x < _F32(LN_FLT_MIN):
        return _F32(0)
    if x > _F32(LN_FLT_MAX):
        return _F32(np.inf)
    src = x * _F32(LOG2E)
    fraction = src - _F32(math.floor(src))
    res = _fma(fraction, _F32(_FEXP[0]), _F32(_FEXP[1]))
    res = _fma(fraction, res, _F32(_FEXP[2]))
    res = _fma(fraction, res, _F32(_FEXP[3]))
    wide = _fma(_F32(_FEXP_A), src - res, _F32(_FEXP_B))
    return _bits_f32(np.uint32(np.int32(wide)))


@cached_njit(**_FLAGS)
def dot(q, k, order):
    """q . k in float32 in attention_ir's qk order `order`. QUADS: four interleaved partial
    sums, then (s0 + s2) + (s1 + s3), then the tail dims. PAIRS: sixteen lanes, lane l over
    the dims 32 c + 2 l + 1, then 32 c + 2 l of each chunk c of 32 (a dim past the end
    skipped), then lane l + lane l + 8, then neighbours, pairs of pairs, halves."""
    dim = q.shape[0]
    if order == PAIRS:
        lane = np.zeros(16, np.float32)
        for c in range(0, dim, 32):
            for lo in range(16):
                for d in (c + 2 * lo + 1, c + 2 * lo):
                    if d < dim:
                        lane[lo] = _fma(q[d], k[d], lane[lo])
        for lo in range(8):
            lane[lo] = lane[lo] + lane[lo + 8]
        for width in (1, 2, 4):
            for lo in range(0, 8, 2 * width):
                lane[lo] = lane[lo] + lane[lo + width]
        return lane[0]
    part = np.zeros(4, np.float32)
    for d in range(dim - dim % 4):
        part[d % 4] = _fma(q[d], k[d], part[d % 4])
    total = (part[0] + part[2]) + (part[1] + part[3])
    for d in range(dim - dim % 4, dim):
        total = _fma(q[d], k[d], total)
    return total


@cached_njit(**_FLAGS)
def weigh(acc, weights, values, order):
    """acc [D] += Σ_j weights[j] values[j] in attention_ir's pv order `order` (with beta = 1),
    values [n, D] float32. QUADS: groups of four keys, (t0 + t2) + (t1 + t3) each, then the
    last n % 4 keys one by one, the last first. PAIRS: groups of eight keys, each summed from
    0 as t1, t0, t3, t2, ... (a last odd key alone, last), the group's sum added to acc."""
    n, dim = values.shape
    if order == PAIRS:
        for g in range(0, n, 8):
            m = min(8, n - g)
            for d in range(dim):
                t = _F32(0)
                for j in range(0, m, 2):
                    if j + 1 < m:
                        t = _fma(weights[g + j + 1], values[g + j + 1, d], t)
                    t = _fma(weights[g + j], values[g + j, d], t)
                acc[d] = acc[d] + t
        return
    full = n - n % 4
    for g in range(0, full, 4):
        for d in range(dim):
            w, v = weights[g : g + 4], values[g : g + 4, d]
            even, odd = _fma(w[0], v[0], w[2] * v[2]), _fma(w[1], v[1], w[3] * v[3])
            acc[d] = acc[d] + (even + odd)
    for j in range(n - 1, full - 1, -1):
        for d in range(dim):
            acc[d] = acc[d] + weights[j] * values[j, d]


@cached_njit(**_FLAGS)
def exps(s, top, lanes, bf16):
    """torch's _exp_reduce_sum_fusion_kernel over one block's scores s [n] (in place: the
    exps, rounded to bfloat16 values where `bf16`) -> their float32 sum."""
    n = s.shape[0]
    whole = n - n % lanes
    # the vector part: torch's vector exp, summed per lane in its loops' vectors: in
    # bfloat16 (a bfloat16 vector is two float vectors) two over whole pairs of chunks, a
    # third over a last single chunk; then the first + the third + the second
    group = 2 if bf16 else 1
    paired = n - n % (group * lanes)
    sums = np.zeros((3, lanes), np.float32)
    for j in range(whole):
        e = fexp_u20(s[j] - top) if bf16 else exp_u20(s[j] - top)
        sums[2 if j >= paired else (j // lanes) % group, j % lanes] += e
        s[j] = e
    lane_sums = np.zeros(lanes, np.float32)
    for i in range(lanes):
        lane_sums[i] = (sums[0, i] + sums[2, i]) + sums[1, i]
    width = lanes
    while width > 1:  # vec_reduce_all: halves added to halves
        width //= 2
        for i in range(width):
            lane_sums[i] = lane_sums[i] + lane_sums[i + width]
    total = lane_sums[0]
    for j in range(whole, n):  # the tail: std::exp
        e = np.exp(s[j] - top)
        total += e
        s[j] = e
    if bf16:
        for j in range(n):
            s[j] = _round(s[j])  # torch stores the exps in bfloat16
    return total


@cached_njit(**_FLAGS)
def attend_row(q, keys, values, visible, scale, lanes, bf16, order):
    """softmax(q . keys * scale) . values for one query: q [D] float32, keys and values [S, D]
    float32 (bfloat16 values widened where `bf16`), visible [S] bool (False: masked), scale
    float32, `lanes` torch's Vectorized<float> lanes, `order` the GEMMs' (attention_ir.ORDERS)
    -> (float32 [D] before the output's rounding to its dtype, the softmax's max, its sum:
    SDPA's logsumexp is max + log(sum))."""
    S, dim = keys.shape
    top, total = _F32(-np.inf), _F32(0)
    acc = np.zeros(dim, np.float32)
    for start in range(0, S, BLOCK):
        n = min(BLOCK, S - start)
        s = np.full(n, -np.inf, np.float32)
        block_top = _F32(-np.inf)
        for j in range(n):
            if visible[start + j]:
                s[j] = dot(q, keys[start + j], order) * scale
                block_top = max(block_top, s[j])
        block_top = max(top, block_top)
        if block_top == -np.inf:  # torch skips a block no key of which is seen
            continue
        block_sum = exps(s, block_top, lanes, bf16)
        carry = np.exp(top - block_top)
        total = _fma(carry, total, block_sum)  # torch's `sum + carry * old`, contracted
        top = block_top
        for d in range(dim):
            acc[d] *= carry
        weigh(acc, s, values[start : start + n], order)
    inverse = _F32(1) / total
    for d in range(dim):
        acc[d] *= inverse
    return acc, top, total
