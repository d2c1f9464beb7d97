"""GGUF/ggml Q4_K: super-blocks of 256 weights in 144 bytes: fp16 d, fp16 dmin, 12 bytes of
eight 6-bit scales sc and minimums m (ggml's get_scale_min_k4 packing), then 128 bytes of
nibbles: bytes 32 g .. 32 g + 31 hold sub-block 2 g in their low nibbles and 2 g + 1 in their
high ones. Weight l of sub-block j = (d * sc_j) * v - (dmin * m_j): both products exact in
fp32, one rounding. No quantiser (see _kquants.py).
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

__all__ = ["BLOCK_BYTES", "Q4_K", "scale_min_k4"]

BLOCK_BYTES = 144  # d, dmin, 12 bytes of scales, 128 of nibbles


def scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes [b, 12] uint8 -> (sc [b, 8], m [b, 8]) uint8 in [0, 63]: sub-blocks
    0..3 in the low 6 bits of bytes 0..3 (sc) and 4..7 (m); 4..7 in the nibbles of bytes 8..11
    with their top 2 bits in the top bits of bytes 0..3 (sc) and 4..7 (m)."""
    d, m, both = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([d & 0x3F, (both & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (both >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mins


def sub_block_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K and Q5_K: (d * sc, dmin * m) fp32 [b, 8, 1] of blocks [b, block_bytes]."""
    sc, mins = scale_min_k4(blocks[:, 4:16])
    scale = fp16_at(blocks, 0) * sc.to(torch.float32)[:, :, None]
    low = fp16_at(blocks, 2) * mins.to(torch.float32)[:, :, None]
    return scale, low


def _dequantize_chunk(blocks: torch.Tensor) -> torch.Tensor:
    scale, low = sub_block_scales(blocks)  # [b, 8, 1] each
    qs = blocks[:, 16:].reshape(-1, 4, 32)  # [b, 4, 32]
    v = shifted(qs, [0, 4], 0x0F).reshape(-1, PIECES, 32).to(torch.float32)  # [b, 8, 32]
    return v.mul_(scale).sub_(low).reshape(-1, 256)  # in place: few temporaries


def scale_min_ints_ir(builder, block):
    """LLVM IR: <16 x i32> [sc_0 .. sc_7, m_0 .. m_7] of a Q4_K/Q5_K super-block at byte
    pointer `block` (scale_min_k4's unpacking in 32-bit lanes: one widening load, two
    constant lane shuffles, shifts and masks)."""
    from hybridmoe.kernels import llvm_ir as ll

    wide = ll.widened_bytes(builder, ll.offset(builder, block, 4))  # lane i: scale byte i
    six = [63] * 4
    low = ll.lanes(builder, wide, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11])
    low = ll.bits(builder, low, [0] * 12 + [4] * 4, six + [15] * 4 + six + [15] * 4)
    top = ll.lanes(builder, wide, [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7])
    top = ll.bits(builder, top, 2, [0] * 4 + [0x30] * 4 + [0] * 4 + [0x30] * 4)
    return builder.or_(low, top)


def scale_min_ir(builder, block, negated: bool = False):
    """LLVM IR: <16 x float> [d * sc_0 .. d * sc_7, dmin * m_0 .. dmin * m_7] of a Q4_K/Q5_K
    super-block at byte pointer `block` (scale_min_ints_ir's integers); the minimums negated,
    -(dmin * m_j), when `negated` (exact: the product's sign flips, not its rounding)."""
    from hybridmoe.kernels import llvm_ir as ll

    values = builder.uitofp(scale_min_ints_ir(builder, block), ll.V16F)
    d_dmin = builder.fpext(ll.load(builder, block, ll.vector(ll.HALF, 2)), ll.vector(ll.F32, 2))
    scales = builder.fmul(values, ll.lanes(builder, d_dmin, [0] * 8 + [1] * 8))
    if not negated:
        return scales
    return builder.fmul(scales, ll.ir.Constant(ll.V16F, [1.0] * 8 + [-1.0] * 8))


def _superblock_ir(builder, block):
    """LLVM IR: piece(p) -> <32 x float>, sub-block p's weights (d sc_p) v - dmin m_p: each
    16-byte half of a 32-byte group widened once to <16 x i32> (its low nibbles are piece 2g,
    its high ones piece 2g + 1), the scales broadcast from the stack."""
    from hybridmoe.kernels import llvm_ir as ll

    lut = ll.target_has("avx512f")
    # sc_p at p, m_p (the lookup's: -m_p) at 8 + p
    scales = ll.ScaleTable(builder, scale_min_ir(builder, block, negated=lut))
    wide = {}
    iota = ll.ir.Constant(ll.V16F, [float(i) for i in range(16)])

    def half(p: int, h: int, table):
        group = p // 2
        if (group, h) not in wide:
            wide[group, h] = ll.widened_bytes(
                builder, ll.offset(builder, block, 16 + 32 * group + 16 * h)
            )
        if lut:
            v = wide[group, h]
            if p % 2:
                v = builder.lshr(v, ll.const_vec(ll.I32, [4] * 16))
            return ll.lookup16(builder, table, v)
        v = ll.bits(builder, wide[group, h], 4 * (p % 2), 0x0F)
        low = builder.fneg(scales.splat(8 + p))  # the product exact: fmul then fsub's bits
        return ll.exact_fma(builder, builder.uitofp(v, ll.V16F), scales.splat(p), low)

    def piece(p):
        # (d sc_p) v - dmin m_p for v < 16: the product exact, so one FMA rounds as fsub
        table = ll.exact_fma(builder, iota, scales.splat(p), scales.splat(8 + p)) if lut else None
        return ll.halves(builder, half(p, 0, table), half(p, 1, table))

    return piece


def _superblock_ints(q: torch.Tensor) -> SuperBlockInts:
    blocks = q.reshape(-1, BLOCK_BYTES)
    sc, mins = scale_min_k4(blocks[:, 4:16])
    u = shifted(blocks[:, 16:].reshape(-1, 4, 32), [0, 4], 0x0F)  # [b, 4, 2, 32]: pieces
    return superblock_ints(q, u.reshape(-1, 256), sc, mins, fp16_at(blocks, 0), fp16_at(blocks, 2))


def ints_ir(builder, block, piece):
    """LLVM IR: the SuperBlockIntsIR of a Q4_K/Q5_K super-block whose piece(p) gives u."""
    from hybridmoe.kernels import llvm_ir as ll
    from hybridmoe.quant._kquants import SuperBlockIntsIR

    both = builder.trunc(scale_min_ints_ir(builder, block), ll.vector(ll.I16, 16))
    return SuperBlockIntsIR(
        piece=piece,
        pair_scales=lambda p: ll.lanes(builder, both, [p] * 16),
        lows=ll.lanes(builder, both, [8 + k // 2 for k in range(16)]),  # m_j, each 16 twice
        d=ll.fp16_scale(builder, block),
        dmin=ll.fp16_scale(builder, ll.offset(builder, block, 2)),
    )


def _superblock_ints_ir(builder, block):
    from hybridmoe.kernels import llvm_ir as ll

    packed = {}

    def piece(p: int):  # nibble p % 2 of bytes 32 (p // 2) ..
        if p // 2 not in packed:
            ptr = ll.offset(builder, block, 16 + 32 * (p // 2))
            packed[p // 2] = ll.load(builder, ptr, ll.vector(ll.I8, 32))
        return ll.bits(builder, packed[p // 2], 4 * (p % 2), 0x0F)

    return ints_ir(builder, block, piece)


# One token's tiles on short rows (numba_moe_q8.SHORT_ROW_WEIGHTS) 4 rows wide: the
# Qwen3-30B-A3B layer at T = 1 (down rows of 3 super-blocks), 2 threads, the AMD EPYC, 1- and
# 4-row tiles interleaved call by call in one process (31 calls each, 2 rounds): 0.903 / 0.887x
# the time
Q4_K = register_k_quant(
    "q4_k",
    BLOCK_BYTES,
    _dequantize_chunk,
    _superblock_ir,
    (0, 2),
    (_superblock_ints, _superblock_ints_ir),
    short_row_rows=4,
)
