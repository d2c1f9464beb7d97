"""Small serial numba kernels for the host glue of a decode step: RMSNorm (with the residual add
before it), attention's per-head q/k norms with rotary, and the softmax router's top-k. Each
replaces a handful of torch ops on [1, H]-sized tensors, whose dispatch costs more than their
arithmetic, with one call of a few µs, and computes the torch reference's values bit for bit:

- bfloat16 values are widened exactly and rounded once where torch rounds, to nearest, ties to
  even (c10::BFloat16's rounding; NaN becomes 0x7FC0 as there);
- every float32 sum is added in the order of torch's CPU cascade sum (SumKernel.cpp
  `vectorized_inner_sum` over a contiguous row, see `_inner_sum`), which the norm's mean and
  the top-k renormalisation use;
- no fastmath: LLVM neither reassociates nor contracts a multiply-add. Said explicitly on
  each function (_EXACT): numba compiles a callee first met inside another function's
  compile with that function's flags unless the callee sets its own, and caches it so
  (numba_dense.DENSE_ROUTE, a fastmath caller once, got the top-k's division by a
  reciprocal).

norm_rotary_rows has a parallel form for a prefill's tokens (norm_rotary_rows_parallel: runs of
whole tokens on numba's threads, each run norm_rotary_rows', so the same bits).

Tensors come as addresses of contiguous host memory (kernels/glue.py checks them and keeps
the torch reference); an int argument is typed in nanoseconds, an array in about a µs.
"""

from __future__ import annotations

import platform
import sys

import numba
import numpy as np
from llvmlite import ir
from numba import prange
from numba.core import types
from numba.extending import intrinsic

from hybridmoe import env
from hybridmoe.kernels import activation_ir, llvm_ir
from hybridmoe.kernels.activation_ir import sleef_expf
from hybridmoe.kernels.llvm_ir import address_pointer
from hybridmoe.kernels.numba_cache import cached_njit

_previous_cache_dir = numba.config.CACHE_DIR
numba.config.CACHE_DIR = str(
    env.kernel_cache_dir(__file__, llvm_ir.__file__, activation_ir.__file__)
)

# Vectorized<float> lanes of the kernel build torch's sum runs: its inner-sum kernel has no
# AVX512 build, so x86 sums 8 lanes (AVX2 or the default 32-byte vectors) and ARM 4 (NEON)
LANES = 4 if platform.machine().lower() in ("arm64", "aarch64") else 8
ILP = 4  # SumKernel.cpp row_sum: a row is viewed as (-1, 4) accumulators
LEVELS = 4  # multi_row_sum's cascade levels
MAX_SUM_N = 32768  # longer rows: torch may split the reduction (a different order)

# every kernel here: no fastmath, said explicitly (a numba callee first compiled inside a
# fastmath caller's compile inherits the caller's flags unless it sets its own)
_EXACT = dict(nogil=True, fastmath=False)

# norm_rows' flags
X_BF16, Y_BF16, SCALE_BF16, ADD, SCALE_ROUNDED = 1, 2, 4, 8, 16


