"""Run as a script (tests/kernel_tests/test_activation_q8_paths.py does, under forced
NUMBA_CPU_FEATURES): compiles the q8 tile for a few shapes of q8_0 and q4_0 rows (q4_0's even
shapes by its pairs of rows, the odd one and the blocks after the last group of 8 by the 8-bit
path) and of the k-quants with integer super-blocks (q2_k ... q6_k: random bytes, finite
scales), compares each with the torch reference bit for bit, and prints the instruction path
and the result."""

from __future__ import annotations

import json

import numba
import numpy as np
import torch

from hybridmoe.kernels.numba_moe_q8 import group_sums, quantize_rows, quantize_rows_reference
from hybridmoe.kernels.numba_simd_q8 import WIDE_TOKENS, dot_path, tile_dot_q8
from hybridmoe.quant.activation_q8 import q8_linear
from hybridmoe.quant.formats import weight_format
from hybridmoe.quant.random_blocks import random_stored

INT8_BLOCKS = ("q8_0", "q4_0")
SUPER_BLOCKS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")


def _tiles(kernel):
    """((tile, wrows, xrows), ...) for `kernel` (a compile-time constant: closed over)."""

    @numba.njit
    def tile_4x2(w, row_bytes, nb, q, d, s, offs, out):
        tile_dot_q8(kernel, 4, 2, w, 0, row_bytes, nb, q, d, s, offs, 0, out, 0, 4)

    @numba.njit
    def tile_1x3(w, row_bytes, nb, q, d, s, offs, out):
        tile_dot_q8(kernel, 1, 3, w, 0, row_bytes, nb, q, d, s, offs, 0, out, 0, 1)

    @numba.njit
    def tile_4x1(w, row_bytes, nb, q, d, s, offs, out):  # a decode step's tile
        tile_dot_q8(kernel, 4, 1, w, 0, row_bytes, nb, q, d, s, offs, 0, out, 0, 4)

    @numba.njit
    def tile_2x4(w, row_bytes, nb, q, d, s, offs, out):  # one pair of rows, 4 activation rows
        tile_dot_q8(kernel, 2, 4, w, 0, row_bytes, nb, q, d, s, offs, 0, out, 0, 2)

    @numba.njit
    def tile_1x1(w, row_bytes, nb, q, d, s, offs, out):  # a k-quant decode step's tile
        tile_dot_q8(kernel, 1, 1, w, 0, row_bytes, nb, q, d, s, offs, 0, out, 0, 1)

    @numba.njit
    def tile_1x8(w, row_bytes, nb, q, d, s, offs, out):  # WIDE_TOKENS: a k-quant prefill's
        tile_dot_q8(kernel, 1, WIDE_TOKENS, w, 0, row_bytes, nb, q, d, s, offs, 0, out, 0, 1)

    tiles = ((tile_4x2, 4, 2), (tile_1x3, 1, 3), (tile_4x1, 4, 1), (tile_2x4, 2, 4))
    return tiles + ((tile_1x1, 1, 1), (tile_1x8, 1, WIDE_TOKENS))


def _check(fmt, tile, wrows: int, xrows: int, blocks: int) -> list[str]:
    gen = torch.Generator().manual_seed(blocks)
    width = fmt.kernel.block_weights  # 32, or a super-block's 256
    x = torch.randn(xrows, width * blocks, generator=gen)
    if fmt.name in SUPER_BLOCKS:
        stored = random_stored(fmt, (wrows, width * blocks), gen)
    else:
        stored = fmt.quantize(torch.randn(wrows, width * blocks, generator=gen))
    n = x.numel()
    q, d, s = np.empty(n, np.int8), np.empty(n // width, np.float32), np.empty(n // 16, np.int16)
    quantize_rows(x.reshape(-1).numpy(), n, q, d, width)
    group_sums(q, n, s)
    out = np.zeros(wrows * xrows, np.float32)
    offs = np.arange(xrows, dtype=np.int64) * width * blocks
    tile(stored.reshape(-1).numpy(), stored.shape[1], blocks, q, d, s, offs, out)
    expected = q8_linear(x, stored, fmt).reshape(-1).numpy()  # [c * wrows + r]
    return [] if np.array_equal(out, expected) else [f"{fmt.name} {wrows}x{xrows} nb={blocks}"]


def _quantiser_check(width: int) -> list[str]:
    """quantize_rows' vectors against quantize_rows_reference, bit for bit, on this path:
    random scales, a zero block, exact ties."""
    gen = torch.Generator().manual_seed(width)
    scales = torch.logspace(-20, 3, 24).repeat_interleave(width)
    ties = torch.randint(-254, 255, (width,), generator=gen) / 2.0
    ties[0] = 127.0
    x = torch.cat([torch.randn(24 * width, generator=gen) * scales, torch.zeros(width), ties])
    x = x.numpy().astype(np.float32)
    n = x.size
    got = np.empty(n, np.int8), np.empty(n // width, np.float32)
    want = np.empty(n, np.int8), np.empty(n // width, np.float32)
    quantize_rows(x, n, *got, width)
    quantize_rows_reference(x, n, *want, width)
    same = np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    return [] if same else [f"quantize_rows, {width}-blocks"]


def main() -> None:
    failures = _quantiser_check(32) + _quantiser_check(256)
    for name in INT8_BLOCKS + SUPER_BLOCKS:
        for tile, wrows, xrows in _tiles(weight_format(name).kernel):
            # super-blocks: a 1 x 1 tile's runs of 4 (numba_simd_q8.RUN) and every tail
            for blocks in (1, 8, 11, 19) if name in INT8_BLOCKS else (1, 2, 3, 4, 6, 8, 9, 11):
                failures += _check(weight_format(name), tile, wrows, xrows, blocks)
    print(json.dumps({"path": dot_path(), "failures": failures}))


if __name__ == "__main__":
    main()
