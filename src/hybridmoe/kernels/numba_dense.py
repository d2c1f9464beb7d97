"""The CPU dense projection for decode steps: y = x W^T (+ b) for a few tokens, W in any
registered weight format, at memory bandwidth.

Each call is one pass over the weight: its rows are cut into work items of contiguous rows
(about ITEM_BYTES of weights each) that numba's pool hands out one at a time
(numba_moe.launch: the same pool, launch lock and passive wait policy as the expert kernel),
so each thread streams contiguous memory; within an item, kernels/dense_ir.py's vector loop
reads each weight row once for up to 4 tokens (T <= ~16: a decode batch) and writes straight
into the output. A weight under MIN_PARALLEL_BYTES runs on the calling thread, without a
parallel region (DENSE_SERIAL).

The accumulation contract: each dot product in float32 from the exact weights, in the order
dense_ir.py states (then the weights of a partial last block, one fused multiply-add each, in
order), the bias added in float32, then one rounding to the activation dtype: what torch's
F.linear computes on the CPU in bfloat16 (float32 accumulation, the bias before the one
rounding) and in float32, up to the summation order. `dense_reference` restates the order in
scalar code (bit for bit the same); the torch reference is kernels/torch_dense.py.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from hybridmoe import env
from hybridmoe.kernels import dense_ir, glue, numba_glue
from hybridmoe.kernels.dense_ir import dense_rows, fma32
from hybridmoe.kernels.host_arrays import host_array, host_logits
from hybridmoe.kernels.numba_cache import cached_njit
from hybridmoe.kernels.numba_moe import (
    _round_bf16,
    chunk_size,
    kernel_sources,
    launch,
    pool_threads,
    set_chunk_size,
    streams,
)
from hybridmoe.kernels.numba_simd import load_weight
from hybridmoe.quant.formats import WEIGHT_FORMATS, KernelFormat, WeightFormat

ITEM_BYTES = 64 << 10  # weight bytes per parallel work item (whole groups of 4 rows)
# Weights smaller than this run on one thread: waking the pool's other threads costs more than
# they save (on a shared 2-core machine a launch on 2 threads took ms, on 1 thread ~30 µs)
MIN_PARALLEL_BYTES = 1 << 20
# One token's bf16 and f16 rows (numba_moe.STREAM_BLOCK_BYTES) are read one row at a time, a
# single ascending stream without software prefetch (dense_ir.py): on the AMD EPYC, 2 threads,
# a Qwen3-30B-A3B q_proj / o_proj / lm_head 0.84-0.96x the time of 4-row groups (1 thread
# 0.72-0.82x); not for f32 (no gain), the quantised formats (q8_0: 1.14-1.35x) or more tokens
# (the activations' loads shared by fewer rows: 1.2-2x). Such a stream's work items are
# STREAM_ITEMS times the others' (256 KB of bf16: each thread's stream restarts less often;
# q_proj / o_proj 0.86-0.93x the time of 64 KB items, 2 threads; q8_0 at T = 4 1.13x: not
# for the others)
STREAM_ITEMS = 4
# ... for rows of at most this many bytes: longer ones are read in 4-row groups with software
# prefetch as the other formats' (AMD EPYC, 2 threads, bf16 [rows, n] from DRAM, alternating
# builds: n = 6144 / 8192 / 16384 took 693-733 / 729-745 / 769-785 µs one row at a time, 540-557
# / 482-497 / 482-506 in groups, while n <= 4096 streamed at the DRAM rate: an o_proj of 64
# heads of 128, Qwen3-235B-A22B's, is such a row)
STREAM_MAX_ROW_BYTES = 8192
_FLAGS = dict(nogil=True, fastmath={"contract", "arcp"})

# cached under a hash of every source these kernels inline (see numba_moe.py)
_previous_cache_dir = numba.config.CACHE_DIR
numba.config.CACHE_DIR = str(
    env.kernel_cache_dir(__file__, dense_ir.__file__, numba_glue.__file__, *kernel_sources())
)


@cached_njit(inline="always", **_FLAGS)
def _streams(fmt, tokens, row_bytes):
    """Whether rows of `row_bytes` are read one at a time (numba_moe.streams), up to
    STREAM_MAX_ROW_BYTES."""
    return streams(fmt, tokens) and row_bytes <= STREAM_MAX_ROW_BYTES


@cached_njit(inline="always", **_FLAGS)
def _rows(fmt, tokens, w, w_off, row_bytes, blocks, nrows, x, n, y, y_off, y_stride):
    """dense_rows over `nrows` rows for `tokens` <= 4 tokens, in the widest groups that fit;
    one token's bf16 and f16 rows one at a time (numba_moe.streams)."""
    if _streams(fmt, tokens, row_bytes):
        dense_rows(fmt, 1, 1, w, w_off, row_bytes, blocks, nrows, x, n, y, y_off, y_stride)
    elif tokens == 1:
        g4 = nrows // 4
        dense_rows(fmt, 4, 1, w, w_off, row_bytes, blocks, g4, x, n, y, y_off, y_stride)
        r = 4 * g4
        if nrows - r >= 2:
            off = w_off + r * row_bytes
            dense_rows(fmt, 2, 1, w, off, row_bytes, blocks, 1, x, n, y, y_off + r, y_stride)
            r += 2
        if nrows > r:
            off = w_off + r * row_bytes
            dense_rows(fmt, 1, 1, w, off, row_bytes, blocks, 1, x, n, y, y_off + r, y_stride)
    elif tokens == 2:
        g2 = nrows // 2
        dense_rows(fmt, 2, 2, w, w_off, row_bytes, blocks, g2, x, n, y, y_off, y_stride)
        if nrows > 2 * g2:
            off = w_off + 2 * g2 * row_bytes
            dense_rows(fmt, 1, 2, w, off, row_bytes, blocks, 1, x, n, y, y_off + 2 * g2, y_stride)
    elif tokens == 3:
        g2 = nrows // 2
        dense_rows(fmt, 2, 3, w, w_off, row_bytes, blocks, g2, x, n, y, y_off, y_stride)
        if nrows > 2 * g2:
            off = w_off + 2 * g2 * row_bytes
            dense_rows(fmt, 1, 3, w, off, row_bytes, blocks, 1, x, n, y, y_off + 2 * g2, y_stride)
    else:
        g2 = nrows // 2
        dense_rows(fmt, 2, 4, w, w_off, row_bytes, blocks, g2, x, n, y, y_off, y_stride)
        if nrows > 2 * g2:
            off = w_off + 2 * g2 * row_bytes
            dense_rows(fmt, 1, 4, w, off, row_bytes, blocks, 1, x, n, y, y_off + 2 * g2, y_stride)