@intrinsic
def _f32_bits(typingctx, value):
    """A float32's bits as uint32."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(value), codegen


@intrinsic
def _bits_f32(typingctx, bits):
    """The low 32 bits of an integer as a float32."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = args[0]
        if bits.bitwidth > 32:
            low = builder.trunc(low, ir.IntType(32))
        elif bits.bitwidth < 32:
            low = builder.zext(low, ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@cached_njit(**_EXACT)
def _bf16_bits(value):
    """The bfloat16 bits (uint32, 0..0xFFFF) nearest the float32 `value`, ties to even; NaN ->
    0x7FC0 (c10::round_to_nearest_even)."""
    bits = _f32_bits(value)
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint32(0x7FC0)
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@cached_njit(**_EXACT)
def _round(value):
    """The float32 `value` rounded to its nearest bfloat16 value."""
    return _bits_f32(_bf16_bits(value) << np.uint32(16))


@cached_njit(**_EXACT)
def _load(address, bf16, dst, n):
    """dst[:n] (float32) = the n values at `address`: bfloat16 widened exactly, or float32."""
    if bf16:
        src = numba.carray(address_pointer(address), n, np.uint16)
        for i in range(n):
            dst[i] = _bits_f32(np.uint32(src[i]) << np.uint32(16))
    else:
        src32 = numba.carray(address_pointer(address), n, np.float32)
        for i in range(n):
            dst[i] = src32[i]


@cached_njit(**_EXACT)
def _save(h, address, bf16, n):
    """The n values at `address` = h[:n] (float32), rounded to bfloat16 where `bf16`."""
    if bf16:
        dst = numba.carray(address_pointer(address), n, np.uint16)
        for i in range(n):
            dst[i] = np.uint16(_bf16_bits(h[i]))
    else:
        dst32 = numba.carray(address_pointer(address), n, np.float32)
        for i in range(n):
            dst32[i] = h[i]


@cached_njit(**_EXACT)
def widen_bf16(src, dst, n):
    """dst[:n] (a float32 array) = the n bfloat16 values at address `src`, widened exactly."""
    _load(src, True, dst, n)


def _row_sum_of(width):
    """SumKernel.cpp row_sum over elements of `width` lanes (element e is v[e * width :
    (e + 1) * width]): multi_row_sum's cascade over the (count // 4, 4) view of `count`
    elements, the leftover elements into partial 0, then partials 1..3 into partial 0,
    lane-wise. acc [LEVELS * ILP * width] float32 scratch; the result is acc[:width]."""

    @cached_njit(**_EXACT)
    def row_sum(v, count, acc):
        acc[:] = 0
        rows = count // ILP
        log2 = 0
        while (1 << log2) < rows:
            log2 += 1
        power = max(4, log2 // LEVELS)
        step, i = 1 << power, 0
        while i < rows:
            full = i + step <= rows
            for _ in range(step if full else rows - i):
                for j in range(ILP * width):  # the 4 accumulators' lanes, one after the other
                    acc[j] += v[i * ILP * width + j]
                i += 1
            if not full:
                break
            for level in range(1, LEVELS):
                for j in range(ILP * width):
                    acc[level * ILP * width + j] += acc[(level - 1) * ILP * width + j]
                    acc[(level - 1) * ILP * width + j] = 0
                if i & ((step - 1) << (level * power)):
                    break
        for level in range(1, LEVELS):
            for j in range(ILP * width):
                acc[j] += acc[level * ILP * width + j]
        for j in range(rows * ILP * width, count * width):
            acc[j % width] += v[j]
        for k in range(1, ILP):
            for lane in range(width):
                acc[lane] += acc[k * width + lane]

    return row_sum


_row_sum_vectors, _row_sum_scalars = _row_sum_of(LANES), _row_sum_of(1)


@cached_njit(**_EXACT)
def _inner_sum(v, n, acc):
    """Σ v[:n] (float32) in the order of torch's CPU sum over a contiguous row: for n >= LANES
    (vectorized_inner_sum) row_sum over the n // LANES vectors, then 0 + the scalar tail in
    index order + the vector's lanes in lane order; for shorter rows row_sum over scalars.
    acc [LEVELS * ILP * LANES] float32 scratch."""
    if n < LANES:
        _row_sum_scalars(v, n, acc)
        return acc[0]
    vectors = n // LANES
    _row_sum_vectors(v, vectors, acc)
    total = np.float32(0)
    for i in range(vectors * LANES, n):
        total += v[i]
    for lane in range(LANES):
        total += acc[lane]
    return total


@cached_njit(**_EXACT)
def norm_rows(x, y, scale, total, out, rows, n, eps, flags):
    """Per row r of `rows` rows of n values: h = x[r] (+ y[r] where ADD, rounded to x's dtype
    and stored in total[r]); out[r] = scale * (h * rsqrt(Σ h² / n + eps)) in x's dtype, as
    torch's composite rms_norm computes it in float32: the mean is the cascade sum divided
    by n, rsqrt is 1 / sqrt (two roundings); with SCALE_ROUNDED h * rsqrt is rounded to
    bfloat16 before scale multiplies. x, y, scale, total, out: addresses of contiguous host
    memory, bfloat16 where flags say X_BF16 (x, total, out), Y_BF16, SCALE_BF16, else
    float32; a float32 y added to a bfloat16 x is rounded first (`x + y.to(x.dtype)`). eps
    is rounded to float32, as torch adds it."""
    x_bf16, y_bf16 = (flags & X_BF16) != 0, (flags & Y_BF16) != 0
    size, y_size = 2 if x_bf16 else 4, 2 if y_bf16 else 4
    h, t = np.empty(n, np.float32), np.empty(n, np.float32)
    w, sq = np.empty(n, np.float32), np.empty(n, np.float32)
    acc = np.empty(LEVELS * ILP * LANES, np.float32)
    _load(scale, (flags & SCALE_BF16) != 0, w, n)
    eps32, scale_rounded = np.float32(eps), (flags & SCALE_ROUNDED) != 0
    for r in range(rows):
        _load(x + r * n * size, x_bf16, h, n)
        if flags & ADD:
            _load(y + r * n * y_size, y_bf16, t, n)
            for i in range(n):
                term = _round(t[i]) if x_bf16 and not y_bf16 else t[i]
                h[i] = _round(h[i] + term) if x_bf16 else h[i] + term
            _save(h, total + r * n * size, x_bf16, n)
        for i in range(n):
            sq[i] = h[i] * h[i]
        inv = np.float32(1) / np.sqrt(_inner_sum(sq, n, acc) / np.float32(n) + eps32)
        for i in range(n):
            normed = h[i] * inv
            h[i] = (_round(normed) if scale_rounded else normed) * w[i]
        _save(h, out + r * n * size, x_bf16, n)


@cached_njit(**_EXACT)
def _norm_row(h, w, n, eps32, bf16, sq, acc):
    """h[:n] = w * (h * rsqrt(Σ h² / n + eps)) in place, as norm_rows computes it (bfloat16
    where `bf16`: h * rsqrt rounded before w multiplies, the product rounded)."""
    for i in range(n):
        sq[i] = h[i] * h[i]
    inv = np.float32(1) / np.sqrt(_inner_sum(sq, n, acc) / np.float32(n) + eps32)
    for i in range(n):
        normed = h[i] * inv
        h[i] = _round(_round(normed) * w[i]) if bf16 else normed * w[i]


@cached_njit(**_EXACT)
def _rotate_row(h, c, s, rot, n, bf16):
    """rot[:n] = h * c + rotate_half(h) * s (rotary.apply_rotary: rotate_half(h) is
    (-h[n/2:], h[:n/2])), each product and the sum rounded to bfloat16 where `bf16`;
    -(a * b) is a * b negated exactly, so the first half's product is negated after."""
    half = n // 2
    for i in range(n):
        a = h[i] * c[i]
        b = h[i + half] * s[i] if i < half else h[i - half] * s[i]
        if bf16:
            a, b = _round(a), _round(b)
        rot[i] = a - b if i < half else a + b


@cached_njit(**_EXACT)
def norm_rotary_rows(
    q, k, q_stride, k_stride, q_rows, k_rows, n, q_scale, k_scale, cos, sin, q_out, k_out,
    tokens, eps, bf16,
):  # fmt: skip
    """Per-head RMSNorm then rotary of q and k (layers/qkv.norm_rotary_qk_reference's values):
    for token t < `tokens` and head row r, h = the row (q's `q_rows` heads at q + t * q_stride,
    then k's `k_rows` at k + t * k_stride; strides in values, each head n contiguous values),
    normalised as norm_rows does with q_scale or k_scale [n], then rotated by cos/sin [tokens,
    n] (_rotate_row); written to q_out [tokens, q_rows, n] and k_out [tokens, k_rows, n].
    Every tensor bfloat16 where `bf16`, else float32; all are addresses of host memory.
    q_scale 0: no norm, the rows are rotated only (rotary.apply_rotary's values)."""
    size = 2 if bf16 else 4
    h, rot = np.empty(n, np.float32), np.empty(n, np.float32)
    c, s = np.empty(n, np.float32), np.empty(n, np.float32)
    wq, wk = np.empty(n, np.float32), np.empty(n, np.float32)
    sq, acc = np.empty(n, np.float32), np.empty(LEVELS * ILP * LANES, np.float32)
    normalise = q_scale != 0
    if normalise:
        _load(q_scale, bf16, wq, n)
        _load(k_scale, bf16, wk, n)
    eps32 = np.float32(eps)
    for t in range(tokens):
        _load(cos + t * n * size, bf16, c, n)
        _load(sin + t * n * size, bf16, s, n)
        for src, stride, rows, w, dst in (
            (q, q_stride, q_rows, wq, q_out),
            (k, k_stride, k_rows, wk, k_out),
        ):
            for r in range(rows):
                _load(src + (t * stride + r * n) * size, bf16, h, n)
                if normalise:
                    _norm_row(h, w, n, eps32, bf16, sq, acc)
                _rotate_row(h, c, s, rot, n, bf16)
                _save(rot, dst + (t * rows + r) * n * size, bf16, n)


@cached_njit(parallel=True, **_EXACT)
def norm_rotary_rows_parallel(
    q, k, q_stride, k_stride, q_rows, k_rows, n, q_scale, k_scale, cos, sin, q_out, k_out,
    tokens, eps, bf16, pieces,
):  # fmt: skip
    """norm_rotary_rows over `tokens` tokens split into `pieces` runs of whole tokens, the runs
    on numba's threads (a prefill's q and k: tokens are independent, the same bits)."""
    size = 2 if bf16 else 4
    for p in prange(pieces):
        first, end = tokens * p // pieces, tokens * (p + 1) // pieces
        norm_rotary_rows(
            q + first * q_stride * size, k + first * k_stride * size, q_stride, k_stride,
            q_rows, k_rows, n, q_scale, k_scale, cos + first * n * size, sin + first * n * size,
            q_out + first * q_rows * n * size, k_out + first * k_rows * n * size, end - first,
            eps, bf16,
        )  # fmt: skip


@cached_njit(**_EXACT)
def topk_route(probs, ids, weights, weights_bf16, T, E, k, renorm):
    """probs [T, E] float32 -> ids [T, k] int64 (largest first), weights [T, k] (bfloat16
    where `weights_bf16`, else float32), all addresses of contiguous host memory: the k
    largest probabilities, divided by their cascade sum where `renorm`, then rounded to the
    weights' dtype: torch.topk's ids and values, equal values included (_torch_topk). Returns
    False, with ids and weights unspecified, where a row holds a NaN, or where torch.topk
    would not take the path reproduced (`_reproduced`) and the row holds two equal values
    among its k + 1 largest."""
    p = numba.carray(address_pointer(probs), (T, E), np.float32)
    ids_out = numba.carray(address_pointer(ids), (T, k), np.int64)
    vals = np.empty(k, np.float32)
    queue = (np.empty(E, np.float32), np.empty(E, np.int64))
    acc = np.empty(LEVELS * ILP * LANES, np.float32)
    for t in range(T):
        if not _topk_row(p[t], E, k, renorm, queue, vals, ids_out[t], acc):
            return False
        _save(vals, weights + t * k * (2 if weights_bf16 else 4), weights_bf16, k)
    return True


@cached_njit(**_EXACT)
def _topk_row(row, E, k, renorm, queue, vals, ids_out, acc, any_order=False):
    """topk_route for one row: ids_out[:k] and vals[:k] (renormalised where `renorm`); False
    where the row holds a NaN. Where torch.topk takes the path _torch_topk reproduces, its
    ids and values; elsewhere the k largest, largest first, and False where two of the k + 1
    largest are equal (which torch picks, or its order, is its sort's). With `any_order` only
    a tie of the k-th largest with the (k + 1)-th is refused there: the ids of equal values
    inside the k then come lowest first, maybe not in torch's order, the values (and their
    sum) are the same; for a caller whose result does not depend on the routes' order
    (numba_moe's kernels sum a token's routes by expert id)."""
    for j in range(E):
        if row[j] != row[j]:
            return False
    v, ix = queue
    if _reproduced(E, k):
        _torch_topk(row, E, k, v, ix)
        for s in range(k):
            ids_out[s], vals[s] = ix[s], v[s]
    else:
        chosen = v  # 0: not chosen yet
        chosen[:E] = 0
        for s in range(min(k + 1, E)):
            best = -1
            for j in range(E):
                if chosen[j] == 0 and (best < 0 or row[j] > row[best]):
                    best = j
            if s > 0 and row[best] == vals[s - 1] and (s == k or not any_order):
                return False
            if s == k:
                break
            chosen[best] = 1
            ids_out[s], vals[s] = best, row[best]
    if renorm:
        total = _inner_sum(vals, k, acc)
        for s in range(k):
            vals[s] = vals[s] / total
    return True


# torch.topk (largest, sorted) on the CPU (TopKImpl.h topk_impl_loop): pairs (value, index) in
# index order; for k * 64 > n, std::nth_element(begin, begin + k - 1, end) then std::sort of
# the first k - 1, both ordering by value only (a NaN first, then larger), so which of equal
# values are taken and their order are libstdc++'s algorithms': introselect (depth limit 2
# floor(log2 n); median of three moved to the front, unguarded Hoare partition around it; a
# range of at most 3 insertion-sorted; a heap select past the depth limit) and, for at most
# 16 elements, insertion sort. Restated here step for step; for k * 64 <= n torch keeps a
# heap of k instead (not reproduced), and std::sort of more than 16 is an introsort (k > 17:
# not reproduced), and torch's builds for other C++ libraries (libc++ on macOS, MSVC's) select
# by other algorithms (not reproduced: only Linux builds, libstdc++'s).
_LIBSTDCXX = sys.platform.startswith("linux")


@cached_njit(inline="always", **_EXACT)
def _reproduced(n, k):
    """Whether torch.topk's k of n takes the path _torch_topk reproduces."""
    return _LIBSTDCXX and k * 64 > n and k <= 17


@cached_njit(inline="always", **_EXACT)
def _first(a, b):
    """torch.topk's comparator (largest): a before b."""
    return (a != a and b == b) or a > b


@cached_njit(inline="always", **_EXACT)
def _swap(v, ix, a, b):
    v[a], v[b] = v[b], v[a]
    ix[a], ix[b] = ix[b], ix[a]


@cached_njit(**_EXACT)
def _torch_topk(row, n, k, v, ix):
    """v[:k], ix[:k] = torch.topk(row[:n], k)'s values and indices (1 <= k <= n, _reproduced)."""
    for j in range(n):
        v[j], ix[j] = row[j], j
    nth = k - 1
    first, last = 0, n
    depth = 0
    while (1 << (depth + 1)) <= n:
        depth += 1
    depth *= 2  # 2 floor(log2 n)
    while last - first > 3 and depth > 0:
        depth -= 1
        cut = _partition(v, ix, first, last)
        if cut <= nth:
            first = cut
        else:
            last = cut
    if last - first > 3:  # past the depth limit
        _heap_select(v, ix, first, nth + 1, last)
        _swap(v, ix, first, nth)
    else:
        _insertion_sort(v, ix, first, last)
    _insertion_sort(v, ix, 0, nth)  # std::sort of k - 1 <= 16


@cached_njit(**_EXACT)
def _partition(v, ix, first, last):
    """The median of v[first + 1], v[mid], v[last - 1] swapped to first, then v[first + 1:
    last] partitioned around it (unguarded: stops at equal values); -> the cut."""
    a, b, c = first + 1, first + (last - first) // 2, last - 1
    if _first(v[a], v[b]):
        median = b if _first(v[b], v[c]) else (c if _first(v[a], v[c]) else a)
    else:
        median = a if _first(v[a], v[c]) else (c if _first(v[b], v[c]) else b)
    _swap(v, ix, first, median)
    lo, hi = first + 1, last
    while True:
        while _first(v[lo], v[first]):
            lo += 1
        hi -= 1
        while _first(v[first], v[hi]):
            hi -= 1
        if lo >= hi:
            return lo
        _swap(v, ix, lo, hi)
        lo += 1


@cached_njit(**_EXACT)
def _insertion_sort(v, ix, first, last):
    """v[first:last] sorted by _first: each element moved down past those it goes before
    (to the front at once where it goes before the first)."""
    for i in range(first + 1, last):
        value, index = v[i], ix[i]
        j = i
        if _first(value, v[first]):
            while j > first:
                v[j], ix[j] = v[j - 1], ix[j - 1]
                j -= 1
        else:
            while _first(value, v[j - 1]):
                v[j], ix[j] = v[j - 1], ix[j - 1]
                j -= 1
        v[j], ix[j] = value, index


@cached_njit(**_EXACT)
def _heap_select(v, ix, first, middle, last):
    """The heap of v[first:middle] (the one that comes last by _first at its top) given each
    later element that goes before its top in the top's place."""
    n = middle - first
    if n >= 2:
        parent = (n - 2) // 2
        while True:
            _sift(v, ix, first, parent, n, v[first + parent], ix[first + parent])
            if parent == 0:
                break
            parent -= 1
    for i in range(middle, last):
        if _first(v[i], v[first]):
            value, index = v[i], ix[i]
            v[i], ix[i] = v[first], ix[first]
            _sift(v, ix, first, 0, n, value, index)


@cached_njit(**_EXACT)
def _sift(v, ix, first, hole, n, value, index):
    """(value, index) into the heap v[first:first + n] from `hole` down: the hole moved to a
    leaf through the children that come later, then back up while its parent comes before
    the value."""
    top, child = hole, hole
    while child < (n - 1) // 2:
        child = 2 * (child + 1)
        if _first(v[first + child], v[first + child - 1]):
            child -= 1
        v[first + hole], ix[first + hole] = v[first + child], ix[first + child]
        hole = child
    if n % 2 == 0 and child == (n - 2) // 2:
        child = 2 * (child + 1)
        v[first + hole], ix[first + hole] = v[first + child - 1], ix[first + child - 1]
        hole = child - 1
    while hole > top:
        parent = (hole - 1) // 2
        if not _first(v[first + parent], value):
            break
        v[first + hole], ix[first + hole] = v[first + parent], ix[first + parent]
        hole = parent
    v[first + hole], ix[first + hole] = value, index


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c in float32, rounded once (llvm.fma: the FMA instruction, or libm's fmaf)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        return builder.call(llvm_ir.declare(builder, "llvm.fma.f32", f32, [f32] * 3), args)

    return types.float32(a, b, c), codegen


# torch's float32 softmax over a contiguous last dim (SoftMaxKernel.cpp _vec_softmax_lastdim):
# max = reduce_all(maximum), e = exp(x - max) by Vectorized<float>::exp (SLEEF's expf_u10, one
# lane of activation_ir's), sum = reduce_all(+) over e, out = e * (1 / sum); reduce_all
# (functional_base.h) folds whole vectors of the build's lanes in order, the tail's lanes into
# the first ones, then the lanes by halving shuffles; a row shorter than a vector is folded in
# index order.


@cached_njit(**_EXACT)
def _reduce_all(v, n, lanes, is_sum, acc, swap):
    """reduce_all(+ or maximum) over v[:n] float32 in torch's order for `lanes`-wide vectors
    (above); acc, swap: float32 scratch of `lanes`. Values are finite (maximum's NaN rule is
    not needed)."""
    if n < lanes:
        total = v[0]
        for i in range(1, n):
            total = total + v[i] if is_sum else max(total, v[i])
        return total
    for j in range(lanes):
        acc[j] = v[j]
    whole = n - n % lanes
    for d in range(lanes, whole, lanes):
        for j in range(lanes):
            acc[j] = acc[j] + v[d + j] if is_sum else max(acc[j], v[d + j])
    for j in range(n - whole):
        acc[j] = acc[j] + v[whole + j] if is_sum else max(acc[j], v[whole + j])
    shift = lanes // 2
    while shift > 0:
        for j in range(lanes):
            swap[j] = acc[j ^ shift]
        for j in range(lanes):
            acc[j] = acc[j] + swap[j] if is_sum else max(acc[j], swap[j])
        shift //= 2
    return acc[0]


@cached_njit(**_EXACT)
def _softmax_row(x, out, n, lanes, acc, swap):
    """out[:n] = torch.softmax(x[:n]) (float32, finite) to the bit, for torch's `lanes`."""
    top = _reduce_all(x, n, lanes, False, acc, swap)
    for j in range(n):
        out[j] = sleef_expf(x[j] - top)  # x - top <= 0
    inv = np.float32(1) / _reduce_all(out, n, lanes, True, acc, swap)
    for j in range(n):
        out[j] = out[j] * inv


@cached_njit(**_EXACT)
def softmax_topk_route(
    logits, logits_bf16, ids, weights, weights_bf16, T, E, k, renorm, lanes, any_order=False
):
    """topk_route of torch.softmax(logits [T, E], dtype=float32) (addresses, as topk_route's)
    with torch's bits for a CPU capability of `lanes` float32 lanes (8: AVX2, 16: AVX512; see
    above), logits bfloat16 where `logits_bf16`, else float32. False, as topk_route's, also
    where a logit is not finite; `any_order`: _topk_row's."""
    x, p = np.empty(E, np.float32), np.empty(E, np.float32)
    ids_out = numba.carray(address_pointer(ids), (T, k), np.int64)
    vals, queue = np.empty(k, np.float32), (np.empty(E, np.float32), np.empty(E, np.int64))
    acc = np.empty(LEVELS * ILP * LANES, np.float32)
    lane_acc, swap = np.empty(lanes, np.float32), np.empty(lanes, np.float32)
    for t in range(T):
        _load(logits + t * E * (2 if logits_bf16 else 4), logits_bf16, x, E)
        for j in range(E):
            if not np.isfinite(x[j]):
                return False
        _softmax_row(x, p, E, lanes, lane_acc, swap)
        if not _topk_row(p, E, k, renorm, queue, vals, ids_out[t], acc, any_order):
            return False
        _save(vals, weights + t * k * (2 if weights_bf16 else 4), weights_bf16, k)
    return True


numba.config.CACHE_DIR = _previous_cache_dir  # every cached function above is decorated
