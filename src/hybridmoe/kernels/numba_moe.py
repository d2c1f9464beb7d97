"""The fused CPU MoE kernel: one numba call computes a whole layer's routed experts.

Every weight row is read from memory once and dotted with the activations of all the tokens
routed to its expert (kernels/numba_simd.py), in two parallel phases: gate/up rows ->
silu(gate) * up per route, then down rows -> the output, where each work item owns whole
output rows so no two threads write one value. The GIL is released throughout and numba's
thread pool persists across calls. Arrays are flat; weights are the bank's raw bytes.

The formats are compile-time constants: gate/up's and down's `KernelFormat` (quant/formats.py;
a Q4_K_M file pairs Q4_K gate/up with Q6_K down) are passed down to the intrinsics, whose numba
type holds them (numba_simd.KernelFormatType). `moe_parallel` is the parallel kernel of a pair
of formats; `_fused_moe_entry` makes an entry point calling it, a closure over the two
descriptors: one per registered format at import (FUSED_MOE), and one per mixed pair on its
first use (fused_moe_kernel), so only the pairs a model has are compiled.
Numba's on-disk cache keeps such closures, with the pickled closure variables in the cache key
(checked: a second process loads every format's kernel without compiling).
"""

from __future__ import annotations

import functools
import inspect
import threading

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from hybridmoe import env
from hybridmoe.kernels import activation_ir, llvm_ir, numba_simd
from hybridmoe.kernels.activation_ir import activation_at
from hybridmoe.kernels.numba_cache import EntryCache, cached_njit
from hybridmoe.kernels.numba_simd import load_weight, prefetch_rows, tile_dot
from hybridmoe.kernels.threads import kernel_threads
from hybridmoe.quant.formats import WEIGHT_FORMATS, KernelFormat

ROWS_PER_ITEM = 64  # weight rows per parallel work item: a contiguous run of rows per matrix
FIRST_TILE_ROWS = 4  # rows of a run's first tile, prefetched before the run ahead of it
# One token's bf16 and f16 expert rows (a 32-weight block of 64 bytes) are read one row at a
# time, without software prefetch (numba_simd.py): the Qwen3-30B-A3B layer at T = 1 on the AMD
# EPYC, 2 threads, 0.85-0.93x the time of 4-row tiles; numba_dense reads dense rows so (streams)
STREAM_BLOCK_BYTES = 64
_FLAGS = dict(nogil=True, fastmath={"contract", "arcp"})  # cached_njit adds cache=True
# A parallel loop's work items are handed out in chunks, CHUNKS_PER_THREAD a thread
# (chunk_size): a thread the OS preempts (another process on the core) delays the loop by one
# chunk, not by its half, while each chunk's dispatch (~0.3 us of numba's gufunc call on the
# AMD EPYC) stays rare. One item a chunk cost the Qwen3-30B-A3B q4_0 layer 4 % (T = 1, 2
# threads, in one process: 1022 against 979 us) and a decode step of its 4-layer GGUF 7 % of
# its CPU time (benchmarks/bench_decode_overhead.py: 26.2 against 24.3 ms a token)
CHUNKS_PER_THREAD = 8
# A layer call of at most this many routes (a decode step's: 8 tokens at top-8) runs its down
# projection in items of one expert's ROWS_PER_ITEM rows (_fused_moe's and numba_moe_q8's
# down phases): a thread's chunk of items is then one contiguous run of an expert's rows,
# where items of ROWS_PER_ITEM hidden rows read every routed expert's rows in turn (8 runs of
# 27 KB an item at the Qwen3-30B-A3B q4_k shape). Its routes' weighted outputs are kept apart
# and added into y afterwards in the other layout's order (the same bits). Measured (the AMD
# EPYC, 2 threads, the down projection alone after a 512 MiB read and a call on other
# experts, in one process): q4_k 310 / 380 -> 273 / 245 µs, q6_k 395 -> 346 µs. Beyond it the
# kept outputs (routes x H floats) would grow with a prefill's routes
EXPERT_MAJOR_MAX_ROUTES = 64


