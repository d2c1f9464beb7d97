"""GGUF/ggml Q4_K: super-blocks of 256 weights in 144 bytes: fp16 d, fp16 dmin, 12 bytes of
eight 6-bit scales sc and minimums m (ggml's get_scale_min_k4 packing), then 128 bytes of
nibbles: bytes 32 g .. 32 g + 31 hold sub-block 2 g in their low nibbles and 2 g + 1 in their
high ones. Weight l of sub-block j = (d * sc_j) * v - (dmin * m_j): both products exact in
fp32, one rounding. No quantiser (see _kquants.py).
"""

from __future__ import annotations

import torch

from hybridmoe.quant._kquants import PIECES, fp16_at, register_k_quant, shifted

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


def scale_min_ir(builder, block):
    """LLVM IR: (d * sc, dmin * m), two <8 x float>, of a Q4_K/Q5_K super-block at byte
    pointer `block` (scale_min_k4's unpacking, lane j for sub-block j)."""
    from hybridmoe.kernels import llvm_ir as ll

    packed = ll.load(builder, ll.offset(builder, block, 4), ll.vector(ll.I8, 12))
    zero = ll.ir.Constant(ll.vector(ll.I8, 12), None)

    def six_bits(low_bytes: list[int], low_shifts: list[int], top_bytes: list[int]):
        low = ll.bits(
            builder, ll.lanes(builder, packed, low_bytes), low_shifts, [63] * 4 + [15] * 4
        )
        tops = builder.shuffle_vector(packed, zero, ll.const_vec(ll.I32, [12] * 4 + top_bytes))
        return builder.or_(low, ll.shl(builder, ll.bits(builder, tops, 6, 3), 4))

    sc = six_bits([0, 1, 2, 3, 8, 9, 10, 11], [0] * 8, [0, 1, 2, 3])
    mins = six_bits([4, 5, 6, 7, 8, 9, 10, 11], [0] * 4 + [4] * 4, [4, 5, 6, 7])
    d, dmin = (
        ll.splat(builder, ll.fp16_scale(builder, ll.offset(builder, block, o)), 8) for o in (0, 2)
    )
    v8f = ll.vector(ll.F32, 8)
    return builder.fmul(d, builder.uitofp(sc, v8f)), builder.fmul(dmin, builder.uitofp(mins, v8f))


def _superblock_ir(builder, block):
    """LLVM IR: piece(p) -> <32 x float>, sub-block p's weights (d sc_p) v - dmin m_p."""
    from hybridmoe.kernels import llvm_ir as ll

    scales, lows = scale_min_ir(builder, block)
    packed = {}

    def piece(p: int):
        group = p // 2
        if group not in packed:
            packed[group] = ll.load(
                builder, ll.offset(builder, block, 16 + 32 * group), ll.vector(ll.I8, 32)
            )
        v = ll.bits(builder, packed[group], 4 * (p % 2), 0x0F)
        w = builder.fmul(builder.uitofp(v, ll.V32F), ll.sub_block_scale(builder, scales, p))
        return builder.fsub(w, ll.sub_block_scale(builder, lows, p))

    return piece


Q4_K = register_k_quant("q4_k", BLOCK_BYTES, _dequantize_chunk, _superblock_ir, (0, 2))
