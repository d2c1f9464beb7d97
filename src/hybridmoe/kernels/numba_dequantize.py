"""Stored weight rows expanded to float32 on the host by the CPU kernels' own block
dequantisers (`KernelFormat.dequantize_block_ir`, the IR the fused kernels multiply from), in
parallel: `fmt.dequantize`'s values at memory speed.

A prefill's routed experts with many routes per expert (moe/cpu_experts.uses_fused_kernel) are
computed by dequantise-then-GEMM (moe/cpu_experts.bank_moe), and torch's dequantisers, a dozen
ops a block, took 3-5x the GEMM's time there (measured: a Q4_K expert's gate_up [1536, 2048]
in 6.2 ms, its float32 GEMM for 24 tokens in 1.5 ms). The IR gives the reference's values:
each format's builder computes a weight with the reference's roundings (its module's docstring
says how), which tests/kernel_tests/test_numba_dequantize.py checks bit for bit for every format.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from hybridmoe import env
from hybridmoe.kernels import numba_moe
from hybridmoe.kernels.host_arrays import host_array
from hybridmoe.kernels.llvm_ir import V32F, i64
from hybridmoe.kernels.numba_cache import cached_njit
from hybridmoe.kernels.numba_simd import KernelFormatType
from hybridmoe.kernels.threads import kernel_threads
from hybridmoe.quant.formats import KERNEL_BLOCK, WeightFormat

ROWS_PER_ITEM = 16  # rows a parallel work item expands
MIN_WEIGHTS = 1 << 16  # smaller tensors stay with torch (a launch costs more than they do)

_previous_cache_dir = numba.config.CACHE_DIR
numba.config.CACHE_DIR = str(env.kernel_cache_dir(__file__, *numba_moe.kernel_sources()))


@intrinsic
def dequantize_blocks(typingctx, fmt, weights, w_off, nblocks, out, out_off):
    """out[out_off : out_off + nblocks * block_weights] (float32) = the weights of `nblocks`
    consecutive blocks of `fmt` (a KernelFormat) starting at byte `w_off` of `weights`."""
    if not isinstance(fmt, KernelFormatType):
        return None
    kernel = fmt.kernel

    def codegen(context, builder, sig, args):
        _, w, w_at, count, dst, dst_at = args
        w_data = context.make_array(sig.args[1])(context, builder, w).data
        out_data = context.make_array(sig.args[4])(context, builder, dst).data
        with cgutils.for_range(builder, count) as loop:
            at = builder.add(w_at, builder.mul(loop.index, i64(kernel.block_bytes)))
            block = builder.gep(w_data, [at])
            first = builder.add(dst_at, builder.mul(loop.index, i64(kernel.block_weights)))
            if kernel.pieces > 1:
                piece = kernel.dequantize_block_ir(builder, block)
                values = [piece(p) for p in range(kernel.pieces)]
            else:
                values = [kernel.dequantize_block_ir(builder, block)]
            for p, value in enumerate(values):
                slot = builder.gep(out_data, [builder.add(first, i64(p * KERNEL_BLOCK))])
                builder.store(value, builder.bitcast(slot, V32F.as_pointer()), align=4)
        return context.get_dummy_value()

    sig = types.void(fmt, weights, types.intp, types.intp, out, types.intp)
    return sig, codegen


def _entry(kernel):
    """The parallel expansion of rows of `kernel`'s format (a closure over its descriptor,
    as numba_moe._fused_moe_entry makes them)."""

    def dequantize_rows(w, row_bytes, nrows, nblocks, out):
        row_weights = nblocks * kernel.block_weights
        for item in prange((nrows + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM):
            for r in range(item * ROWS_PER_ITEM, min(nrows, (item + 1) * ROWS_PER_ITEM)):
                dequantize_blocks(kernel, w, r * row_bytes, nblocks, out, r * row_weights)

    dequantize_rows.__name__ = dequantize_rows.__qualname__ = f"dequantize_rows_{kernel.name}"
    return cached_njit(parallel=True, nogil=True)(dequantize_rows)


_ENTRIES: dict[str, numba.core.dispatcher.Dispatcher] = {}
_CACHE_DIR = numba.config.CACHE_DIR  # the hashed directory: entries are made on first use


def _entry_for(fmt: WeightFormat):
    entry = _ENTRIES.get(fmt.name)
    if entry is None:
        previous, numba.config.CACHE_DIR = numba.config.CACHE_DIR, _CACHE_DIR
        try:  # numba picks the cache directory when a function is decorated
            entry = _ENTRIES[fmt.name] = _entry(fmt.kernel)
        finally:
            numba.config.CACHE_DIR = previous
    return entry


def dequantize_host(
    fmt: WeightFormat, stored: torch.Tensor, threads: int | None = None
) -> torch.Tensor | None:
    """fmt.dequantize(stored, torch.float32)'s values for stored rows [..., row_bytes] of a
    quantised format in contiguous host memory, by the kernels' IR on `threads` threads (None:
    torch's intra-op count, the user's --threads); None (computing nothing) for a dense
    format, device memory, a non-contiguous tensor or one of under MIN_WEIGHTS weights."""
    if not fmt.is_quantized or not stored.is_cpu or not stored.is_contiguous():
        return None
    row_bytes = stored.shape[-1] * stored.element_size()
    if not row_bytes or row_bytes % fmt.kernel.block_bytes:
        return None
    nblocks = row_bytes // fmt.kernel.block_bytes
    n = nblocks * fmt.kernel.block_weights
    nrows = stored.numel() * stored.element_size() // row_bytes
    if nrows * n < MIN_WEIGHTS:
        return None
    out = np.empty(nrows * n, np.float32)
    w = host_array(stored, np.uint8)
    threads = min(threads or kernel_threads(), numba_moe.max_threads())
    numba_moe.launch(_entry_for(fmt), threads, w, row_bytes, nrows, nblocks, out)
    return torch.from_numpy(out).view(*stored.shape[:-1], n)


def float32_weights(fmt: WeightFormat, stored: torch.Tensor) -> torch.Tensor:
    """fmt.dequantize(stored, torch.float32): by dequantize_host where it takes the tensor,
    else by the format's torch dequantiser (the same values either way)."""
    fast = dequantize_host(fmt, stored)
    return fmt.dequantize(stored, torch.float32) if fast is None else fast


numba.config.CACHE_DIR = _previous_cache_dir  # every cached function above is decorated
