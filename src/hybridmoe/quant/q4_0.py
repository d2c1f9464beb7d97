"""GGUF/ggml Q4_0: blocks of 32 weights stored in 18 bytes, an fp16 scale d (little-endian)
then 16 bytes of 4-bit values v; byte j holds weight j in its low nibble and weight j + 16 in
its high nibble; weight = (v - 8) * d. Quantisation is ggml's `quantize_row_q4_0_ref`: m is the
weight of largest magnitude (signed, the first on ties), d = m / -8, v = min(15, trunc(x / d +
8.5)), in fp32 with the multiply and the add rounded separately as the C source writes them.
So m itself maps to v = 0 exactly and -m would need v = 16, clamped to 15. Peak memory: input +
output (18/32 bytes a weight) + ~10 MiB of chunk temporaries.
"""

from __future__ import annotations

import torch

from hybridmoe.quant._blocks import (
    BLOCK_SIZE,
    block_scales,
    check_quantize_input,
    dequantize_blocks,
    quantize_blocks,
    signed_absmax,
)
from hybridmoe.quant.formats import KernelFormat, WeightFormat, register_format

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_SIZE",
    "Q4_0",
    "dequantize_q4_0",
    "quantize_q4_0",
    "quantize_q4_0_reference",
]

BLOCK_BYTES = 18  # fp16 d + 16 bytes of nibbles
_HALF = BLOCK_SIZE // 2


def quantize_q4_0(w: torch.Tensor) -> torch.Tensor:
    """Float w [..., n] (any float dtype, n a multiple of 32, all finite) -> new contiguous
    uint8 [..., n // 32 * 18]. Does not modify w. ValueError for a bad n or non-finite w.
    A host tensor is quantised by the numba kernel (kernels/numba_quantize.py: the same bytes,
    several times faster), any other by the torch reference."""
    check_quantize_input(w, "q4_0")
    if w.device.type != "cpu":
        return quantize_q4_0_reference(w)
    from hybridmoe.kernels.numba_quantize import quantize

    return quantize("q4_0", w)


def quantize_q4_0_reference(w: torch.Tensor) -> torch.Tensor:
    """The torch reference of quantize_q4_0, in chunks (any device)."""
    return quantize_blocks(w, "q4_0", BLOCK_BYTES, _quantize_chunk)


def dequantize_q4_0(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 q [..., nb * 18] -> new contiguous dtype [..., nb * 32], weight = (v - 8) *
    fp16(d), computed in fp32 (exact) then cast to dtype."""
    return dequantize_blocks(q, "q4_0", BLOCK_BYTES, _dequantize_chunk, dtype)


def _quantize_chunk(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = signed_absmax(x) / -8  # [b, 1]; nan/inf propagate to d
    inv_d = torch.where(d == 0, 0.0, 1.0 / d)  # ggml: id = d ? 1.0f/d : 0.0f
    # x * inv_d + 8.5 lies in [0.49, 16.5], so the uint8 cast truncates as C's (int8_t) does.
    v = (x * inv_d).add_(8.5).to(torch.uint8).clamp_(max=15)  # [b, 32]
    return d, v[:, :_HALF] | (v[:, _HALF:] << 4)  # [b, 16]


def _dequantize_chunk(blocks: torch.Tensor) -> torch.Tensor:
    qs = blocks[:, 2:]  # [b, 16]
    v = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # [b, 32]: weights 0..15 then 16..31
    return (v.to(torch.float32) - 8) * block_scales(blocks)  # [b, 32]; exact


def _int8_blocks(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 q [..., nb * 18] -> (int8 v - 8 [..., nb, 32], float32 scales [..., nb])."""
    blocks = q.reshape(-1, BLOCK_BYTES)  # [B, 18]
    qs = blocks[:, 2:]  # [B, 16]
    v = torch.cat([qs & 0x0F, qs >> 4], dim=1).view(torch.int8) - 8  # [B, 32] in [-8, 7]
    scales = block_scales(blocks)[:, 0].reshape(*q.shape[:-1], -1)
    return v.reshape(*q.shape[:-1], -1, BLOCK_SIZE), scales


def _int8_block_ir(builder, block):
    """LLVM IR: (v - 8 <32 x i8>, byte pointer to the fp16 d) of the block at byte pointer
    `block`."""
    from hybridmoe.kernels import llvm_ir as ll

    packed = ll.load(builder, builder.gep(block, [ll.i64(2)]), ll.vector(ll.I8, 16))
    low = builder.and_(packed, ll.const_vec(ll.I8, [0xF] * 16))  # weights 0..15
    high = builder.lshr(packed, ll.const_vec(ll.I8, [4] * 16))  # weights 16..31
    both = builder.shuffle_vector(low, high, ll.const_vec(ll.I32, list(range(32))))
    return builder.sub(both, ll.const_vec(ll.I8, [8] * 32)), block


def _nibble_block_ir(builder, block):
    """LLVM IR: (byte pointer to the 16 bytes of nibbles, byte pointer to the fp16 d) of the
    block at `block`."""
    from hybridmoe.kernels import llvm_ir as ll

    return builder.gep(block, [ll.i64(2)]), block


def _dequantize_block_ir(builder, block):
    """LLVM IR: the weights (v - 8) * d of the block at byte pointer `block`, <32 x float>: on
    AVX-512 looked up in the block's table of the 16 (v - 8) * d (one vpermps per 16 weights),
    elsewhere converted and scaled (the same products, exact)."""
    from hybridmoe.kernels import llvm_ir as ll

    if ll.target_has("avx512f"):
        levels = ll.ir.Constant(ll.V16F, [float(v - 8) for v in range(16)])
        table = builder.fmul(levels, ll.fp16_splat(builder, block))
        return ll.nibble_lookup(builder, ll.offset(builder, block, 2), table)
    scale = ll.splat(builder, ll.fp16_scale(builder, block))
    packed = ll.load(builder, builder.gep(block, [ll.i64(2)]), ll.vector(ll.I8, 16))
    low = builder.and_(packed, ll.const_vec(ll.I8, [0xF] * 16))  # weights 0..15
    high = builder.lshr(packed, ll.const_vec(ll.I8, [4] * 16))  # weights 16..31
    both = builder.shuffle_vector(low, high, ll.const_vec(ll.I32, list(range(32))))
    quants = builder.sub(both, ll.const_vec(ll.I8, [8] * 32))
    return builder.fmul(builder.sitofp(quants, ll.V32F), scale)


Q4_0 = register_format(
    WeightFormat(
        "q4_0",
        BLOCK_SIZE,
        BLOCK_BYTES,
        torch.uint8,
        quantize_q4_0,
        dequantize_q4_0,
        KernelFormat(
            "q4_0",
            BLOCK_BYTES,
            _dequantize_block_ir,
            int8_block_ir=_int8_block_ir,
            nibble_block_ir=_nibble_block_ir,
        ),
        scale_offsets=(0,),
        int8_blocks_fn=_int8_blocks,
    )
)
