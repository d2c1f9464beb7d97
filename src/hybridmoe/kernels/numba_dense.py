"""The CPU dense projection for decode steps: y = x W^T (+ b) for a few tokens, W in any
registered weight format, at memory bandwidth.

It is the fused MoE kernel's block machinery (numba_moe._matmul over numba_simd's LLVM tiles,
each format's own IR dequantiser) applied to one matrix: the rows are split into work items
of ROWS_PER_ITEM handed to numba's pool one at a time (numba_moe.launch: the same pool, launch
lock and passive wait policy as the expert kernel), and each weight row is read from memory
once and dotted with every token's activations (T <= ~16: a decode batch).

The accumulation contract: each dot product in float32 from the exact weights, the bias added
in float32, then one rounding to the activation dtype, which is what torch's F.linear computes
on the CPU in bfloat16 (its GEMM accumulates in float32 and adds the bias before the one
rounding) and in float32. The reference is kernels/torch_dense.py.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from hybridmoe import env
from hybridmoe.kernels.numba_cache import cached_njit
from hybridmoe.kernels.numba_moe import _matmul, _round_bf16, kernel_sources, launch
from hybridmoe.kernels.threads import kernel_threads
from hybridmoe.quant.formats import WEIGHT_FORMATS, KernelFormat, WeightFormat

ROWS_PER_ITEM = 32  # weight rows per parallel work item
# Weights smaller than this run on one thread: waking the pool's other threads costs more than
# they save (on a shared 2-core machine a launch on 2 threads took ms, on 1 thread ~30 µs)
MIN_PARALLEL_BYTES = 1 << 20
_FLAGS = dict(nogil=True, fastmath={"contract", "arcp"})

# cached under a hash of every source these kernels inline (see numba_moe.py)
_previous_cache_dir = numba.config.CACHE_DIR
numba.config.CACHE_DIR = str(env.kernel_cache_dir(__file__, *kernel_sources()))


@cached_njit(inline="always", **_FLAGS)
def _dense(fmt, w, row_bytes, n, nrows, x, tokens, bias, act_bf16, y):
    """y[t * nrows + r] = row r of w · x[t * n : (t + 1) * n] + bias[r] (no bias when `bias`
    is empty), rounded to bf16 when `act_bf16`; r < nrows, t < tokens. w uint8: nrows rows of
    row_bytes bytes, n weights each, in KernelFormat `fmt`; x f32 [tokens * n], bias f32
    [nrows] or [0], y f32 [tokens * nrows]."""
    x_offs = np.arange(tokens) * n  # [T] start of each token in x
    for item in prange((nrows + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM):
        r0 = item * ROWS_PER_ITEM
        rows = min(nrows, r0 + ROWS_PER_ITEM) - r0
        out = np.empty(tokens * rows, np.float32)  # [T, rows]
        _matmul(fmt, w, r0 * row_bytes, row_bytes, n, rows, x, x_offs, 0, tokens, out)
        if bias.shape[0]:
            for t in range(tokens):
                for r in range(rows):
                    out[t * rows + r] += bias[r0 + r]
        if act_bf16:
            _round_bf16(out, tokens * rows)
        for t in range(tokens):
            for r in range(rows):
                y[t * nrows + r0 + r] = out[t * rows + r]


def _dense_entry(kernel: KernelFormat):
    """The parallel entry point of _dense for one format (same arguments, less `fmt`)."""

    def dense(w, row_bytes, n, nrows, x, tokens, bias, act_bf16, y):
        _dense(kernel, w, row_bytes, n, nrows, x, tokens, bias, act_bf16, y)

    dense.__name__ = dense.__qualname__ = f"dense_{kernel.name}"  # own cache files
    return cached_njit(parallel=True, **_FLAGS)(dense)


DENSE = {name: _dense_entry(fmt.kernel) for name, fmt in WEIGHT_FORMATS.items()}
numba.config.CACHE_DIR = _previous_cache_dir  # every cached function above is decorated

_NO_BIAS = np.empty(0, np.float32)


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
    numba's pool; one thread
    for a weight under MIN_PARALLEL_BYTES. The result does not depend on the thread count."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"dense kernel: activations must be float32 or bfloat16, got {x.dtype}")
    n = x.shape[-1]
    row_bytes = fmt.row_bytes(n)
    if w_bytes.shape[0] != out_features * row_bytes:
        raise ValueError(
            f"dense kernel: {w_bytes.shape[0]} weight bytes, expected {out_features} rows of "
            f"{n} {fmt.name} weights ({out_features * row_bytes} bytes)"
        )
    x_f32 = x.reshape(-1, n).to(torch.float32).contiguous()  # [T, n]
    tokens = x_f32.shape[0]
    y = torch.empty(tokens, out_features, dtype=torch.float32)  # [T, out]
    bias = _NO_BIAS if bias_f32 is None else bias_f32
    act_bf16 = x.dtype == torch.bfloat16
    if tokens:
        if threads is None:
            small = w_bytes.shape[0] < MIN_PARALLEL_BYTES
            threads = 1 if small else min(kernel_threads(), numba.config.NUMBA_NUM_THREADS)
        args = (w_bytes, row_bytes, n, out_features, x_f32.view(-1).numpy(), tokens, bias)
        launch(DENSE[fmt.name], threads, *args, act_bf16, y.view(-1).numpy())
    return y.to(x.dtype).view(*x.shape[:-1], out_features)  # exact: already rounded
