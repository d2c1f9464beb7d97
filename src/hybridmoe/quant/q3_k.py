"""GGUF/ggml Q3_K: super-blocks of 256 weights in 110 bytes: 32 bytes hmask (bit p of byte l:
the high bit of weight l of piece p), 64 bytes of 2-bit low parts, 12 bytes of sixteen 6-bit
scales (one per sub-block of 16 weights), fp16 d. Half h of 128 weights reads qs[32 h:][:32];
its piece j (p = 4 h + j) takes bits 2 j, 2 j + 1 of each byte. v = low - (4 if the high bit is
clear else 0), in [-4, 3]; weight = (d * (scale - 32)) * v, exact in fp32. Scale s: low 4 bits
in the low (s < 8) or high nibble of byte s % 8, top 2 bits at bit 2 (s // 4) of byte 8 + s % 4.
As integers (SuperBlockInts, the q8 contract's view): u = low + 4 high in [0, 7], offset 4, the
signed scale - 32 per 16 weights. No quantiser (see _kquants.py).
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

__all__ = ["BLOCK_BYTES", "Q3_K"]

BLOCK_BYTES = 110  # 32 bytes hmask, 64 of 2-bit values, 12 of scales, fp16 d
_LOW_SHIFTS = [0] * 8 + [4] * 8  # scale s's low 4 bits: nibble s // 8 of byte s % 8
_TOP_SHIFTS = [0] * 4 + [2] * 4 + [4] * 4 + [6] * 4  # its top 2: bits 2 (s // 4) of byte 8 + s % 4


def _scales(packed: torch.Tensor) -> torch.Tensor:
    """The 12 scale bytes [b, 12] uint8 -> the 16 signed scales [b, 16] int8, in [-32, 31]."""
    low = shifted(packed[:, None, :8], [0, 4], 0x0F).reshape(-1, 16)  # [b, 16]
    top = shifted(packed[:, None, 8:], [0, 2, 4, 6], 3).reshape(-1, 16)  # [b, 16]
    return (low | (top << 4)).view(torch.int8) - 32


def _low_high(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each weight's 2 low bits and its hmask bit, [b, 8, 32] uint8 each, by piece."""
    low = shifted(blocks[:, 32:96].reshape(-1, 2, 32), [0, 2, 4, 6], 3)  # [b, 2, 4, 32]
    high = shifted(blocks[:, None, :32], list(range(8)), 1)  # [b, 1, 8, 32]
    return low.reshape(-1, PIECES, 32), high.reshape(-1, PIECES, 32)


def _dequantize_chunk(blocks: torch.Tensor) -> torch.Tensor:
    scales = _scales(blocks[:, 96:108]).to(torch.float32)
    scale = (fp16_at(blocks, 108)[:, 0] * scales)[:, :, None]  # [b, 16, 1]
    low, high = _low_high(blocks)
    v = low.view(torch.int8) - ((high ^ 1) << 2).view(torch.int8)
    return v.reshape(-1, 16, 16).to(torch.float32).mul_(scale).reshape(-1, 256)


def _superblock_ints(q: torch.Tensor) -> SuperBlockInts:
    blocks = q.reshape(-1, BLOCK_BYTES)
    low, high = _low_high(blocks)
    u = (low | (high << 2)).reshape(-1, 256)  # v + 4
    scales = _scales(blocks[:, 96:108])
    return superblock_ints(q, u, scales, None, fp16_at(blocks, 108), None, offset=4)


def _superblock_ints_ir(builder, block):
    """LLVM IR: the SuperBlockIntsIR of a Q3_K super-block: lows = 4 (scale - 32) (the
    offset), u of piece p = its 2 low bits or'ed with its hmask bit as bit 2."""
    from hybridmoe.kernels import llvm_ir as ll
    from hybridmoe.quant._kquants import SuperBlockIntsIR

    scales = builder.sext(_signed_scales_ir(builder, block), ll.vector(ll.I16, 16))
    hmask, halves = _hmask_halves_ir(builder, block)

    def piece(p: int):
        half, j = divmod(p, 4)
        high = ll.shl(builder, ll.bits(builder, hmask, p, 1), 2)
        return builder.or_(ll.bits(builder, halves[half], 2 * j, 3), high)

    return SuperBlockIntsIR(
        piece=piece,
        pair_scales=sixteen_weight_pair_scales(builder, scales),
        lows=ll.shl(builder, scales, 2),  # 4 sc_k: S - Σ 4 sc_k B_k
        d=ll.fp16_scale(builder, ll.offset(builder, block, 108)),
        dmin=None,
    )


def _hmask_halves_ir(builder, block):
    """LLVM IR: the 32 hmask bytes and each half's 32 bytes of 2-bit values, <32 x i8> each."""
    from hybridmoe.kernels import llvm_ir as ll

    hmask = ll.load(builder, block, ll.vector(ll.I8, 32))
    halves = [
        ll.load(builder, ll.offset(builder, block, 32 + 32 * h), ll.vector(ll.I8, 32))
        for h in range(2)
    ]
    return hmask, halves


