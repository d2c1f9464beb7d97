"""GGUF/ggml Q6_K: super-blocks of 256 weights in 210 bytes: 128 bytes ql of low nibbles, 64
bytes qh of 2-bit high parts, 16 int8 scales (one per sub-block of 16 weights), fp16 d. Each
half h of 128 weights reads ql[64 h:][:64] and qh[32 h:][:32]; its piece j (32 weights) takes
nibble j // 2 of ql[64 h + 32 (j % 2) + l] and bits 2 j, 2 j + 1 of qh[32 h + l]. Weight =
(d * scale) * (v - 32), exact in fp32. No quantiser (see _kquants.py).
"""

from __future__ import annotations

import torch

from hybridmoe.quant._kquants import (
    PIECES,
    SuperBlockInts,
    fp16_at,
    register_k_quant,
    shifted,
    sixteen_weight_pair_scales,
    superblock_ints,
)

__all__ = ["BLOCK_BYTES", "Q6_K"]

BLOCK_BYTES = 210  # 128 bytes ql, 64 qh, 16 int8 scales, fp16 d


def _values(blocks: torch.Tensor) -> torch.Tensor:
    """The 6-bit v [b, 8, 32] uint8 (before the offset of 32) of blocks [b, 210]."""
    ql = shifted(blocks[:, :128].reshape(-1, 2, 64), [0, 4], 0x0F)  # [b, 2, 2, 64]
    qh = shifted(blocks[:, 128:192].reshape(-1, 2, 32), [0, 2, 4, 6], 3)  # [b, 2, 4, 32]
    return ql.reshape(-1, PIECES, 32) | (qh.reshape(-1, PIECES, 32) << 4)  # [b, 8, 32]


def _dequantize_chunk(blocks: torch.Tensor) -> torch.Tensor:
    scales = blocks[:, 192:208].view(torch.int8).to(torch.float32)  # [b, 16]
    scale = (fp16_at(blocks, 208)[:, 0] * scales)[:, :, None]  # [b, 16, 1]
    v = (_values(blocks).view(torch.int8) - 32).reshape(-1, 16, 16).to(torch.float32)
    return v.mul_(scale).reshape(-1, 256)


def _superblock_ints(q: torch.Tensor) -> SuperBlockInts:
    blocks = q.reshape(-1, BLOCK_BYTES)
    scales = blocks[:, 192:208].contiguous().view(torch.int8)  # [b, 16]
    u = _values(blocks).reshape(-1, 256)
    return superblock_ints(q, u, scales, None, fp16_at(blocks, 208), None, offset=32)


def _superblock_ints_ir(builder, block):
    """LLVM IR: the SuperBlockIntsIR of a Q6_K super-block: lows = 32 sc_k (the offset)."""
    from hybridmoe.kernels import llvm_ir as ll
    from hybridmoe.quant._kquants import SuperBlockIntsIR

    raw = ll.load(builder, ll.offset(builder, block, 192), ll.vector(ll.I8, 16))
    scales = builder.sext(raw, ll.vector(ll.I16, 16))
    return SuperBlockIntsIR(
        piece=_values_ir(builder, block),
        pair_scales=sixteen_weight_pair_scales(builder, scales),
        lows=ll.shl(builder, scales, 5),  # 32 sc_k: S - Σ 32 sc_k B_k
        d=ll.fp16_scale(builder, ll.offset(builder, block, 208)),
        dmin=None,
    )


def _superblock_ir(builder, block):
    """LLVM IR: piece(p) -> <32 x float>, the weights (d scale) (v - 32) of piece p: on targets
    with byte permutes (llvm_ir.byte_permutes) assembled 64 at a time in bytes (_byte_pieces),
    else v - 32 in 32 bytes a piece, each half of 16 (one sub-block) times its scale,
    broadcast from the stack (the same weights)."""
    from hybridmoe.kernels import llvm_ir as ll

    if ll.byte_permutes():
        return _byte_pieces(builder, block)
    raw = ll.load(builder, ll.offset(builder, block, 192), ll.vector(ll.I8, 16))
    d = ll.splat(builder, ll.fp16_scale(builder, ll.offset(builder, block, 208)), 16)
    scales = builder.fmul(d, builder.sitofp(raw, ll.V16F))  # [16] d * scale
    table = ll.ScaleTable(builder, scales)
    values = _values_ir(builder, block)

    def piece(p: int):
        v = builder.sub(values(p), ll.const_vec(ll.I8, [32] * 32))  # -32 .. 31
        return ll.scaled_halves(builder, v, table, (2 * p, 2 * p + 1), signed=True)

    return piece


