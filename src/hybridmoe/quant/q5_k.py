"""GGUF/ggml Q5_K: super-blocks of 256 weights in 176 bytes: fp16 d, fp16 dmin, Q4_K's 12 bytes
of eight 6-bit scales and minimums, 32 bytes qh (bit j of byte l: bit 4 of weight l of
sub-block j), then Q4_K's 128 bytes of low nibbles. Weight = (d * sc_j) * v - (dmin * m_j), one
rounding. No quantiser (see _kquants.py).
"""

from __future__ import annotations

import torch

from hybridmoe.quant._kquants import (
    PIECES,
    SuperBlockInts,
    fp16_at,
    register_k_quant,
    shifted,
    superblock_ints,
)
from hybridmoe.quant.q4_k import ints_ir, scale_min_ir, scale_min_k4, sub_block_scales

__all__ = ["BLOCK_BYTES", "Q5_K"]

BLOCK_BYTES = 176  # d, dmin, 12 bytes of scales, 32 of high bits, 128 of nibbles


def _values(blocks: torch.Tensor) -> torch.Tensor:
    """The 5-bit v [b, 8, 32] uint8 of blocks [b, 176]."""
    qh = blocks[:, 16:48].reshape(-1, 1, 32)  # [b, 1, 32]
    qs = blocks[:, 48:].reshape(-1, 4, 32)  # [b, 4, 32]
    v = shifted(qs, [0, 4], 0x0F).reshape(-1, PIECES, 32)  # [b, 8, 32]
    return v | (shifted(qh, list(range(8)), 1).reshape(-1, PIECES, 32) << 4)


def _dequantize_chunk(blocks: torch.Tensor) -> torch.Tensor:
    scale, low = sub_block_scales(blocks)  # [b, 8, 1] each
    return _values(blocks).to(torch.float32).mul_(scale).sub_(low).reshape(-1, 256)  # in place


def _superblock_ints(q: torch.Tensor) -> SuperBlockInts:
    blocks = q.reshape(-1, BLOCK_BYTES)
    sc, mins = scale_min_k4(blocks[:, 4:16])
    u = _values(blocks).reshape(-1, 256)
    return superblock_ints(q, u, sc, mins, fp16_at(blocks, 0), fp16_at(blocks, 2))


def _superblock_ints_ir(builder, block):
    from hybridmoe.kernels import llvm_ir as ll

    qh = ll.load(builder, ll.offset(builder, block, 16), ll.vector(ll.I8, 32))
    packed = {}

    def piece(p: int):  # nibble p % 2 of bytes 48 + 32 (p // 2) .., bit p of qh as bit 4
        if p // 2 not in packed:
            ptr = ll.offset(builder, block, 48 + 32 * (p // 2))
            packed[p // 2] = ll.load(builder, ptr, ll.vector(ll.I8, 32))
        low = ll.bits(builder, packed[p // 2], 4 * (p % 2), 0x0F)
        return builder.or_(low, ll.shl(builder, ll.bits(builder, qh, p, 1), 4))

    return ints_ir(builder, block, piece)


def _superblock_ir(builder, block):
    """LLVM IR: piece(p) -> <32 x float>, sub-block p's weights (d sc_p) v - dmin m_p: on
    targets with byte permutes (llvm_ir.byte_permutes) assembled 64 at a time in bytes
    (_byte_pieces), else piece by piece in 32 bytes (the same weights)."""
    from hybridmoe.kernels import llvm_ir as ll

    if ll.byte_permutes():
        return _byte_pieces(builder, block)
    scales = ll.ScaleTable(builder, scale_min_ir(builder, block))  # sc_p at p, m_p at 8 + p
    qh = ll.load(builder, ll.offset(builder, block, 16), ll.vector(ll.I8, 32))
    packed = {}

    def piece(p: int):
        group = p // 2
        if group not in packed:
            ptr = ll.offset(builder, block, 48 + 32 * group)
            packed[group] = ll.load(builder, ptr, ll.vector(ll.I8, 32))
        low = ll.bits(builder, packed[group], 4 * (p % 2), 0x0F)
        v = builder.or_(low, ll.shl(builder, ll.bits(builder, qh, p, 1), 4))
        return ll.scaled_halves(builder, v, scales, (p, p), (8 + p, 8 + p))

    return piece


def _byte_pieces(builder, block):
    """piece(p) of _superblock_ir on byte-permute targets: the 5-bit v of pieces 4k + {0, 2}
    (even: low nibbles) or 4k + {1, 3} (odd: high nibbles) in one <64 x i8>, the qs bytes of
    groups 2k and 2k + 1 (64 bytes) with their qh bits moved to bit 4 (GFNI, per 32-byte half);
    each 16 of them then spread to 32-bit lanes (one byte permute) and converted, and the
    weight one FMA, (d sc_p) v - dmin m_p, exactly fmul then fsub (the product is exact)."""
    from hybridmoe.kernels import llvm_ir as ll

    scales = ll.ScaleTable(builder, scale_min_ir(builder, block, negated=True))  # -m_p: 8 + p
    qh = ll.load(builder, ll.offset(builder, block, 16), ll.vector(ll.I8, 32))
    qh2 = ll.lanes(builder, qh, [*range(32), *range(32)])  # [qh, qh]
    values = {}

    def pair(k: int, odd: int):  # <64 x i8>: v of pieces 4k + odd (bytes 0..31), 4k + 2 + odd
        if (k, odd) not in values:
            qs = ll.load(builder, ll.offset(builder, block, 48 + 64 * k), ll.V64B)
            if odd:
                qs = ll.gf2_affine(builder, qs, {0: 4, 1: 5, 2: 6, 3: 7})
            else:
                qs = builder.and_(qs, ll.const_vec(ll.I8, [0x0F] * 64))
            bit = [{4: 4 * k + odd}] * 4 + [{4: 4 * k + 2 + odd}] * 4
            values[k, odd] = builder.or_(qs, ll.gf2_affine(builder, qh2, bit))
        return values[k, odd]

    def piece(p: int):
        k, j = divmod(p, 4)
        v = pair(k, j % 2)
        halves = []
        for h in range(2):
            w = builder.sitofp(ll.dword_bytes(builder, v, 32 * (j // 2) + 16 * h), ll.V16F)
            halves.append(ll.exact_fma(builder, w, scales.splat(p), scales.splat(8 + p)))
        return ll.halves(builder, *halves)

    return piece


# One token's tiles stay 1 row wide on short rows too: 4 rows measured 0.978 / 0.998x the time
# (as q4_k's note)
Q5_K = register_k_quant(
    "q5_k",
    BLOCK_BYTES,
    _dequantize_chunk,
    _superblock_ir,
    (0, 2),
    (_superblock_ints, _superblock_ints_ir),
)