def _signed_scales_ir(builder, block):
    """LLVM IR: <16 x i8>, the 16 scales - 32 of the super-block at `block`."""
    from hybridmoe.kernels import llvm_ir as ll

    packed = ll.load(builder, ll.offset(builder, block, 96), ll.vector(ll.I8, 12))
    low = ll.bits(builder, ll.lanes(builder, packed, [*range(8), *range(8)]), _LOW_SHIFTS, 0x0F)
    top = ll.bits(builder, ll.lanes(builder, packed, [8, 9, 10, 11] * 4), _TOP_SHIFTS, 3)
    return builder.sub(builder.or_(low, ll.shl(builder, top, 4)), ll.const_vec(ll.I8, [32] * 16))


def _scale_table(builder, block, factor: float = 1.0):
    """LLVM IR: the ScaleTable of the 16 d (scale - 32), each times `factor` (a power of two:
    exact, d * factor first)."""
    from hybridmoe.kernels import llvm_ir as ll

    signed = _signed_scales_ir(builder, block)
    d = ll.fp16_scale(builder, ll.offset(builder, block, 108))
    if factor != 1.0:
        d = builder.fmul(d, ll.ir.Constant(ll.F32, factor))
    d = ll.splat(builder, d, 16)
    return ll.ScaleTable(builder, builder.fmul(d, builder.sitofp(signed, ll.V16F)))


def _superblock_ir(builder, block):
    """LLVM IR: piece(p) -> <32 x float>, the weights (d (scale - 32)) v of piece p: on targets
    with byte permutes (llvm_ir.byte_permutes) assembled 64 at a time in bytes (_byte_pieces),
    else in 32 bytes a piece (the same weights)."""
    from hybridmoe.kernels import llvm_ir as ll

    if ll.byte_permutes():
        return _byte_pieces(builder, block)
    scales = _scale_table(builder, block)
    hmask, halves = _hmask_halves_ir(builder, block)

    def piece(p: int):
        half, j = divmod(p, 4)
        clear = builder.xor(ll.bits(builder, hmask, p, 1), ll.const_vec(ll.I8, [1] * 32))
        v = builder.sub(ll.bits(builder, halves[half], 2 * j, 3), ll.shl(builder, clear, 2))
        return ll.scaled_halves(builder, v, scales, (2 * p, 2 * p + 1), signed=True)

    return piece


def _byte_pieces(builder, block):
    """piece(p) of _superblock_ir on byte-permute targets: v of pieces 4 h + 2 k (bytes 0..31)
    and 4 h + 2 k + 1 (bytes 32..63) in one <64 x i8>, as int8: half h's 32 qs bytes twice,
    each piece's 2 bits moved to bits 0, 1 and its hmask bit, flipped, into bits 2..7 (GFNI:
    -4 when clear); each 16 then placed in the top byte of 32-bit lanes (one byte permute:
    v 2^24) and converted, times d (scale - 32) 2^-24: the same product, exact."""
    from hybridmoe.kernels import llvm_ir as ll

    scales = _scale_table(builder, block, 2.0**-24)
    hmask = ll.load(builder, block, ll.vector(ll.I8, 32))
    hmask = ll.lanes(builder, hmask, [*range(32), *range(32)])  # [hmask, hmask]
    values = {}

    def pair(half: int, k: int):
        if (half, k) not in values:
            qs = ll.load(builder, ll.offset(builder, block, 32 + 32 * half), ll.vector(ll.I8, 32))
            qs = ll.lanes(builder, qs, [*range(32), *range(32)])  # [qs, qs]
            js = (2 * k, 2 * k + 1)
            low = [{0: 2 * j, 1: 2 * j + 1} for j in js for _ in range(4)]
            low = ll.gf2_affine(builder, qs, low)
            sign = [{t: 4 * half + j for t in range(2, 8)} for j in js for _ in range(4)]
            values[half, k] = builder.or_(low, ll.gf2_affine(builder, hmask, sign, xor=0xFC))
        return values[half, k]

    def piece(p: int):
        half, j = divmod(p, 4)
        v, out = pair(half, j // 2), []
        for h in range(2):
            w = builder.sitofp(ll.dword_bytes(builder, v, 32 * (j % 2) + 16 * h, at=3), ll.V16F)
            out.append(builder.fmul(w, scales.splat(2 * p + h)))
        return ll.halves(builder, *out)

    return piece


# One token's tiles on short rows 4 rows wide (as q4_k's): 0.928 / 0.977x the time
Q3_K = register_k_quant(
    "q3_k",
    BLOCK_BYTES,
    _dequantize_chunk,
    _superblock_ir,
    (108,),
    (_superblock_ints, _superblock_ints_ir),
    short_row_rows=4,
)
