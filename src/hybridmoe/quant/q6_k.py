"""GGUF/ggml Q6_K: super-blocks of 256 weights in 210 bytes: 128 bytes ql of low nibbles, 64
bytes qh of 2-bit high parts, 16 int8 scales (one per sub-block of 16 weights), fp16 d. Each
half h of 128 weights reads ql[64 h:][:64] and qh[32 h:][:32]; its piece j (32 weights) takes
nibble j // 2 of ql[64 h + 32 (j % 2) + l] and bits 2 j, 2 j + 1 of qh[32 h + l]. Weight =
(d * scale) * (v - 32), exact in fp32. No quantiser (see _kquants.py).
"""

from __future__ import annotations

import torch

from hybridmoe.quant._kquants import PIECES, fp16_at, register_k_quant, shifted

__all__ = ["BLOCK_BYTES", "Q6_K"]

BLOCK_BYTES = 210  # 128 bytes ql, 64 qh, 16 int8 scales, fp16 d


def _dequantize_chunk(blocks: torch.Tensor) -> torch.Tensor:
    scales = blocks[:, 192:208].view(torch.int8).to(torch.float32)  # [b, 16]
    scale = (fp16_at(blocks, 208)[:, 0] * scales)[:, :, None]  # [b, 16, 1]
    ql = shifted(blocks[:, :128].reshape(-1, 2, 64), [0, 4], 0x0F)  # [b, 2, 2, 64]
    qh = shifted(blocks[:, 128:192].reshape(-1, 2, 32), [0, 2, 4, 6], 3)  # [b, 2, 4, 32]
    v = ql.reshape(-1, PIECES, 32) | (qh.reshape(-1, PIECES, 32) << 4)  # [b, 8, 32]
    v = (v.view(torch.int8) - 32).reshape(-1, 16, 16).to(torch.float32)
    return v.mul_(scale).reshape(-1, 256)


def _superblock_ir(builder, block):
    """LLVM IR: piece(p) -> <32 x float>, the weights (d scale) (v - 32) of piece p: v - 32
    assembled in 32 bytes, each half of 16 (one sub-block) times its scale, broadcast from
    the stack."""
    from hybridmoe.kernels import llvm_ir as ll

    raw = ll.load(builder, ll.offset(builder, block, 192), ll.vector(ll.I8, 16))
    d = ll.splat(builder, ll.fp16_scale(builder, ll.offset(builder, block, 208)), 16)
    scales = builder.fmul(d, builder.sitofp(raw, ll.V16F))  # [16] d * scale
    table = ll.ScaleTable(builder, scales)
    loaded = {}

    def load32(at: int):
        if at not in loaded:
            loaded[at] = ll.load(builder, ll.offset(builder, block, at), ll.vector(ll.I8, 32))
        return loaded[at]

    def piece(p: int):
        half, j = divmod(p, 4)
        low = ll.bits(builder, load32(64 * half + 32 * (j % 2)), 4 * (j // 2), 0x0F)
        high = ll.shl(builder, ll.bits(builder, load32(128 + 32 * half), 2 * j, 3), 4)
        v = builder.sub(builder.or_(low, high), ll.const_vec(ll.I8, [32] * 32))  # -32 .. 31
        return ll.scaled_halves(builder, v, table, (2 * p, 2 * p + 1), signed=True)

    return piece


Q6_K = register_k_quant("q6_k", BLOCK_BYTES, _dequantize_chunk, _superblock_ir, (208,))
