"""The fused CPU MoE kernel with q8 activations (quant/activation_q8.py): kernels/numba_moe.py's
layer kernel for banks whose gate/up and down have integer dot products (int8-block formats:
q8_0, q4_0; integer super-blocks: the k-quants q2_k ... q6_k) under `activation_quant q8`.
Each token's x is quantised once (per 32-block or 256-block, the format's, as the contract's
step 1), each route's down input once after its activation; every projection is a tile of
integer dot products (kernels/numba_simd_q8.py). Everything else (grouping, activation, biases,
bf16 rounding points, the weighted sum) is numba_moe.py's, from its helpers.

Imported only when a bank computes with q8 activations, so engines without it compile nothing
here; its entry points are made on first use per format pair, cached on disk as numba_moe.py's.
"""

from __future__ import annotations

import inspect

import numba
import numpy as np
from numba import prange
from numba.core.dispatcher import Dispatcher

from hybridmoe import env
from hybridmoe.kernels import numba_moe as nm
from hybridmoe.kernels import numba_simd_q8
from hybridmoe.kernels.llvm_ir import target_has
from hybridmoe.kernels.numba_cache import EntryCache, cached_njit
from hybridmoe.kernels.numba_simd import prefetch_rows
from hybridmoe.kernels.numba_simd_q8 import WIDE_TOKENS, quantize_block, tile_dot_q8
from hybridmoe.quant import activation_q8
from hybridmoe.quant.formats import WEIGHT_FORMATS, KernelFormat

_FLAGS = nm._FLAGS
# the activation rows of a k-quant tile of one weight row where a projection has at least this
# many (numba_simd_q8.WIDE_TOKENS: AVX-512 targets; 0: none, the 2 x 4 tile)
WIDE = WIDE_TOKENS if target_has("avx512f") else 0
SHORT_ROW_WEIGHTS = 2048  # shorter rows take fmt.short_row_rows-row tiles for one token
# the quantiser: no fast-math (a reciprocal would change a bit), said explicitly: a numba
# callee inherits its caller's fastmath flags unless it sets its own
_EXACT = dict(nogil=True, fastmath=False)


def kernel_sources() -> list[str]:
    """numba_moe.py's kernel sources, this module's, its IR's and the contract's."""
    mine = (__file__, numba_simd_q8.__file__, inspect.getfile(activation_q8))
    return sorted({*nm.kernel_sources(), *mine})


_previous_cache_dir = numba.config.CACHE_DIR
numba.config.CACHE_DIR = str(env.kernel_cache_dir(*kernel_sources()))


@cached_njit(inline="always", **_EXACT)
def _round_away(v):
    """C's roundf(v) for a finite float32 |v| <= 2^23, as an int: halves away from zero."""
    t = int(v)  # truncates
    frac = v - t  # exact
    if frac >= 0.5:
        return t + 1
    if frac <= -0.5:
        return t - 1
    return t


