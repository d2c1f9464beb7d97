"""GGUF/ggml Q4_1: blocks of 32 weights stored in 20 bytes, an fp16 scale d and an fp16 minimum
m (little-endian), then 16 bytes of 4-bit values v; byte j holds weight j in its low nibble and
weight j + 16 in its high nibble; weight = d * v + m (one rounding: d * v is exact in fp32).
Quantisation is ggml's `quantize_row_q4_1_ref`: d = (max - min) / 15, v = min(15, trunc((x -
min) / d + 0.5)) in fp32, then d and min stored as fp16.
"""

from __future__ import annotations

import torch

from hybridmoe.quant._blocks import BLOCK_SIZE, block_scales, dequantize_blocks, quantize_blocks
from hybridmoe.quant.formats import KernelFormat, WeightFormat, register_format

__all__ = ["BLOCK_BYTES", "Q4_1", "dequantize_q4_1", "quantize_q4_1"]

BLOCK_BYTES = 20  # fp16 d + fp16 m + 16 bytes of nibbles
_HALF = BLOCK_SIZE // 2


def quantize_q4_1(w: torch.Tensor) -> torch.Tensor:
    """Float w [..., n] (any float dtype, n a multiple of 32, all finite) -> new contiguous
    uint8 [..., n // 32 * 20]. Does not modify w. ValueError for a bad n or non-finite w."""
    return quantize_blocks(w, "q4_1", BLOCK_BYTES, _quantize_chunk)


def dequantize_q4_1(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 q [..., nb * 20] -> new contiguous dtype [..., nb * 32], weight = fp16(d) * v +
    fp16(m), computed in fp32 then cast to dtype."""
    return dequantize_blocks(q, "q4_1", BLOCK_BYTES, _dequantize_chunk, dtype)


def min_max_levels(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's q4_1/q5_1 rule for x [b, 32]: (scales [b, 2] = (d, min), v [b, 32] uint8) with
    d = (max - min) / levels and v = min(levels, trunc((x - min) * (1 / d) + 0.5))."""
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)  # [b, 1]
    d = (hi - lo) / levels  # nan/inf propagate to d
    inv_d = torch.where(d == 0, 0.0, 1.0 / d)  # ggml: id = d ? 1.0f/d : 0.0f
    # (x - min) * inv_d + 0.5 lies in [0.5, levels + 0.5]: the cast truncates as C's does
    v = (x - lo).mul_(inv_d).add_(0.5).to(torch.uint8).clamp_(max=levels)  # [b, 32]
    return torch.cat([d, lo], dim=1), v


def _quantize_chunk(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales, v = min_max_levels(x, 15)
    return scales, v[:, :_HALF] | (v[:, _HALF:] << 4)  # [b, 2], [b, 16]


def _dequantize_chunk(blocks: torch.Tensor) -> torch.Tensor:
    qs = blocks[:, 4:]  # [b, 16]
    v = torch.cat([qs & 0x0F, qs >> 4], dim=1).to(torch.float32)  # [b, 32]
    return v.mul_(block_scales(blocks)).add_(block_scales(blocks, offset=2))  # [b, 32]


def _dequantize_block_ir(builder, block):
    """LLVM IR: the weights d * v + m of the block at byte pointer `block`, <32 x float>: on
    AVX-512 looked up in the block's table of the 16 d * v + m (one vpermps per 16 weights;
    d * v is exact, so the table's FMA rounds as fmul then fadd), elsewhere computed."""
    from hybridmoe.kernels import llvm_ir as ll

    if ll.target_has("avx512f"):
        # scalar conversions and register broadcasts: faster here than fp16_splat's
        d, m = (ll.splat(builder, ll.fp16_scale(builder, ll.offset(builder, block, at)), 16)
                for at in (0, 2))  # fmt: skip
        levels = ll.ir.Constant(ll.V16F, [float(v) for v in range(16)])
        table = ll.exact_fma(builder, levels, d, m)
        return ll.nibble_lookup(builder, ll.offset(builder, block, 4), table)
    scale = ll.splat(builder, ll.fp16_scale(builder, block))
    low = ll.splat(builder, ll.fp16_scale(builder, builder.gep(block, [ll.i64(2)])))
    packed = ll.load(builder, builder.gep(block, [ll.i64(4)]), ll.vector(ll.I8, 16))
    both = builder.shuffle_vector(packed, packed, ll.const_vec(ll.I32, list(range(32))))
    quants = ll.bits(builder, both, [0] * 16 + [4] * 16, 0xF)  # weights 0..15, then 16..31
    return ll.exact_fma(builder, builder.uitofp(quants, ll.V32F), scale, low)  # d * v exact


Q4_1 = register_format(
    WeightFormat(
        "q4_1",
        BLOCK_SIZE,
        BLOCK_BYTES,
        torch.uint8,
        quantize_q4_1,
        dequantize_q4_1,
        KernelFormat("q4_1", BLOCK_BYTES, _dequantize_block_ir),
        scale_offsets=(0, 2),
    )
)
