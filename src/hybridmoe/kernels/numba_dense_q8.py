"""The CPU dense projection with q8 activations (quant/activation_q8.py): numba_dense.py's decode
kernel for weights whose formats have integer dot products (int8 blocks: q8_0, q4_0; integer
super-blocks: q2_k ... q6_k) under `activation_quant q8`, as llama.cpp computes its quantised
matmuls. Each token's x is quantised once per call (the format's 32- or 256-weight blocks, the
contract's step 1), then each work item of rows is numba_moe_q8's integer-dot tiles, written
straight into the output; the bias and the rounding to bfloat16 are numba_dense's
(`_finish`). The result is `activation_q8.q8_linear`'s (then + bias, one rounding), bit for bit,
whatever the thread count.

Imported only when a projection computes with q8 activations; entries made on first use per
format, cached on disk as numba_dense's.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange
from numba.core.dispatcher import Dispatcher

from hybridmoe import env
from hybridmoe.kernels import dense_ir, numba_dense, numba_glue, numba_moe_q8
from hybridmoe.kernels.numba_cache import EntryCache, cached_njit
from hybridmoe.kernels.numba_moe import chunk_size, set_chunk_size
from hybridmoe.kernels.numba_moe_q8 import _quantized, _tile
from hybridmoe.quant.formats import WEIGHT_FORMATS, WeightFormat

_FLAGS = numba_dense._FLAGS

_previous_cache_dir = numba.config.CACHE_DIR
numba.config.CACHE_DIR = str(
    env.kernel_cache_dir(
        __file__,
        numba_dense.__file__,
        dense_ir.__file__,
        numba_glue.__file__,
        *numba_moe_q8.kernel_sources(),
    )
)


@cached_njit(inline="always", **_FLAGS)
def _rows_q8(fmt, w, w_off, row_bytes, blocks, nrows, xq, xd, xs, x_offs, tokens, y, y_off, stride):
    """y[y_off + t * stride + r] = the q8 contract's dot of weight row r (at byte w_off + r *
    row_bytes) with token t's quantised row, r < nrows, t < tokens: numba_moe_q8.matmul_q8's
    tiles with the output's own stride."""
    widest = 4 if tokens <= 2 else 2
    r = 0
    while r < nrows:
        wrows = widest if nrows - r >= widest else (2 if nrows - r >= 2 else 1)
        t = 0
        while t < tokens:
            xrows = min(4, tokens - t)
            off = w_off + r * row_bytes
            _tile(
                fmt, wrows, xrows, w, off, row_bytes, blocks, xq, xd, xs, x_offs, t, y,
                y_off + t * stride + r, stride,
            )  # fmt: skip
            t += xrows
        r += wrows


@cached_njit(inline="always", **_FLAGS)
def _dense_q8(fmt, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows):
    """numba_dense._dense's contract (the same arguments), each dot product by the q8
    contract instead of float32 sums of the dequantised weights."""
    x, y = numba_dense.float32_io(x, x_bf16, y, tokens * n, tokens * nrows)
    xq, xd, xs = _quantized(fmt, x, tokens * n)  # every token's row, its own blocks
    x_offs = np.arange(tokens) * n
    blocks = n // fmt.block_weights
    items = (nrows + item_rows - 1) // item_rows
    previous = set_chunk_size(chunk_size(items))
    for item in prange(items):
        r0 = item * item_rows
        rows = min(nrows, r0 + item_rows) - r0
        _rows_q8(
            fmt, w, r0 * row_bytes, row_bytes, blocks, rows, xq, xd, xs, x_offs, tokens, y, r0,
            nrows,
        )  # fmt: skip
        numba_dense._finish(fmt, w, row_bytes, n, nrows, r0, rows, x, tokens, bias, y, y_bf16)
    set_chunk_size(previous)


# _dense_q8 compiled once per format, parallel and serial (as numba_dense's), for the entries
# below and the attention block's calls (kernels/numba_attention_block.py)
@cached_njit(parallel=True, **_FLAGS)
def dense_q8_parallel(fmt, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows):
    _dense_q8(fmt, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows)


@cached_njit(**_FLAGS)
def dense_q8_serial(fmt, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows):
    _dense_q8(fmt, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows)


def _entry(kernel, parallel: bool):
    """An entry point of _dense_q8 for one format (numba_dense's arguments, less `fmt`)."""

    def dense_q8(w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows):
        if parallel:  # a constant: numba compiles one branch
            dense_q8_parallel(
                kernel, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows
            )
        else:
            dense_q8_serial(
                kernel, w, row_bytes, n, nrows, x, x_bf16, tokens, bias, y, y_bf16, item_rows
            )

    kind = "" if parallel else "serial_"
    dense_q8.__name__ = dense_q8.__qualname__ = f"dense_q8_{kind}{kernel.name}"  # own cache
    return cached_njit(**_FLAGS)(dense_q8)


_ENTRIES = EntryCache(numba.config.CACHE_DIR)


def q8_call(
    fmt: WeightFormat,
    w_bytes: np.ndarray,
    out_features: int,
    in_features: int,
    bias_f32: np.ndarray | None = None,
    threads: int | None = None,
) -> numba_dense.DenseCall:
    """numba_dense.DenseCall's call of this weight with q8 activations (its checks, work items
    and bias; this module's entries); ValueError for a format without integer dot products."""
    entries = tuple(dense_q8_kernel(fmt.name, parallel) for parallel in (False, True))
    return numba_dense.DenseCall(
        fmt, w_bytes, out_features, in_features, bias_f32, threads, q8_entries=entries
    )


def dense_linear_q8(
    fmt: WeightFormat,
    w_bytes: np.ndarray,
    out_features: int,
    x: torch.Tensor,
    bias_f32: np.ndarray | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """numba_dense.dense_linear (the same arguments and result shape) with q8 activations."""
    numba_dense._check_dtype(x.dtype)
    return q8_call(fmt, w_bytes, out_features, x.shape[-1], bias_f32, threads)(x)


def dense_q8_kernel(fmt_name: str, parallel: bool) -> Dispatcher:
    """The entry point for a format with integer dot products, made on first use; ValueError
    for another."""
    kernel = WEIGHT_FORMATS[fmt_name].kernel
    if kernel.int8_block_ir is None and kernel.superblock_ints_ir is None:
        raise ValueError(f"q8 activations need an integer-dot format, got {fmt_name}")
    return _ENTRIES.get((fmt_name, parallel), lambda: _entry(kernel, parallel))


numba.config.CACHE_DIR = _previous_cache_dir  # every cached function above is decorated