@cached_njit(**_EXACT)
def quantize_rows(x, n, q, d, block=32):
    """The contract's step 1 for x[:n] (float32, finite, n a multiple of `block`, 32 or 256):
    q[:n] int8 and d[:n / block] float32, block by block: d = max|x| / 127, q = roundf(x * (1
    / d)); in vectors (numba_simd_q8.quantize_block), quantize_rows_reference's bits."""
    if block == 32:
        for b in range(n // 32):
            quantize_block(x, b * 32, q, d, b, 32)
    else:
        for b in range(n // 256):
            quantize_block(x, b * 256, q, d, b, 256)


@cached_njit(**_EXACT)
def quantize_rows_reference(x, n, q, d, block=32):
    """quantize_rows one value at a time (its reference: tests/kernel_tests/
    test_activation_q8.py compares them)."""
    for b in range(n // block):
        amax = np.float32(0.0)
        for j in range(b * block, b * block + block):
            a = abs(x[j])
            if a > amax:
                amax = a
        scale = amax / np.float32(127.0)
        inv = np.float32(1.0) / scale if scale != 0 else np.float32(0.0)
        for j in range(b * block, b * block + block):
            q[j] = _round_away(x[j] * inv)
        d[b] = scale


@cached_njit(**_EXACT)
def group_sums(q, n, s):
    """s[g] = Σ q[16 g .. 16 g + 15] (int16, exact: |s| <= 16 * 127) for g < n / 16: the
    activations' sums a k-quant super-block's minimums (or offset) multiply."""
    for g in range(n // 16):
        total = 0
        for j in range(16 * g, 16 * g + 16):
            total += q[j]
        s[g] = total


@cached_njit(inline="always", **_EXACT)
def _quantized(fmt, x, n):
    """(q, d, s) of x[:n] for `fmt`'s projections: its blocks' activation quantisation and the
    16-weight sums (a super-block's minimums multiply them; a 32-block's biased dot takes its
    two)."""
    q, d = np.empty(n, np.int8), np.empty(n // fmt.block_weights, np.float32)
    quantize_rows(x, n, q, d, fmt.block_weights)
    s = np.empty(n // 16, np.int16)
    group_sums(q, n, s)
    return q, d, s


@cached_njit(inline="always", **_FLAGS)
def _tile(fmt, wrows, xrows, w, w_off, row_bytes, blocks, xq, xd, xs, offs, first, out, o, stride):
    """tile_dot_q8 with the tile shape chosen at run time among TILES (each a compiled branch;
    written out: numba keeps the shape literal only for literal arguments)."""
    if xrows == 1:
        if wrows == 4:
            tile_dot_q8(
                fmt, 4, 1, w, w_off, row_bytes, blocks, xq, xd, xs, offs, first, out, o, stride
            )
        elif wrows == 2:
            tile_dot_q8(
                fmt, 2, 1, w, w_off, row_bytes, blocks, xq, xd, xs, offs, first, out, o, stride
            )
        else:
            tile_dot_q8(
                fmt, 1, 1, w, w_off, row_bytes, blocks, xq, xd, xs, offs, first, out, o, stride
            )
    elif xrows == 2:
        if wrows == 4:
            tile_dot_q8(
                fmt, 4, 2, w, w_off, row_bytes, blocks, xq, xd, xs, offs, first, out, o, stride
            )
        elif wrows == 2:
            tile_dot_q8(
                fmt, 2, 2, w, w_off, row_bytes, blocks, xq, xd, xs, offs, first, out, o, stride
            )
        else:
            tile_dot_q8(
                fmt, 1, 2, w, w_off, row_bytes, blocks, xq, xd, xs, offs, first, out, o, stride
            )
    elif xrows == 3:
        if wrows == 2:
            tile_dot_q8(
                fmt, 2, 3, w, w_off, row_bytes, blocks, xq, xd, xs, offs, first, out, o, stride
            )
        else:
            tile_dot_q8(
                fmt, 1, 3, w, w_off, row_bytes, blocks, xq, xd, xs, offs, first, out, o, stride
            )
    elif xrows == 4:
        if wrows == 2:
            tile_dot_q8(
                fmt, 2, 4, w, w_off, row_bytes, blocks, xq, xd, xs, offs, first, out, o, stride
            )
        else:
            tile_dot_q8(
                fmt, 1, 4, w, w_off, row_bytes, blocks, xq, xd, xs, offs, first, out, o, stride
            )
    else:  # WIDE_TOKENS: a k-quant's
        tile_dot_q8(
            fmt, 1, WIDE_TOKENS, w, w_off, row_bytes, blocks, xq, xd, xs, offs, first, out, o,
            stride,
        )  # fmt: skip


@cached_njit(inline="always", **_FLAGS)
def matmul_q8(fmt, w, w_off, row_bytes, n, nrows, xq, xd, xs, x_offs, first, count, out):
    """out[c * nrows + r] = the q8 contract's dot of weight row r (n weights at byte w_off +
    r * row_bytes) with the quantised row at xq[x_offs[first + c]:] (scales xd[... / W:], W
    the format's block of 32 or 256, sums xs[... / 16:]), for r < nrows, c < count; tiles as
    numba_moe._matmul's, except that one token's are fmt.one_token_rows rows wide (the
    k-quants: 1; fmt.short_row_rows on rows of fewer than SHORT_ROW_WEIGHTS weights), and a
    k-quant's of WIDE or more tokens 1 row by WIDE tokens (the rest of them 1 row by up to 4).
    Activation rows outermost (unlike _matmul): a group of tokens' q8 rows (16 KB for 8
    tokens of 2048) stay in L1 while the item's weight rows pass, where weight rows outermost
    reread every token's (48 KB for 24, beyond L1) for each row; the rows of an item come from
    memory once and then from L2 (73 KB for 64 q4_k rows of 2048). Measured (the AMD EPYC,
    2026-12-07, one MoE layer at the Qwen3-30B-A3B shape, 2 threads, both orders in one
    process, alternating, medians of the time ratios): 384 random tokens q4_k 0.96, q6_k 0.95,
    q4_0 0.97, q8_0 0.95; 16 tokens on shared experts q4_k 0.93, q4_0 0.98. One token's
    calls are one group: the same loop. A pair's sum does not depend on its tile or the
    order: the same bits either way."""
    blocks = n // fmt.block_weights
    wide = WIDE > 0 and fmt.block_weights == 256 and count >= WIDE  # a k-quant's super-blocks
    one_token = fmt.one_token_rows if n >= SHORT_ROW_WEIGHTS else fmt.short_row_rows
    widest = one_token if count == 1 else (1 if wide else (4 if count == 2 else 2))
    c = 0
    while c < count:
        xrows = WIDE if wide and count - c >= WIDE else min(4, count - c)
        r = 0
        while r < nrows:
            wrows = widest if nrows - r >= widest else (2 if nrows - r >= 2 else 1)
            row_off = w_off + r * row_bytes
            _tile(
                fmt,
                wrows,
                xrows,
                w,
                row_off,
                row_bytes,
                blocks,
                xq,
                xd,
                xs,
                x_offs,
                first + c,
                out,
                c * nrows + r,
                nrows,
            )
            r += wrows
        c += xrows


@cached_njit(inline="always", **_FLAGS)
def _gate_up_phase(
    fmt,
    xq,
    xd,
    xs,
    x_offs,
    experts,
    starts,
    w_gate,
    w_up,
    expert_rows,
    hidden,
    inter,
    act_bf16,
    act,
    gate_up_bias,
    acts,
):
    """acts[(route) * I + i] = act(gate, up) of every route, as numba_moe._fused_moe's first
    phase, the projections by the q8 contract."""
    h_row_bytes = hidden * fmt.block_bytes // fmt.block_weights
    code, alpha, limit = act
    chunks = (inter + nm.ROWS_PER_ITEM - 1) // nm.ROWS_PER_ITEM
    items = experts.shape[0] * chunks
    previous = nm.set_chunk_size(nm.chunk_size(items))
    for item in prange(items):
        u, chunk = item // chunks, item % chunks
        first, count = starts[u], starts[u + 1] - starts[u]
        i0 = chunk * nm.ROWS_PER_ITEM
        rows = min(inter, i0 + nm.ROWS_PER_ITEM) - i0
        gate, up = np.empty(count * rows, np.float32), np.empty(count * rows, np.float32)
        row_off = (experts[u] * expert_rows + i0) * h_row_bytes
        prefetch_rows(w_up, row_off, nm.FIRST_TILE_ROWS * h_row_bytes)  # read after gate's
        for w, part in ((w_gate, gate), (w_up, up)):
            matmul_q8(
                fmt, w, row_off, h_row_bytes, hidden, rows, xq, xd, xs, x_offs, first, count, part
            )
        if act_bf16:
            nm._round_bf16(gate, count * rows)
            nm._round_bf16(up, count * rows)
        if gate_up_bias.shape[0] > 0:
            bias_off = experts[u] * 2 * inter + i0
            nm._add_bias(gate, gate_up_bias, bias_off, count, rows, act_bf16)
            nm._add_bias(up, gate_up_bias, bias_off + inter, count, rows, act_bf16)
        if code == nm.CLAMPED_SWIGLU:
            nm._clamped_swiglu(gate, up, count * rows, alpha, limit, act_bf16)
        else:
            nm._swiglu(gate, up, count * rows, act_bf16)
        for c in range(count):
            for r in range(rows):
                acts[(first + c) * inter + i0 + r] = gate[c * rows + r]
    nm.set_chunk_size(previous)


@cached_njit(inline="always", **_FLAGS)
def _expert_down(fmt, down, u, h0, rows, parts, experts, starts, routes, route_weights, out):
    """out[c * rows + r] = expert u's down row h0 + r of its route c's quantised act, weighted
    as y takes it (numba_moe._weighted); `parts` the phase's (hidden, inter, row bytes, acts'
    q, d and sums, their offsets, the down bias, act_bf16)."""
    hidden, inter, i_row_bytes, aq, ad, a_sums, act_offs, down_bias, act_bf16 = parts
    first, count = starts[u], starts[u + 1] - starts[u]
    row_off = (experts[u] * hidden + h0) * i_row_bytes
    matmul_q8(
        fmt, down, row_off, i_row_bytes, inter, rows, aq, ad, a_sums, act_offs, first, count, out
    )
    bias_off = experts[u] * hidden + h0
    nm._weighted(out, count, rows, bias_off, first, routes, route_weights, down_bias, act_bf16)


@cached_njit(inline="always", **_FLAGS)
def _down_phase(
    fmt,
    aq,
    ad,
    a_sums,
    experts,
    starts,
    routes,
    route_weights,
    down,
    hidden,
    inter,
    top_k,
    act_bf16,
    down_bias,
    y,
):
    """y += the weighted down projections of the quantised acts, as numba_moe._fused_moe's
    second phase."""
    i_row_bytes = inter * fmt.block_bytes // fmt.block_weights
    act_offs = np.arange(routes.shape[0]) * inter
    parts = (hidden, inter, i_row_bytes, aq, ad, a_sums, act_offs, down_bias, act_bf16)
    num_routes = starts[-1]
    if num_routes <= nm.EXPERT_MAJOR_MAX_ROUTES:  # numba_moe's expert-major layout
        outs = np.empty(num_routes * hidden, np.float32)
        chunks = (hidden + nm.ROWS_PER_ITEM - 1) // nm.ROWS_PER_ITEM
        items = experts.shape[0] * chunks
        previous = nm.set_chunk_size(nm.chunk_size(items))
        for item in prange(items):
            u, chunk = item // chunks, item % chunks
            first, count = starts[u], starts[u + 1] - starts[u]
            h0 = chunk * nm.ROWS_PER_ITEM
            rows = min(hidden, h0 + nm.ROWS_PER_ITEM) - h0
            out = np.empty(count * rows, np.float32)
            _expert_down(
                fmt, down, u, h0, rows, parts, experts, starts, routes, route_weights, out
            )  # fmt: skip
            nm._keep_routes(out, first, count, rows, h0, hidden, outs)
        nm._add_routes(outs, starts, routes, top_k, hidden, y)
        nm.set_chunk_size(previous)
        return
    max_count = np.max(starts[1:] - starts[:-1]) if num_routes else 0
    items = (hidden + nm.ROWS_PER_ITEM - 1) // nm.ROWS_PER_ITEM
    previous = nm.set_chunk_size(nm.chunk_size(items))
    for chunk in prange(items):
        h0 = chunk * nm.ROWS_PER_ITEM
        rows = min(hidden, h0 + nm.ROWS_PER_ITEM) - h0
        out = np.empty(max_count * rows, np.float32)
        for u in range(experts.shape[0]):
            first, count = starts[u], starts[u + 1] - starts[u]
            if u + 1 < experts.shape[0]:  # the next expert's rows, read after these
                next_off = (experts[u + 1] * hidden + h0) * i_row_bytes
                prefetch_rows(down, next_off, nm.FIRST_TILE_ROWS * i_row_bytes)
            _expert_down(
                fmt, down, u, h0, rows, parts, experts, starts, routes, route_weights, out
            )  # fmt: skip
            for c in range(count):
                token_off = (routes[first + c] // top_k) * hidden + h0
                for r in range(rows):
                    y[token_off + r] += out[c * rows + r]
    nm.set_chunk_size(previous)


@cached_njit(inline="always", **_FLAGS)
def _fused_moe_q8(
    fmt,
    down_fmt,
    x,
    ids,
    route_weights,
    w_gate,
    w_up,
    expert_rows,
    down,
    hidden,
    inter,
    num_experts,
    top_k,
    act_bf16,
    act,
    gate_up_bias,
    down_bias,
    y,
):
    """numba_moe._fused_moe's contract (same arguments), every projection by the q8 contract;
    `fmt` and `down_fmt` KernelFormats with integer dot products."""
    bad_id, experts, starts, routes = nm._group_routes(ids, num_experts)
    if bad_id >= 0:
        return bad_id
    xq, xd, xs = _quantized(fmt, x, x.shape[0])  # every token once
    x_offs = (routes // top_k) * hidden
    acts = np.empty(starts[-1] * inter, np.float32)  # [R, I]
    _gate_up_phase(
        fmt,
        xq,
        xd,
        xs,
        x_offs,
        experts,
        starts,
        w_gate,
        w_up,
        expert_rows,
        hidden,
        inter,
        act_bf16,
        act,
        gate_up_bias,
        acts,
    )
    aq, ad, a_sums = _quantized(down_fmt, acts, acts.shape[0])
    _down_phase(
        down_fmt,
        aq,
        ad,
        a_sums,
        experts,
        starts,
        routes,
        route_weights,
        down,
        hidden,
        inter,
        top_k,
        act_bf16,
        down_bias,
        y,
    )
    return -1


# _fused_moe_q8 compiled once per pair of formats, for the entry points and the attention
# block (as numba_moe.moe_parallel)
@cached_njit(parallel=True, **_FLAGS)
def moe_q8_parallel(
    fmt, down_fmt, x, ids, weights, gate, up, rows, down, hidden, inter, experts, k, act_bf16, act,
    gub, db, y,
):  # fmt: skip
    return _fused_moe_q8(
        fmt, down_fmt, x, ids, weights, gate, up, rows, down, hidden, inter, experts, k, act_bf16,
        act, gub, db, y,
    )  # fmt: skip


def _entry(kernel: KernelFormat, down_kernel: KernelFormat):
    """The entry point of moe_q8_parallel for gate/up in `kernel`, down in `down_kernel`
    (numba_moe's arguments, less the formats)."""

    def fused_moe_q8(
        x, ids, weights, gate, up, rows, down, hidden, inter, experts, k, act_bf16, act, gub, db, y
    ):
        return moe_q8_parallel(
            kernel, down_kernel, x, ids, weights, gate, up, rows, down, hidden, inter, experts, k,
            act_bf16, act, gub, db, y,
        )  # fmt: skip

    name = kernel.name if kernel == down_kernel else f"{kernel.name}_{down_kernel.name}"
    fused_moe_q8.__name__ = fused_moe_q8.__qualname__ = f"fused_moe_q8_{name}"
    return cached_njit(**_FLAGS)(fused_moe_q8)


_ENTRIES = EntryCache(numba.config.CACHE_DIR)


def fused_moe_q8_kernel(gate_up_fmt: str, down_fmt: str) -> Dispatcher:
    """The entry point for the pair of format names (both with integer dot products), made on
    first use."""
    key = (gate_up_fmt, down_fmt)
    kernels = [WEIGHT_FORMATS[name].kernel for name in key]
    if any(k.int8_block_ir is None and k.superblock_ints_ir is None for k in kernels):
        raise ValueError(f"q8 activations need integer-dot formats, got {key}")
    return _ENTRIES.get(key, lambda: _entry(*kernels))


numba.config.CACHE_DIR = _previous_cache_dir  # every cached function above is decorated
