"""GGUF/ggml Q5_0: blocks of 32 weights stored in 22 bytes, an fp16 scale d, 4 bytes qh of high
bits (bit j of the little-endian uint32 is bit 4 of weight j), then 16 bytes of low nibbles
(byte j: weight j in its low nibble, weight j + 16 in its high nibble); weight = (v - 16) * d.
Quantisation is ggml's `quantize_row_q5_0_ref`: m the weight of largest magnitude (signed, the
first on ties), d = m / -16, v = min(31, trunc(x / d + 16.5)) in fp32.
"""

from __future__ import annotations

import torch

from hybridmoe.quant._blocks import (
    BLOCK_SIZE,
    block_scales,
    dequantize_blocks,
    quantize_blocks,
    signed_absmax,
)
from hybridmoe.quant.formats import KernelFormat, WeightFormat, register_format

__all__ = ["BLOCK_BYTES", "Q5_0", "dequantize_q5_0", "quantize_q5_0"]

BLOCK_BYTES = 22  # fp16 d + 4 bytes of high bits + 16 bytes of nibbles
_HALF = BLOCK_SIZE // 2
_BIT = torch.arange(8, dtype=torch.uint8)  # [8] bit j % 8 of byte j // 8 is weight j's


def quantize_q5_0(w: torch.Tensor) -> torch.Tensor:
    """Float w [..., n] (any float dtype, n a multiple of 32, all finite) -> new contiguous
    uint8 [..., n // 32 * 22]. Does not modify w. ValueError for a bad n or non-finite w."""
    return quantize_blocks(w, "q5_0", BLOCK_BYTES, _quantize_chunk)


def dequantize_q5_0(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 q [..., nb * 22] -> new contiguous dtype [..., nb * 32], weight = (v - 16) *
    fp16(d), computed in fp32 (exact) then cast to dtype."""
    return dequantize_blocks(q, "q5_0", BLOCK_BYTES, _dequantize_chunk, dtype)


def pack_5_bits(v: torch.Tensor) -> torch.Tensor:
    """5-bit values v [b, 32] uint8 -> their bytes [b, 20]: qh (bit 4 of weight j at bit j),
    then the low nibbles (weights j and j + 16 in byte j)."""
    high = ((v >> 4) & 1).view(-1, 4, 8) << _BIT.to(v.device)  # [b, 4, 8]
    qh = high.sum(dim=2, dtype=torch.uint8)  # [b, 4]: disjoint bits, so the sum is an or
    return torch.cat([qh, (v[:, :_HALF] & 0x0F) | (v[:, _HALF:] << 4)], dim=1)


def unpack_5_bits(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_5_bits: bytes [b, 20] -> values v [b, 32] uint8 in [0, 31]."""
    qh, qs = packed[:, :4], packed[:, 4:]
    high = ((qh[:, :, None] >> _BIT.to(qh.device)) & 1).reshape(-1, BLOCK_SIZE)  # [b, 32]
    return torch.cat([qs & 0x0F, qs >> 4], dim=1) | (high << 4)


def _quantize_chunk(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = signed_absmax(x) / -16  # [b, 1]; nan/inf propagate to d
    inv_d = torch.where(d == 0, 0.0, 1.0 / d)  # ggml: id = d ? 1.0f/d : 0.0f
    # x * inv_d + 16.5 lies in [0.49, 32.5], so the uint8 cast truncates as C's (int8_t) does.
    v = (x * inv_d).add_(16.5).to(torch.uint8).clamp_(max=31)  # [b, 32]
    return d, pack_5_bits(v)


def _dequantize_chunk(blocks: torch.Tensor) -> torch.Tensor:
    v = unpack_5_bits(blocks[:, 2:]).view(torch.int8) - 16  # [b, 32]
    return block_scales(blocks) * v.to(torch.float32)  # [b, 32]; exact


def five_bit_ir(builder, packed):
    """LLVM IR: the 32 5-bit values (i8 lanes, in [0, 31]) of pack_5_bits' bytes at byte
    pointer `packed`."""
    from hybridmoe.kernels import llvm_ir as ll

    qh = ll.load(builder, packed, ll.vector(ll.I8, 4))
    spread = ll.lanes(builder, qh, [j // 8 for j in range(32)])  # byte j // 8 in lane j
    high = builder.shl(
        ll.bits(builder, spread, [j % 8 for j in range(32)], 1), ll.const_vec(ll.I8, [4] * 32)
    )
    nibbles = ll.load(builder, builder.gep(packed, [ll.i64(4)]), ll.vector(ll.I8, 16))
    both = builder.shuffle_vector(nibbles, nibbles, ll.const_vec(ll.I32, list(range(32))))
    return builder.or_(ll.bits(builder, both, [0] * 16 + [4] * 16, 0xF), high)


def _dequantize_block_ir(builder, block):
    """LLVM IR: the weights (v - 16) * d of the block at byte pointer `block`, <32 x float>: on
    AVX-512 looked up in the block's table of the 32 (v - 16) * d (llvm_ir.five_bit_lookup),
    elsewhere converted and scaled (the same products, exact)."""
    from hybridmoe.kernels import llvm_ir as ll

    if ll.target_has("avx512f"):
        d = ll.fp16_splat(builder, block)
        low, high = (
            builder.fmul(ll.ir.Constant(ll.V16F, [float(v - 16) for v in at]), d)
            for at in (range(16), range(16, 32))
        )
        return ll.five_bit_lookup(builder, ll.offset(builder, block, 2), low, high)
    scale = ll.splat(builder, ll.fp16_scale(builder, block))
    values = five_bit_ir(builder, builder.gep(block, [ll.i64(2)]))
    return ll.scaled(builder, builder.sub(values, ll.const_vec(ll.I8, [16] * 32)), scale)


Q5_0 = register_format(
    WeightFormat(
        "q5_0",
        BLOCK_SIZE,
        BLOCK_BYTES,
        torch.uint8,
        quantize_q5_0,
        dequantize_q5_0,
        KernelFormat("q5_0", BLOCK_BYTES, _dequantize_block_ir),
        scale_offsets=(0,),
    )
)