@cached_njit(inline="always", **_FLAGS)
def _finish(fmt, w, row_bytes, n, nrows, r0, rows, x, tokens, bias, y, y_bf16):
    """Rows r0 .. r0 + rows of y: the partial last block's weights, the bias, and for bf16
    activations (`y_bf16` not empty) the rounding, into y_bf16 as bf16 bits."""
    if fmt.partial_blocks:
        size = fmt.block_bytes // 32  # bytes per weight
        for t in range(tokens):
            for r in range(r0, r0 + rows):
                acc = y[t * nrows + r]
                for j in range(n // 32 * 32, n):
                    weight = load_weight(fmt, w, r * row_bytes + j * size)
                    acc = fma32(weight, x[t * n + j], acc)
                y[t * nrows + r] = acc
    for t in range(tokens):
        out = y[t * nrows + r0 : t * nrows + r0 + rows]
        if bias.shape[0]:
            for r in range(rows):
                out[r] += bias[r0 + r]
        if y_bf16.shape[0]:
            _round_bf16(out, rows)
            bits = out.view(np.uint32)
            for r in range(rows):
                y_bf16[t * nrows + r0 + r] = np.uint16(bits[r] >> np.uint32(16))


@cached_njit(inline="always", **_FLAGS)
def float32_io(x, x_bf16, y, n_in, n_out):
    """(the input, the output) a dense kernel computes in: x and y as given for float32
    activations; for bf16 ones (x_bf16 not empty) x_bf16's n_in values widened to float32
    (the high half of the bits, exact) and a float32 array of n_out for the output, which
    _finish rounds into y_bf16."""
    if not x_bf16.shape[0]:
        return x, y
    widened = np.empty(n_in, np.float32)
    bits = widened.view(np.uint32)
    for i in range(n_in):
        bits[i] = np.uint32(x_bf16[i]) << np.uint32(16)
    return widened, np.empty(n_out, np.float32)


@cached_njit(inline="always", **_FLAGS)
def _dense(fmt, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows):
    """y[t * nrows + r] = row r of w · x[t * n : (t + 1) * n] + bias[r] (no bias when `bias`
    is empty); r < nrows, t < tokens. w uint8: nrows rows of row_bytes bytes, n weights each,
    in KernelFormat `fmt`; bias f32 [nrows] or [0]; work items of `item_rows` rows. Float32
    activations: x f32 [tokens * n] -> y f32 [tokens * nrows] (x_bf16, y_bf16 empty); bf16
    ones: x_bf16 uint16 [tokens * n] (bf16 bits) -> y_bf16 uint16 [tokens * nrows], rounded
    once (x, y empty)."""
    x, y = float32_io(x, x_bf16, y, tokens * n, tokens * nrows)
    if _streams(fmt, tokens, row_bytes):
        item_rows *= STREAM_ITEMS  # one stream a thread, restarted less often
    items = (nrows + item_rows - 1) // item_rows
    previous = set_chunk_size(chunk_size(items))
    for item in prange(items):
        r0 = item * item_rows
        rows = min(nrows, r0 + item_rows) - r0
        t = 0
        while t < tokens:
            count = min(4, tokens - t)
            xt = x[t * n :]
            off = t * nrows + r0
            _rows(fmt, count, w, r0 * row_bytes, row_bytes, n // 32, rows, xt, n, y, off, nrows)
            t += count
        _finish(fmt, w, row_bytes, n, nrows, r0, rows, x, tokens, bias, y, y_bf16)
    set_chunk_size(previous)


# _dense compiled once per format (`fmt`, a compile-time constant: numba_simd.KernelFormatType)
# in a parallel and a serial form, for the entry points below and other kernels' calls (a
# decode step's attention block: kernels/numba_attention_block.py)
@cached_njit(parallel=True, **_FLAGS)
def dense_parallel(fmt, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows):
    _dense(fmt, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows)


@cached_njit(**_FLAGS)
def dense_serial(fmt, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows):
    _dense(fmt, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows)


def _dense_entry(kernel: KernelFormat, parallel: bool):
    """An entry point of _dense for one format (same arguments, less `fmt`): parallel, or a
    serial one for the calling thread."""

    def dense(w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows):
        if parallel:  # a constant: numba compiles one branch (dispatchers are globals here,
            # not closure variables, which numba's disk cache does not keep)
            dense_parallel(
                kernel, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows
            )
        else:
            dense_serial(
                kernel, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows
            )

    kind = "" if parallel else "serial_"
    dense.__name__ = dense.__qualname__ = f"dense_{kind}{kernel.name}"  # own cache files
    return cached_njit(**_FLAGS)(dense)


# no fastmath here: numba compiles a jitted function first called from inside another's
# compile with the caller's flags (and caches it so), and 'arcp' turned the top-k's
# renormalising division into a multiply by the reciprocal (other bits, in every later
# process). _dense's own arithmetic is explicit FMAs and bit operations: the same bits
# (tests/kernel_tests/test_numba_glue.py compares the logits with DENSE's).
@cached_njit(nogil=True)
def dense_route(
    fmt, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows, ids, weights,
    weights_bf16, k, renorm, lanes, any_order=False, parallel=False,
):  # fmt: skip
    """A softmax router's step: _dense's logits of the gate in `fmt` (on the calling thread,
    or with `parallel` on numba's pool: dense_parallel, the same bits), then
    numba_glue.softmax_topk_route of them. Arguments: _dense's, then the route's ids and
    weights addresses, weights_bf16, k, renorm, lanes; the logits stay in y or y_bf16 (the
    caller's arrays, bfloat16 bits for bfloat16 activations); any_order:
    softmax_topk_route's. Returns its answer. Called by the route entries (serial: a gate is
    small) and by the attention block (numba_attention_block.py), which routes after its
    post-attention norm, on the pool where the gate is as large as a projection that runs so."""
    if parallel:
        dense_parallel(fmt, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows)
    else:
        _dense(fmt, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows)
    bf16 = x_bf16.shape[0] > 0
    logits = y_bf16.ctypes.data if bf16 else y.ctypes.data
    return numba_glue.softmax_topk_route(
        logits, bf16, ids, weights, weights_bf16, tokens, nrows, k, renorm, lanes, any_order
    )


def _route_entry(kernel: KernelFormat):
    """dense_route's entry point for a gate in `kernel`'s format (same arguments, less
    `fmt`)."""

    def route(
        w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows, ids, weights,
        weights_bf16, k, renorm, lanes,
    ):  # fmt: skip
        return dense_route(
            kernel, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows, ids,
            weights, weights_bf16, k, renorm, lanes,
        )  # fmt: skip

    route.__name__ = route.__qualname__ = f"dense_route_{kernel.name}"  # own cache files
    return cached_njit(nogil=True)(route)


DENSE = {name: _dense_entry(fmt.kernel, True) for name, fmt in WEIGHT_FORMATS.items()}
DENSE_SERIAL = {name: _dense_entry(fmt.kernel, False) for name, fmt in WEIGHT_FORMATS.items()}
# the float formats a router's gate is kept in (a router is never quantised)
DENSE_ROUTE = {name: _route_entry(WEIGHT_FORMATS[name].kernel) for name in ("f32", "bf16", "f16")}
_ROUTE_DTYPES = (torch.float32, torch.bfloat16)  # of a route's activations and weights
numba.config.CACHE_DIR = _previous_cache_dir  # every cached function above is decorated

_NO_BIAS = _NO_F32 = np.empty(0, np.float32)
_NO_BF16 = np.empty(0, np.uint16)


def item_rows(row_bytes: int) -> int:
    """Rows of a work item: whole groups of 4 rows, about ITEM_BYTES."""
    rows = -(-ITEM_BYTES // row_bytes)
    return max(4, (rows + 3) // 4 * 4)


def weight_bytes(stored: torch.Tensor) -> np.ndarray:
    """A host weight's stored tensor (contiguous) as the flat uint8 array the kernel reads,
    over the same memory."""
    if stored.device.type != "cpu" or not stored.is_contiguous():
        raise ValueError(
            f"dense kernel: a {tuple(stored.shape)} weight must be contiguous host memory"
        )
    return stored.view(torch.uint8).reshape(-1).numpy()


def dense_linear(
    fmt: WeightFormat,
    w_bytes: np.ndarray,
    out_features: int,
    x: torch.Tensor,
    bias_f32: np.ndarray | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Host x [..., n] (float32 or bfloat16) -> new [..., out_features] in x's dtype: x W^T + b
    by the contract above. W is `out_features` rows of n weights stored in `fmt` as the flat
    bytes `w_bytes` (weight_bytes); `bias_f32` float32 [out_features] or None. `threads` None:
    torch's intra-op thread count (the user's --threads; threads.kernel_threads), at most
    numba's pool; the calling thread alone for a weight under MIN_PARALLEL_BYTES. The result
    does not depend on the thread count. A caller with a weight to call again prepares its
    call once: DenseCall."""
    _check_dtype(x.dtype)
    return DenseCall(fmt, w_bytes, out_features, x.shape[-1], bias_f32, threads)(x)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype != torch.float32 and dtype != torch.bfloat16:
        raise TypeError(f"dense kernel: activations must be float32 or bfloat16, got {dtype}")


class DenseCall:
    """dense_linear for one weight, with what does not change between its calls worked out
    once (the size checks, row_bytes, the work items, the entry points, the bias): a decode
    step calls each projection once, and that setup took more host time than the numba call.
    A call is then a numpy view of x by address (kernels/host_arrays.py), one output, the
    kernel: 1 aten op (float32: from_numpy's lift_fresh of a numpy output; bf16: the output
    tensor's empty_like, the kernel writing it through a view by address)."""

    def __init__(
        self,
        fmt: WeightFormat,
        w_bytes: np.ndarray,
        out_features: int,
        in_features: int,
        bias_f32: np.ndarray | None = None,
        threads: int | None = None,
        q8_entries: tuple | None = None,
    ):
        row_bytes = fmt.row_bytes(in_features)
        if w_bytes.shape[0] != out_features * row_bytes:
            raise ValueError(
                f"dense kernel: {w_bytes.shape[0]} weight bytes, expected {out_features} rows of "
                f"{in_features} {fmt.name} weights ({out_features * row_bytes} bytes)"
            )
        self.fmt, self.out_features, self.in_features = fmt, out_features, in_features
        self._w, self._row_bytes, self._item_rows = w_bytes, row_bytes, item_rows(row_bytes)
        self._bias = _NO_BIAS if bias_f32 is None else bias_f32
        # q8_entries: numba_dense_q8's (serial, parallel) entries of the format, the same
        # arguments (its q8_call): each dot product by the q8 contract
        self.q8 = q8_entries is not None
        self._serial, self._parallel = q8_entries or (DENSE_SERIAL[fmt.name], DENSE[fmt.name])
        small = w_bytes.shape[0] < MIN_PARALLEL_BYTES
        self._threads = 1 if threads is None and small else threads  # None: per call

    # what a kernel calling _dense itself passes (kernels/numba_attention_block.py)
    @property
    def weight(self) -> np.ndarray:
        return self._w

    @property
    def bias(self) -> np.ndarray:
        return self._bias

    @property
    def row_bytes(self) -> int:
        return self._row_bytes

    @property
    def rows_per_item(self) -> int:
        return self._item_rows

    def threads(self, default: int) -> int:
        """The threads a call runs on where kernel_threads() would give `default`."""
        return default if self._threads is None else self._threads

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] float32 or bfloat16, host -> new [..., out_features]."""
        shape, n = x.shape, self.in_features
        if shape[-1] != n:
            raise ValueError(f"dense kernel: x {tuple(shape)} for a weight of {n} columns")
        out_shape = (*shape[:-1], self.out_features)
        if not x.is_contiguous():  # the kernel reads x as one dense row per token
            x = x.contiguous()
        if x.dtype == torch.bfloat16:  # converted and rounded inside the kernel
            x_bits = host_array(x, np.uint16)  # [T * n]
            out = glue.empty(out_shape, torch.bfloat16)
            self._run(x_bits.shape[0] // n, _NO_F32, x_bits, _NO_F32, host_array(out, np.uint16))
            return out
        _check_dtype(x.dtype)
        x32 = host_array(x, np.float32)  # [T * n]
        y = np.empty(out_shape, np.float32)
        self._run(x32.shape[0] // n, x32, _NO_BF16, y.reshape(-1), _NO_BF16)
        return torch.from_numpy(y)

    def routes(self, x: torch.Tensor, top_k: int, weights_dtype: torch.dtype) -> bool:
        """Whether dense_route takes this gate's step for x (route's conditions, less x's
        shape being [T, n]: a contiguous host tensor of float32 or bfloat16 of rows of n,
        weights of either dtype, a gate format with an entry, top_k in range, torch's
        softmax reproduced here: glue.softmax_lanes)."""
        if self.q8 or self.fmt.name not in DENSE_ROUTE or glue.softmax_lanes() is None:
            return False
        if not (x.is_contiguous() and x.dtype in _ROUTE_DTYPES and weights_dtype in _ROUTE_DTYPES):
            return False
        n = self.in_features
        return x.shape[-1] == n and 0 < top_k <= self.out_features and x.numel() > 0

    def route(
        self, x: torch.Tensor, top_k: int, renorm: bool, weights_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None:
        """A softmax router's step in one call, this weight its gate: routing.route(self(x),
        top_k, renorm, ...)'s (ids [T, k], weights [T, k] in weights_dtype), by the dense
        kernel's logits and numba_glue.softmax_topk_route of them; or the logits (self(x)'s
        bits) where that route leaves the row to torch (a tie, a logit not finite); None
        where it does not apply (x not a contiguous [T, n] host tensor of float32 or
        bfloat16, a weights dtype other, a gate format without the entry, torch's softmax
        not reproduced here: glue.softmax_lanes)."""
        lanes = glue.softmax_lanes()
        if not self.routes(x, top_k, weights_dtype) or x.dim() != 2:
            return None
        entry, (tokens, n) = DENSE_ROUTE[self.fmt.name], x.shape
        ids, weights = (
            glue.empty((tokens, top_k), torch.int64),
            glue.empty((tokens, top_k), weights_dtype),
        )
        bf16 = x.dtype == torch.bfloat16
        if bf16:
            x32, x_bits = _NO_F32, host_array(x, np.uint16)
            y, y_bits = _NO_F32, np.empty(tokens * self.out_features, np.uint16)
        else:
            x32, x_bits = host_array(x, np.float32), _NO_BF16
            y, y_bits = np.empty(tokens * self.out_features, np.float32), _NO_BF16
        routed = entry(
            self._w, self._row_bytes, n, self.out_features, x32, x_bits, tokens, self._bias,
            y, y_bits, self._item_rows, ids.data_ptr(), weights.data_ptr(),
            weights_dtype == torch.bfloat16, top_k, renorm, lanes,
        )  # fmt: skip
        if routed:
            return ids, weights
        return host_logits(y_bits if bf16 else y, tokens, self.out_features)

    def _run(self, tokens: int, x, x_bf16, y, y_bf16) -> None:
        if not tokens:
            return
        args = (self._w, self._row_bytes, self.in_features, self.out_features, x, x_bf16)
        args += (tokens, self._bias, y, y_bf16, self._item_rows)
        threads = self.threads(pool_threads())
        if threads == 1:
            self._serial(*args)
        else:  # the module's name, looked up per call (the counting benchmarks replace it)
            launch(self._parallel, threads, *args)


@numba.njit(cache=False)
def _reference(w, x, tokens, n, sets, out):
    """The summation order of dense_ir.py, lane by lane: w f32 [rows, n] (the exact weights),
    x f32 [tokens, n] -> out f32 [tokens, rows], before bias and rounding."""
    blocks = n // 32
    whole = blocks // sets * sets
    for t in range(tokens):
        for r in range(w.shape[0]):
            lanes = np.zeros((sets, 32), np.float32)
            for b in range(blocks):
                s = b % sets if b < whole else 0
                for j in range(32):
                    lanes[s, j] = fma32(w[r, 32 * b + j], x[t, 32 * b + j], lanes[s, j])
            total = lanes[0].copy()
            for s in range(1, sets):
                total += lanes[s]
            width = 32
            while width > 1:
                width //= 2
                total[:width] = total[:width] + total[width : 2 * width]
            acc = total[0]
            for j in range(blocks * 32, n):
                acc = fma32(w[r, j], x[t, j], acc)
            out[t, r] = acc


def dense_reference(
    fmt: WeightFormat, stored: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel's result restated in scalar code (slow; tests): x [..., n] -> [..., out] in
    x's dtype, from the stored weight's exact values, in dense_ir.py's summation order, then
    the bias in float32 and one rounding. Bit for bit what dense_linear returns."""
    n = x.shape[-1]
    w = fmt.dequantize(stored, torch.float32).reshape(-1, n).contiguous()  # [out, n]
    x_f32 = x.reshape(-1, n).to(torch.float32).contiguous()  # [T, n]
    out = np.empty((x_f32.shape[0], w.shape[0]), np.float32)
    _reference(w.numpy(), x_f32.numpy(), x_f32.shape[0], n, dense_ir.SETS, out)
    y = torch.from_numpy(out)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])