def kernel_sources() -> list[str]:
    """The source files the kernels are compiled from: this module, the IR modules and the
    module of every registered format's IR builders."""
    builders = [
        ir_fn
        for fmt in WEIGHT_FORMATS.values()
        for ir_fn in (fmt.kernel.dequantize_block_ir, fmt.kernel.load_weight_ir)
        if ir_fn is not None
    ]
    modules = (numba_simd, llvm_ir, activation_ir)
    files = {__file__, *(m.__file__ for m in modules), *map(inspect.getfile, builders)}
    return sorted(files)


# Numba keys its on-disk cache on this file's timestamp only, so a changed numba_simd.py or
# format module would reuse stale machine code. The kernels of this module are cached in a
# directory named by a hash of all their sources instead (numba picks the directory when a
# function is decorated).
_previous_cache_dir = numba.config.CACHE_DIR
numba.config.CACHE_DIR = str(env.kernel_cache_dir(*kernel_sources()))


@cached_njit(**_FLAGS)
def _group_routes(ids, num_experts):
    """Routes r = t * K + k with ids[r] >= 0, sorted by expert: (bad_id, experts [U] ascending,
    starts [U + 1] into the sorted routes, routes [R]); bad_id is -1 unless some id is
    >= num_experts."""
    counts = np.zeros(num_experts + 1, np.int64)
    for r in range(ids.shape[0]):
        if ids[r] >= num_experts:
            return ids[r], counts[:0], counts[:1], counts[:0]
        if ids[r] >= 0:
            counts[ids[r] + 1] += 1
    first = np.cumsum(counts)  # first[e]: position of expert e's first route once sorted
    experts = np.nonzero(counts[1:])[0]
    starts = np.empty(experts.shape[0] + 1, np.int64)
    starts[:-1] = first[experts]
    starts[-1] = first[-1]
    routes = np.empty(first[-1], np.int64)
    fill = first[:-1].copy()
    for r in range(ids.shape[0]):
        if ids[r] >= 0:
            routes[fill[ids[r]]] = r
            fill[ids[r]] += 1
    return -1, experts, starts, routes