def _values_ir(builder, block):
    """LLVM IR: values(p) -> <32 x i8>, the 6-bit v (0 .. 63) of piece p, 32 bytes a piece."""
    from hybridmoe.kernels import llvm_ir as ll

    loaded = {}

    def load32(at: int):
        if at not in loaded:
            loaded[at] = ll.load(builder, ll.offset(builder, block, at), ll.vector(ll.I8, 32))
        return loaded[at]

    def values(p: int):
        half, j = divmod(p, 4)
        low = ll.bits(builder, load32(64 * half + 32 * (j % 2)), 4 * (j // 2), 0x0F)
        high = ll.shl(builder, ll.bits(builder, load32(128 + 32 * half), 2 * j, 3), 4)
        return builder.or_(low, high)

    return values


def _byte_pieces(builder, block):
    """piece(p) of _superblock_ir on byte-permute targets. Half h's pieces 4h + j, j = 0, 1
    (low nibbles) or 2, 3 (high ones) in one <64 x i8> (its 64 ql bytes; j odd: bytes 32..63):
    v - 32 as int8, the nibble or'ed with qh's bits 2j, 2j + 1 moved to bit 4 and bits 5..7
    less 32 (GFNI: bit 2j + 1 flipped into bits 5, 6, 7 is -32's sign extension); each 16 of
    them then placed in the top byte of 32-bit lanes (one byte permute: (v - 32) 2^24) and
    converted, times (d scale) 2^-24: the same product, exact."""
    from hybridmoe.kernels import llvm_ir as ll

    raw = ll.load(builder, ll.offset(builder, block, 192), ll.vector(ll.I8, 16))
    d = ll.fp16_scale(builder, ll.offset(builder, block, 208))
    d = ll.splat(builder, builder.fmul(d, ll.ir.Constant(ll.F32, 2.0**-24)), 16)
    table = ll.ScaleTable(builder, builder.fmul(d, builder.sitofp(raw, ll.V16F)))
    values = {}

    def quad(half: int, high: int):  # <64 x i8>: v - 32 of pieces 4 half + 2 high + {0, 1}
        if (half, high) not in values:
            ql = ll.load(builder, ll.offset(builder, block, 64 * half), ll.V64B)
            if high:
                ql = ll.gf2_affine(builder, ql, {0: 4, 1: 5, 2: 6, 3: 7})
            else:
                ql = builder.and_(ql, ll.const_vec(ll.I8, [0x0F] * 64))
            qh = ll.load(builder, ll.offset(builder, block, 128 + 32 * half), ll.vector(ll.I8, 32))
            qh = ll.lanes(builder, qh, [*range(32), *range(32)])  # [qh, qh]
            js = (2 * high, 2 * high + 1)  # the pieces of bytes 0..31, 32..63
            top = [{4: 2 * j, 5: 2 * j + 1, 6: 2 * j + 1, 7: 2 * j + 1} for j in js]
            top = ll.gf2_affine(builder, qh, [top[0]] * 4 + [top[1]] * 4, xor=0xE0)
            values[half, high] = builder.or_(ql, top)
        return values[half, high]

    def piece(p: int):
        half, j = divmod(p, 4)
        v = quad(half, j // 2)
        out = []
        for h in range(2):
            w = builder.sitofp(ll.dword_bytes(builder, v, 32 * (j % 2) + 16 * h, at=3), ll.V16F)
            out.append(builder.fmul(w, table.splat(2 * p + h)))
        return ll.halves(builder, *out)

    return piece


# One token's tiles stay 1 row wide on short rows too: 4 rows measured 0.948 / 1.084x the time
# (as q4_k's note)
Q6_K = register_k_quant(
    "q6_k",
    BLOCK_BYTES,
    _dequantize_chunk,
    _superblock_ir,
    (208,),
    (_superblock_ints, _superblock_ints_ir),
)
