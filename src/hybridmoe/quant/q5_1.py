"""GGUF/ggml Q5_1: blocks of 32 weights stored in 24 bytes, an fp16 scale d and an fp16 minimum
m, then Q5_0's 20 bytes of 5-bit values v (4 bytes of high bits, 16 of low nibbles); weight =
d * v + m (one rounding: d * v is exact in fp32). Quantisation is ggml's
`quantize_row_q5_1_ref`: d = (max - min) / 31, v = min(31, trunc((x - min) / d + 0.5)) in fp32.
"""

from __future__ import annotations

import torch

from hybridmoe.quant._blocks import BLOCK_SIZE, block_scales, dequantize_blocks, quantize_blocks
from hybridmoe.quant.formats import KernelFormat, WeightFormat, register_format
from hybridmoe.quant.q4_1 import min_max_levels
from hybridmoe.quant.q5_0 import five_bit_ir, pack_5_bits, unpack_5_bits

__all__ = ["BLOCK_BYTES", "Q5_1", "dequantize_q5_1", "quantize_q5_1"]

BLOCK_BYTES = 24  # fp16 d + fp16 m + 4 bytes of high bits + 16 bytes of nibbles


def quantize_q5_1(w: torch.Tensor) -> torch.Tensor:
    """Float w [..., n] (any float dtype, n a multiple of 32, all finite) -> new contiguous
    uint8 [..., n // 32 * 24]. Does not modify w. ValueError for a bad n or non-finite w."""
    return quantize_blocks(w, "q5_1", BLOCK_BYTES, _quantize_chunk)


def dequantize_q5_1(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 q [..., nb * 24] -> new contiguous dtype [..., nb * 32], weight = fp16(d) * v +
    fp16(m), computed in fp32 then cast to dtype."""
    return dequantize_blocks(q, "q5_1", BLOCK_BYTES, _dequantize_chunk, dtype)


def _quantize_chunk(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales, v = min_max_levels(x, 31)
    return scales, pack_5_bits(v)  # [b, 2], [b, 20]


def _dequantize_chunk(blocks: torch.Tensor) -> torch.Tensor:
    v = unpack_5_bits(blocks[:, 4:]).to(torch.float32)  # [b, 32]
    return v.mul_(block_scales(blocks)).add_(block_scales(blocks, offset=2))  # [b, 32]


def _dequantize_block_ir(builder, block):
    """LLVM IR: the weights d * v + m of the block at byte pointer `block`, <32 x float>: on
    AVX-512 looked up in the block's table of the 32 d * v + m (llvm_ir.five_bit_lookup; d * v
    is exact, so the table's FMA rounds as fmul then fadd), elsewhere computed."""
    from hybridmoe.kernels import llvm_ir as ll

    if ll.target_has("avx512f"):
        d, m = (ll.fp16_splat(builder, ll.offset(builder, block, at)) for at in (0, 2))
        low, high = (
            ll.exact_fma(builder, ll.ir.Constant(ll.V16F, [float(v) for v in at]), d, m)
            for at in (range(16), range(16, 32))
        )
        return ll.five_bit_lookup(builder, ll.offset(builder, block, 4), low, high)
    scale = ll.splat(builder, ll.fp16_scale(builder, block))
    low = ll.splat(builder, ll.fp16_scale(builder, builder.gep(block, [ll.i64(2)])))
    values = five_bit_ir(builder, builder.gep(block, [ll.i64(4)]))
    return ll.exact_fma(builder, builder.uitofp(values, ll.V32F), scale, low)  # d * v exact


Q5_1 = register_format(
    WeightFormat(
        "q5_1",
        BLOCK_SIZE,
        BLOCK_BYTES,
        torch.uint8,
        quantize_q5_1,
        dequantize_q5_1,
        KernelFormat("q5_1", BLOCK_BYTES, _dequantize_block_ir),
        scale_offsets=(0, 2),
    )
)
