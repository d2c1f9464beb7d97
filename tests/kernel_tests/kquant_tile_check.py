"""Run as a script (tests/kernel_tests/test_kquant_paths.py does, under forced NUMBA_CPU_FEATURES):
compiles tile_dot of the k-quants and of the 32-weight block formats (q4_0 ... q8_0, mxfp4) for
several tile shapes and row lengths on random block bytes (finite scales), and the same IR's
expansion of rows to float32 (kernels/numba_dequantize.py), saves every output
to the .npz file named by argv[1] and prints as JSON whether the target had AVX-512 (table
lookups: q4_k, q4_0, q4_1, q5_0, q5_1, mxfp4) and byte permutes (VBMI and GFNI: the byte-level
paths of q5_k and q6_k, llvm_ir.byte_permutes)."""

from __future__ import annotations

import json
import sys

import numba
import numpy as np
import torch

from hybridmoe.kernels.llvm_ir import byte_permutes, target_has
from hybridmoe.kernels.numba_dequantize import dequantize_host
from hybridmoe.kernels.numba_simd import tile_dot
from hybridmoe.quant.formats import weight_format
from random_weights import random_stored

FORMATS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4", "q8_0")
SHAPES = ((4, 1), (1, 1), (2, 3))  # (weight rows, activation rows)
SUPER_BLOCKS = (1, 3)  # per row


def _tile(kernel, wrows: int, xrows: int):
    """A jitted tile_dot(kernel, wrows, xrows, ...) (compile-time constants: closed over)."""

    def tile(w, row_bytes, nblocks, x, offs, out):
        tile_dot(kernel, wrows, xrows, w, 0, row_bytes, nblocks, x, offs, 0, out, 0, wrows)

    tile.__name__ = f"tile_{kernel.name}_{wrows}x{xrows}"
    return numba.njit(tile)


def case(name: str, wrows: int, xrows: int, supers: int):
    """(stored bytes [wrows, row_bytes] uint8, x [xrows, n] f32, x_offs) of one case."""
    gen = torch.Generator().manual_seed(1000 * wrows + 100 * xrows + supers)
    n = 256 * supers
    stored = random_stored(weight_format(name), (wrows, n), gen)
    x = torch.randn(xrows, n, generator=gen)
    # activation rows in scrambled order at scattered offsets, as routes are
    offs = (np.arange(xrows, dtype=np.int64)[::-1] * n).copy()
    return stored, x, offs


def dequantize_case(name: str) -> torch.Tensor:
    """Stored rows [64, 2048 weights] of one format for dequantize_host (above MIN_WEIGHTS)."""
    return random_stored(weight_format(name), (64, 2048), torch.Generator().manual_seed(9))


def run(name: str) -> dict[str, np.ndarray]:
    kernel = weight_format(name).kernel
    expanded = dequantize_host(weight_format(name), dequantize_case(name))
    results = {f"{name} dequantize": expanded.view(torch.int32).numpy()}  # the bits
    for wrows, xrows in SHAPES:
        tile = _tile(kernel, wrows, xrows)
        for supers in SUPER_BLOCKS:
            stored, x, offs = case(name, wrows, xrows, supers)
            out = np.full(wrows * xrows, np.nan, np.float32)
            flat_x = x.flip(0).reshape(-1).numpy()  # row c at offs[c]
            tile(stored.reshape(-1).numpy(), stored.shape[1], 8 * supers, flat_x, offs, out)
            results[f"{name} {wrows}x{xrows} {supers}"] = out  # [c * wrows + r]
    return results


def main() -> None:
    results = {}
    for name in FORMATS:
        results.update(run(name))
    np.savez(sys.argv[1], **results)
    paths = {"avx512": target_has("avx512f"), "byte_permutes": byte_permutes()}
    print(json.dumps({**paths, "cases": len(results)}))


if __name__ == "__main__":
    main()