@cached_njit(inline="always", **_FLAGS)
def chunk_size(items):
    """Work items per chunk of a parallel loop of `items` on this call's threads:
    CHUNKS_PER_THREAD chunks a thread. A kernel sets it before its prange (set_chunk_size,
    which returns the size it replaces) and restores it after."""
    return max(1, items // (CHUNKS_PER_THREAD * _num_threads()))


@intrinsic
def _num_threads(typingctx):
    """numba.get_num_threads() by the runtime's symbol (set_chunk_size's reasons)."""

    def codegen(context, builder, sig, args):
        count = context.get_value_type(types.intp)
        return builder.call(llvm_ir.declare(builder, "get_num_threads", count, []), [])

    return types.intp(), codegen


@intrinsic
def set_chunk_size(typingctx, items):
    """numba's chunk size for this thread's next parallel loops set to `items`; returns the
    one it replaces. numba.set_parallel_chunksize (and `with parallel_chunksize`, which
    calls it) and numba.get_num_threads hold ctypes pointers in jitted code, which numba's
    disk cache refuses; these call numba's runtime by symbol, as its parfor lowering does.
    The symbols exist once the threading layer is up: this module starts the pool when
    imported (start_pool), before any kernel calling this can be linked (a serial kernel
    would crash the process without)."""
    if not isinstance(items, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        size = context.get_value_type(types.uintp)
        get = llvm_ir.declare(builder, "get_parallel_chunksize", size, [])
        put = llvm_ir.declare(builder, "set_parallel_chunksize", ir.VoidType(), [size])
        previous = builder.call(get, [])
        builder.call(put, [context.cast(builder, args[0], sig.args[0], types.uintp)])
        return previous

    return types.uintp(items), codegen


@cached_njit(inline="always", **_FLAGS)
def streams(fmt, tokens):
    """Whether `tokens` tokens' rows of KernelFormat `fmt` are read one row at a time, one
    stream a thread (STREAM_BLOCK_BYTES): by _matmul here and by numba_dense."""
    return tokens == 1 and fmt.block_bytes == STREAM_BLOCK_BYTES


@cached_njit(inline="always", **_FLAGS)
def _tile(fmt, wrows, xrows, w, w_off, row_bytes, blocks, x, x_offs, first, out, out_off, stride):
    """tile_dot with the tile shape chosen at run time among TILES (each a compiled branch)."""
    if xrows == 1:
        if wrows == 4:
            tile_dot(fmt, 4, 1, w, w_off, row_bytes, blocks, x, x_offs, first, out, out_off, stride)
        elif wrows == 2:
            tile_dot(fmt, 2, 1, w, w_off, row_bytes, blocks, x, x_offs, first, out, out_off, stride)
        else:
            tile_dot(fmt, 1, 1, w, w_off, row_bytes, blocks, x, x_offs, first, out, out_off, stride)
    elif xrows == 2:
        if wrows == 4:
            tile_dot(fmt, 4, 2, w, w_off, row_bytes, blocks, x, x_offs, first, out, out_off, stride)
        elif wrows == 2:
            tile_dot(fmt, 2, 2, w, w_off, row_bytes, blocks, x, x_offs, first, out, out_off, stride)
        else:
            tile_dot(fmt, 1, 2, w, w_off, row_bytes, blocks, x, x_offs, first, out, out_off, stride)
    elif xrows == 3:
        if wrows == 2:
            tile_dot(fmt, 2, 3, w, w_off, row_bytes, blocks, x, x_offs, first, out, out_off, stride)
        else:
            tile_dot(fmt, 1, 3, w, w_off, row_bytes, blocks, x, x_offs, first, out, out_off, stride)
    elif wrows == 2:
        tile_dot(fmt, 2, 4, w, w_off, row_bytes, blocks, x, x_offs, first, out, out_off, stride)
    else:
        tile_dot(fmt, 1, 4, w, w_off, row_bytes, blocks, x, x_offs, first, out, out_off, stride)


# Not inlined (nor the helpers below): numba compiles it once per format and signature, shared
# by gate, up, down and the dense kernel, instead of copying its IR into every call site (that
# copying and typing was ~3/4 of a format's compile: 45-51 -> 10-13 CPU s; calls measured free).
@cached_njit(**_FLAGS)
def _matmul(fmt, w, w_off, row_bytes, n, nrows, x, x_offs, first, count, out):
    """out[c * nrows + r] = weight row r · x[x_offs[first + c] :][:n] for r < nrows, c < count;
    weight row r is n weights at byte w_off + r * row_bytes. Tiles of weight rows outermost,
    so each row comes from memory once and is reread from L1 for further activation rows."""
    blocks = n // 32
    widest = 4 if count <= 2 else 2  # weight rows per tile (TILES)
    if streams(fmt, count):
        widest = 1  # one token's bf16 / f16 rows: one stream, as numba_dense reads them
    r = 0
    while r < nrows:
        wrows = widest if nrows - r >= widest else (2 if nrows - r >= 2 else 1)
        c = 0
        while c < count:
            xrows = min(4, count - c)
            row_off = w_off + r * row_bytes
            _tile(
                fmt,
                wrows,
                xrows,
                w,
                row_off,
                row_bytes,
                blocks,
                x,
                x_offs,
                first + c,
                out,
                c * nrows + r,
                nrows,
            )
            c += xrows
        r += wrows
    if fmt.partial_blocks:  # dense rows may end in a partial block; quantised ones may not
        size = fmt.block_bytes // 32  # bytes per weight
        for r in range(nrows):
            for j in range(blocks * 32, n):
                weight = load_weight(fmt, w, w_off + r * row_bytes + j * size)
                for c in range(count):
                    out[c * nrows + r] += weight * x[x_offs[first + c] + j]


SILU_LANES = activation_ir.silu_lanes()  # 0: libm's expf (_silu), else torch's SLEEF exp


@cached_njit(**_FLAGS)
def _silu(g):
    return g / (np.float32(1.0) + np.exp(-g))


@cached_njit(inline="always", **_FLAGS)
def _vector_activation(values, n, sigmoid):
    """values[:n] = silu (or sigmoid where `sigmoid`, a constant) of values[:n] in place, by
    activation_at: vectors of SILU_LANES, then the tail one value at a time."""
    whole = n - n % SILU_LANES
    for j in range(0, whole, SILU_LANES):
        activation_at(values, j, SILU_LANES, sigmoid)
    for j in range(whole, n):
        activation_at(values, j, 1, sigmoid)


@cached_njit(**_FLAGS)
def _round_bf16(a, n):
    """Rounds a[:n] (float32) to the nearest bfloat16 value, ties to even, as torch's cast does;
    inf and nan are kept."""
    bits = a.view(np.uint32)
    for i in range(n):
        b = np.int64(bits[i])
        if (b & 0x7F800000) != 0x7F800000:
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        bits[i] = np.uint32(b)


@cached_njit(**_FLAGS)
def _swiglu(gate, up, n, act_bf16):
    """gate[:n] = silu(gate) * up, each step rounded to bf16 when `act_bf16` (as torch computes
    it on bf16 tensors); gate and up are the projections, already in the activation dtype.
    silu is torch's vectorised one (activation_ir) where SILU_LANES, else by libm's expf."""
    if SILU_LANES:
        _vector_activation(gate, n, False)
    else:
        for j in range(n):
            gate[j] = _silu(gate[j])
    if act_bf16:
        _round_bf16(gate, n)
    for j in range(n):
        gate[j] *= up[j]
    if act_bf16:
        _round_bf16(gate, n)


@cached_njit(**_FLAGS)
def _clamped_swiglu(gate, up, n, alpha, limit, act_bf16):
    """gate[:n] = (clamp(up, -limit, limit) + 1) * g * sigmoid(g * alpha), g = min(gate,
    limit) (gpt-oss; quant/expert_math.py), each op rounded to bf16 when `act_bf16`; alpha and
    limit are float32, as torch keeps a bf16 op's scalar operand."""
    for j in range(n):
        gate[j] = min(gate[j], limit)
        up[j] = max(min(up[j], limit), -limit)
    if act_bf16:
        _round_bf16(gate, n)
        _round_bf16(up, n)
    glu = np.empty(n, np.float32)
    for j in range(n):
        glu[j] = gate[j] * alpha
    if act_bf16:
        _round_bf16(glu, n)
    if SILU_LANES:  # torch's vectorised sigmoid (activation_ir)
        _vector_activation(glu, n, True)
    else:
        for j in range(n):
            glu[j] = np.float32(1.0) / (np.float32(1.0) + np.exp(-glu[j]))
    if act_bf16:
        _round_bf16(glu, n)
    for j in range(n):
        glu[j] *= gate[j]
        up[j] += np.float32(1.0)
    if act_bf16:
        _round_bf16(glu, n)
        _round_bf16(up, n)
    for j in range(n):
        gate[j] = up[j] * glu[j]
    if act_bf16:
        _round_bf16(gate, n)


@cached_njit(**_FLAGS)
def _add_bias(a, bias, bias_off, count, rows, act_bf16):
    """a[c * rows + r] += bias[bias_off + r] for c < count, r < rows (a projection's output,
    already in the activation dtype), rounded to bf16 when `act_bf16`."""
    for c in range(count):
        for r in range(rows):
            a[c * rows + r] += bias[bias_off + r]
    if act_bf16:
        _round_bf16(a, count * rows)


# activation codes (quant/expert_math.py ACTIVATION_CODES)
SILU = 0
CLAMPED_SWIGLU = 1

# act_bf16 codes: how the kernel rounds (float32 activations: 0, no rounding)
BF16_ACTIVATIONS = 1  # bf16 activations, float32 router weights (Mixtral): float32 products
BF16_ROUTE_WEIGHTS = 2  # bf16 activations and router weights: bf16 weighted outputs


@cached_njit(inline="always", **_FLAGS)
def _weighted(out, count, rows, bias_off, first, routes, route_weights, down_bias, act_bf16):
    """An expert's down outputs out[c * rows + r] for its routes first .. first + count - 1 as
    y takes them: rounded to bf16 (act_bf16), its bias added (bias_off: its rows' first in
    down_bias), times each route's weight, rounded again with BF16_ROUTE_WEIGHTS."""
    if act_bf16:
        _round_bf16(out, count * rows)
    if down_bias.shape[0] > 0:
        _add_bias(out, down_bias, bias_off, count, rows, act_bf16)
    for c in range(count):
        weight = route_weights[routes[first + c]]
        for r in range(rows):
            out[c * rows + r] *= weight
    if act_bf16 == BF16_ROUTE_WEIGHTS:
        _round_bf16(out, count * rows)


@cached_njit(inline="always", **_FLAGS)
def _expert_down(down_fmt, down, u, h0, rows, parts, experts, starts, routes, route_weights, out):
    """out[c * rows + r] = expert u's down row h0 + r of its route c's act, weighted as y
    takes it (_weighted); `parts` the phase's (hidden, inter, row bytes, acts, their offsets,
    the down bias, act_bf16). numba_moe_q8._expert_down is its q8 twin."""
    hidden, inter, i_row_bytes, acts, act_offs, down_bias, act_bf16 = parts
    first, count = starts[u], starts[u + 1] - starts[u]
    row_off = (experts[u] * hidden + h0) * i_row_bytes
    _matmul(down_fmt, down, row_off, i_row_bytes, inter, rows, acts, act_offs, first, count, out)
    bias_off = experts[u] * hidden + h0
    _weighted(out, count, rows, bias_off, first, routes, route_weights, down_bias, act_bf16)


@cached_njit(inline="always", **_FLAGS)
def _keep_routes(out, first, count, rows, h0, hidden, outs):
    """The expert-major layout's item: routes first .. first + count - 1's rows h0 .. h0 +
    rows - 1 (out[c * rows + r]) kept at outs[route * H + h0 + r], for _add_routes."""
    for c in range(count):
        for r in range(rows):
            outs[(first + c) * hidden + h0 + r] = out[c * rows + r]


@cached_njit(inline="always", **_FLAGS)
def _add_routes(outs, starts, routes, top_k, hidden, y):
    """y[token] += outs[route * H:][:H] for every route, expert by expert in `starts`' order
    and each expert's routes in theirs: the additions, in the order, of the hidden-major down
    layout, so the same bits."""
    items = (hidden + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    previous = set_chunk_size(chunk_size(items))
    for chunk in prange(items):
        h0 = chunk * ROWS_PER_ITEM
        rows = min(hidden, h0 + ROWS_PER_ITEM) - h0
        for route in range(starts[-1]):  # the routes grouped by expert, in expert order
            token_off = (routes[route] // top_k) * hidden + h0
            for r in range(rows):
                y[token_off + r] += outs[route * hidden + h0 + r]
    set_chunk_size(previous)


@cached_njit(inline="always", **_FLAGS)
def _fused_moe(
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
    """y[t] += Σ_k route_weights[t*K+k] · down_e(silu(gate_e x_t) ⊙ up_e x_t), e = ids[t*K+k],
    ids < 0 skipped; or, as `act` = (code, alpha, limit) says, another activation
    (CLAMPED_SWIGLU); gate_up_bias f32 [E*2I] (gate's I then up's I per expert) and down_bias
    f32 [E*H], both empty for experts without biases, added after each projection's rounding
    (quant/expert_math.py's contract).
    x f32 [T*H], ids int64 [T*K], route_weights f32 [T*K], y f32 [T*H];
    w_gate, w_up, down uint8, the bank's bytes (ExpertBank.byte_views), gate and up in
    KernelFormat `fmt`, down in `down_fmt`:
    expert e's I gate rows of H weights start at row e * expert_rows of `w_gate`, its up rows
    likewise in `w_up` (a stacked bank: gate_up's bytes, up I rows in, expert_rows 2I), its H
    down rows of I weights at row e * H of `down`.
    The accumulation contract (docs/architecture.md): every dot product in float32 from the
    exact weights; when `act_bf16` (BF16_ACTIVATIONS or BF16_ROUTE_WEIGHTS) each projection,
    silu and product is rounded to bf16 as the torch reference computes them in bf16, and with
    BF16_ROUTE_WEIGHTS also each route's weighted output (bf16 output x bf16 router weight);
    the sum over routes stays float32.
    Returns -1, or the first expert id >= num_experts (then y is untouched). `fmt` and
    `down_fmt` are compile-time constants: call it through fused_moe_kernel(names)."""
    bad_id, experts, starts, routes = _group_routes(ids, num_experts)
    if bad_id >= 0:
        return bad_id
    # a row of n weights takes n * block_bytes / block_weights bytes: whole blocks when quantised
    h_row_bytes = hidden * fmt.block_bytes // fmt.block_weights
    i_row_bytes = inter * down_fmt.block_bytes // down_fmt.block_weights
    num_routes = starts[-1]
    x_offs = (routes // top_k) * hidden  # [R] start of each route's token in x
    act_offs = np.arange(routes.shape[0]) * inter  # [R] start of each route's act row
    code, alpha, limit = act
    has_bias = gate_up_bias.shape[0] > 0
    acts = np.empty(num_routes * inter, np.float32)  # [R, I] silu(gate) * up per route
    chunks = (inter + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    items = experts.shape[0] * chunks
    previous = set_chunk_size(chunk_size(items))
    for item in prange(items):
        u, chunk = item // chunks, item % chunks
        first, count = starts[u], starts[u + 1] - starts[u]
        i0 = chunk * ROWS_PER_ITEM
        rows = min(inter, i0 + ROWS_PER_ITEM) - i0
        gate, up = np.empty(count * rows, np.float32), np.empty(count * rows, np.float32)
        row_off = (experts[u] * expert_rows + i0) * h_row_bytes  # in w_gate and in w_up
        prefetch_rows(w_up, row_off, FIRST_TILE_ROWS * h_row_bytes)  # read after gate's rows
        _matmul(fmt, w_gate, row_off, h_row_bytes, hidden, rows, x, x_offs, first, count, gate)
        _matmul(fmt, w_up, row_off, h_row_bytes, hidden, rows, x, x_offs, first, count, up)
        if act_bf16:
            _round_bf16(gate, count * rows)
            _round_bf16(up, count * rows)
        if has_bias:
            bias_off = experts[u] * 2 * inter + i0
            _add_bias(gate, gate_up_bias, bias_off, count, rows, act_bf16)
            _add_bias(up, gate_up_bias, bias_off + inter, count, rows, act_bf16)
        if code == CLAMPED_SWIGLU:
            _clamped_swiglu(gate, up, count * rows, alpha, limit, act_bf16)
        else:
            _swiglu(gate, up, count * rows, act_bf16)
        for c in range(count):
            for r in range(rows):
                acts[(first + c) * inter + i0 + r] = gate[c * rows + r]
    max_count = np.max(starts[1:] - starts[:-1]) if num_routes else 0
    parts = (hidden, inter, i_row_bytes, acts, act_offs, down_bias, act_bf16)
    if num_routes <= EXPERT_MAJOR_MAX_ROUTES:  # the expert-major down layout
        outs = np.empty(num_routes * hidden, np.float32)
        chunks = (hidden + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
        items = experts.shape[0] * chunks
        set_chunk_size(chunk_size(items))
        for item in prange(items):
            u, chunk = item // chunks, item % chunks
            first, count = starts[u], starts[u + 1] - starts[u]
            h0 = chunk * ROWS_PER_ITEM
            rows = min(hidden, h0 + ROWS_PER_ITEM) - h0
            out = np.empty(count * rows, np.float32)
            _expert_down(
                down_fmt, down, u, h0, rows, parts, experts, starts, routes, route_weights, out
            )
            _keep_routes(out, first, count, rows, h0, hidden, outs)
        _add_routes(outs, starts, routes, top_k, hidden, y)
        set_chunk_size(previous)
        return -1
    items = (hidden + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    set_chunk_size(chunk_size(items))
    for chunk in prange(items):
        h0 = chunk * ROWS_PER_ITEM
        rows = min(hidden, h0 + ROWS_PER_ITEM) - h0
        out = np.empty(max_count * rows, np.float32)
        for u in range(experts.shape[0]):
            first, count = starts[u], starts[u + 1] - starts[u]
            if u + 1 < experts.shape[0]:  # the next expert's rows, read after these
                next_off = (experts[u + 1] * hidden + h0) * i_row_bytes
                prefetch_rows(down, next_off, FIRST_TILE_ROWS * i_row_bytes)
            _expert_down(
                down_fmt, down, u, h0, rows, parts, experts, starts, routes, route_weights, out
            )
            for c in range(count):
                token_off = (routes[first + c] // top_k) * hidden + h0
                for r in range(rows):
                    y[token_off + r] += out[c * rows + r]
    set_chunk_size(previous)
    return -1


# _fused_moe compiled once per pair of formats (compile-time constants), for the entry points
# below and for other kernels' calls (a decode step's attention block computes the layer's
# experts after its routing: kernels/numba_attention_block.py)
@cached_njit(parallel=True, **_FLAGS)
def moe_parallel(
    fmt, down_fmt, x, ids, weights, gate, up, rows, down, hidden, inter, experts, k, act_bf16, act,
    gub, db, y,
):  # fmt: skip
    return _fused_moe(
        fmt, down_fmt, x, ids, weights, gate, up, rows, down, hidden, inter, experts, k, act_bf16,
        act, gub, db, y,
    )  # fmt: skip


def _fused_moe_entry(kernel: KernelFormat, down_kernel: KernelFormat):
    """The entry point of moe_parallel for gate/up in `kernel`'s format and down in
    `down_kernel`'s (same arguments, less the formats)."""

    def fused_moe(
        x, ids, weights, gate, up, rows, down, hidden, inter, experts, k, act_bf16, act, gub, db, y
    ):  # moe_parallel a global, not a closure variable (numba's disk cache keeps globals)
        return moe_parallel(
            kernel, down_kernel, x, ids, weights, gate, up, rows, down, hidden, inter, experts, k,
            act_bf16, act, gub, db, y,
        )  # fmt: skip

    name = kernel.name if kernel == down_kernel else f"{kernel.name}_{down_kernel.name}"
    fused_moe.__name__ = fused_moe.__qualname__ = f"fused_moe_{name}"  # own cache files
    return cached_njit(**_FLAGS)(fused_moe)


# One entry point a format, for banks whose projections share it (the usual case).
FUSED_MOE = {name: _fused_moe_entry(fmt.kernel, fmt.kernel) for name, fmt in WEIGHT_FORMATS.items()}
_CACHE_DIR = numba.config.CACHE_DIR  # the hashed directory (above); mixed pairs go there too
_MIXED = EntryCache(_CACHE_DIR)


def fused_moe_kernel(gate_up_fmt: str, down_fmt: str):
    """The entry point for gate/up in format `gate_up_fmt` and down in `down_fmt` (names):
    FUSED_MOE[name] when they are one format, else made on first use (so only the pairs a
    model uses are compiled and cached), in the same on-disk cache directory."""
    if gate_up_fmt == down_fmt:
        return FUSED_MOE[gate_up_fmt]
    kernels = (WEIGHT_FORMATS[gate_up_fmt].kernel, WEIGHT_FORMATS[down_fmt].kernel)
    return _MIXED.get((gate_up_fmt, down_fmt), lambda: _fused_moe_entry(*kernels))


# Numba's OpenMP layer streams ~2x faster than its portable 'workqueue' layer here, but an
# OpenMP team spin-waits after each call by default, and those spinning threads take the
# cores from the engine's torch threads (measured on 2 cores: layer calls 10x slower while
# another process ran). Numba's OpenMP layer binds to the libgomp already loaded, torch's (the
# loader reuses a loaded libgomp.so.1; checked with LD_DEBUG=bindings), which read
# OMP_WAIT_POLICY when torch loaded; on the cpu device every kernel is launched from the
# calling thread (the inline executor), one team whose spin keeps it hot
# (docs/architecture.md). start_pool sets PASSIVE for a process whose numba loads its own
# libgomp. The lock keeps any layer safe from concurrent launches (calls would only fight over
# the cores).
_LAUNCH_LOCK = threading.Lock()


@cached_njit(parallel=True)
def _touch_pool(out):
    for i in prange(out.shape[0]):
        out[i] = i


@functools.cache  # once per process
def start_pool() -> None:
    """Start numba's thread pool as described above; every parallel numba kernel of the
    package calls it before its first launch (the first launch starts the pool). torch's
    intra-op thread count stays as it was: numba's OpenMP layer binds to torch's libgomp, and
    starting the pool sets the calling thread's OpenMP thread count to the pool's size, which
    torch reads as its own (an engine built with threads=1 then ran its dense kernels and
    torch's ops on every core: tests/engine/test_thread_count.py)."""
    import torch  # loaded already: the kernels' callers hand them torch tensors' memory

    saved = torch.get_num_threads()
    with env.default_set("OMP_WAIT_POLICY", "PASSIVE"):
        _touch_pool(np.zeros(max_threads(), np.int64))
    torch.set_num_threads(saved)


def max_threads() -> int:
    """The most threads a kernel call can use (numba's pool size, fixed at import)."""
    return numba.config.NUMBA_NUM_THREADS


def pool_threads() -> int:
    """kernel_threads(), at most numba's pool: the thread count a kernel launches on by
    default."""
    return min(kernel_threads(), max_threads())


# per calling thread: the thread count numba holds for it as launch last set it (numba's count
# and chunk size are per calling thread; a parallel region restores the chunk size it found)
_LAUNCHER = threading.local()


def launch(kernel, threads: int | None, *args):
    """kernel(*args), a parallel kernel of the package, on `threads` threads (None: all of
    numba's pool), under the launch lock with the pool started as above. numba's thread count
    and chunk size are per calling thread: launch sets them on a thread's first launch and
    when its count changes (each set costs ~5 µs of numba's init locks; launch is the package's
    only caller of numba.set_num_threads)."""
    count = threads or max_threads()
    with _LAUNCH_LOCK:
        start_pool()  # functools.cache: a dict lookup after the first call
        if getattr(_LAUNCHER, "threads", None) != count:
            numba.set_num_threads(count)
            # the decode kernels' loops set their own chunks (chunk_size); the others (load's
            # kernels) hand out items one at a time: a thread the OS preempts (another process
            # on the core) delays the call by one item, not by half the work
            numba.set_parallel_chunksize(1)
            _LAUNCHER.threads = count
        return kernel(*args)


start_pool()  # the threading layer's symbols, before any kernel calling set_chunk_size links
numba.config.CACHE_DIR = _previous_cache_dir  # every cached function above is decorated
