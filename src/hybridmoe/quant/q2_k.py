"""GGUF/ggml Q2_K: super-blocks of 256 weights in 84 bytes: 16 bytes of 4-bit scale / minimum
pairs (low nibble sc, high nibble m; one per sub-block of 16 weights), 64 bytes of 2-bit
values, fp16 d, fp16 dmin. Half h of 128 weights reads qs[32 h:][:32]; its piece j takes bits
2 j, 2 j + 1 of each byte. Weight = (d * sc) * v - (dmin * m), one rounding; as integers
(SuperBlockInts, the q8 contract's view) u = v, sc and m per 16 weights, offset 0. No quantiser
(see _kquants.py).
"""

from __future__ import annotations

import torch

from hybridmoe.quant._kquants import (
    SuperBlockInts,
    fp16_at,
    register_k_quant,
    shifted,
    sixteen_weight_pair_scales,
    superblock_ints,
)

__all__ = ["BLOCK_BYTES", "Q2_K"]

BLOCK_BYTES = 84  # 16 bytes of scales, 64 of 2-bit values, fp16 d, fp16 dmin


def _values(blocks: torch.Tensor) -> torch.Tensor:
    """The 2-bit v [b, 16, 16] uint8 of blocks [b, 84], by sub-block."""
    v = shifted(blocks[:, 16:80].reshape(-1, 2, 32), [0, 2, 4, 6], 3)  # [b, 2, 4, 32]
    return v.reshape(-1, 16, 16)


def _dequantize_chunk(blocks: torch.Tensor) -> torch.Tensor:
    packed = blocks[:, :16]  # [b, 16]
    scale = fp16_at(blocks, 80) * (packed & 0x0F).to(torch.float32)[:, :, None]  # [b, 16, 1]
    low = fp16_at(blocks, 82) * (packed >> 4).to(torch.float32)[:, :, None]  # [b, 16, 1]
    v = _values(blocks).to(torch.float32)  # [b, 16, 16]; in place below: few temporaries
    return v.mul_(scale).sub_(low).reshape(-1, 256)


def _superblock_ints(q: torch.Tensor) -> SuperBlockInts:
    blocks = q.reshape(-1, BLOCK_BYTES)
    packed = blocks[:, :16]
    u = _values(blocks).reshape(-1, 256)
    return superblock_ints(
        q, u, packed & 0x0F, packed >> 4, fp16_at(blocks, 80), fp16_at(blocks, 82)
    )


def _superblock_ints_ir(builder, block):
    """LLVM IR: the SuperBlockIntsIR of a Q2_K super-block: pair scales sc_s, lows m_s."""
    from hybridmoe.kernels import llvm_ir as ll
    from hybridmoe.quant._kquants import SuperBlockIntsIR

    packed = ll.load(builder, block, ll.vector(ll.I8, 16))
    i16 = ll.vector(ll.I16, 16)
    scales, mins = (builder.zext(ll.bits(builder, packed, at, 0x0F), i16) for at in (0, 4))
    return SuperBlockIntsIR(
        piece=_values_ir(builder, block),
        pair_scales=sixteen_weight_pair_scales(builder, scales),
        lows=mins,
        d=ll.fp16_scale(builder, ll.offset(builder, block, 80)),
        dmin=ll.fp16_scale(builder, ll.offset(builder, block, 82)),
    )


def _scale_table(builder, block, negated: bool = False):
    """LLVM IR: the ScaleTable of d sc_s at s and dmin m_s (or, `negated`, -(dmin m_s), the
    same product's negation, exact) at 16 + s."""
    from hybridmoe.kernels import llvm_ir as ll

    packed = ll.load(builder, block, ll.vector(ll.I8, 16))
    v16f = ll.vector(ll.F32, 16)
    d, dmin = (ll.fp16_scale(builder, ll.offset(builder, block, at)) for at in (80, 82))
    d, dmin = (
        ll.splat(builder, d, 16),
        ll.splat(builder, builder.fneg(dmin) if negated else dmin, 16),
    )
    scales = builder.fmul(d, builder.uitofp(ll.bits(builder, packed, 0, 0x0F), v16f))
    lows = builder.fmul(dmin, builder.uitofp(ll.bits(builder, packed, 4, 0x0F), v16f))
    return ll.ScaleTable(builder, ll.halves(builder, scales, lows))


def _superblock_ir(builder, block):
    """LLVM IR: piece(p) -> <32 x float>, the weights (d sc) v - dmin m of piece p: on targets
    with byte permutes (llvm_ir.byte_permutes) assembled 64 at a time in bytes (_byte_pieces),
    else in 32 bytes a piece (the same weights)."""
    from hybridmoe.kernels import llvm_ir as ll

    if ll.byte_permutes():
        return _byte_pieces(builder, block)
    table = _scale_table(builder, block)  # sc at s, m at 16 + s
    values = _values_ir(builder, block)

    def piece(p: int):
        v = values(p)
        return ll.scaled_halves(builder, v, table, (2 * p, 2 * p + 1), (16 + 2 * p, 17 + 2 * p))

    return piece


def _values_ir(builder, block):
    """LLVM IR: values(p) -> <32 x i8>, the 2-bit v (0 .. 3) of piece p = 4 h + j: bits 2 j,
    2 j + 1 of half h's 32 bytes."""
    from hybridmoe.kernels import llvm_ir as ll

    halves = [
        ll.load(builder, ll.offset(builder, block, 16 + 32 * h), ll.vector(ll.I8, 32))
        for h in range(2)
    ]

    def values(p: int):
        half, j = divmod(p, 4)
        return ll.bits(builder, halves[half], 2 * j, 3)

    return values


def _byte_pieces(builder, block):
    """piece(p) of _superblock_ir on byte-permute targets: v of pieces 4 h + 2 k (bytes 0..31)
    and 4 h + 2 k + 1 (bytes 32..63) in one <64 x i8>, half h's 32 qs bytes twice with each
    piece's 2 bits moved to bits 0, 1 (GFNI); each 16 then spread to 32-bit lanes (one byte
    permute) and converted, the weight one FMA, (d sc) v - dmin m, exactly fmul then fsub (the
    product is exact)."""
    from hybridmoe.kernels import llvm_ir as ll

    table = _scale_table(builder, block, negated=True)  # sc at s, -m at 16 + s
    values = {}

    def pair(half: int, k: int):
        if (half, k) not in values:
            qs = ll.load(builder, ll.offset(builder, block, 16 + 32 * half), ll.vector(ll.I8, 32))
            qs = ll.lanes(builder, qs, [*range(32), *range(32)])  # [qs, qs]
            moves = [{0: 2 * j, 1: 2 * j + 1} for j in (2 * k, 2 * k + 1) for _ in range(4)]
            values[half, k] = ll.gf2_affine(builder, qs, moves)
        return values[half, k]

    def piece(p: int):
        half, j = divmod(p, 4)
        v, out = pair(half, j // 2), []
        for h in range(2):
            w = builder.sitofp(ll.dword_bytes(builder, v, 32 * (j % 2) + 16 * h), ll.V16F)
            s = 2 * p + h
            out.append(ll.exact_fma(builder, w, table.splat(s), table.splat(16 + s)))
        return ll.halves(builder, *out)

    return piece


# One token's tiles on short rows 4 rows wide (as q4_k's): 0.908 / 0.872x the time
Q2_K = register_k_quant(
    "q2_k",
    BLOCK_BYTES,
    _dequantize_chunk,
    _superblock_ir,
    (80, 82),
    (_superblock_ints, _superblock_ints_ir),
    short_row_rows=4,
)
