"""GGUF/ggml Q8_0: blocks of 32 weights stored in 34 bytes, an fp16 scale d (little-endian)
then 32 int8 values q; weight = d * q. Quantisation is ggml's `quantize_row_q8_0_ref`:
d = max|x| / 127 and q = roundf(x / d), computed in fp32 exactly as the C code does, so the
bytes equal those of llama.cpp's tools. Peak memory: input + output (34/32 bytes a weight)
+ ~10 MiB of chunk temporaries.
"""

from __future__ import annotations

import torch

from hybridmoe.quant._blocks import (
    BLOCK_SIZE,
    block_scales,
    check_quantize_input,
    dequantize_blocks,
    quantize_blocks,
)
from hybridmoe.quant.formats import KernelFormat, WeightFormat, register_format

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_SIZE",
    "Q8_0",
    "dequantize_q8_0",
    "q8_0_blocks_f32",
    "quantize_q8_0",
    "quantize_q8_0_reference",
]

BLOCK_BYTES = 34  # fp16 d + 32 x int8


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Float w [..., n] (any float dtype, n a multiple of 32, all finite) -> new contiguous
    uint8 [..., n // 32 * 34]. Does not modify w. ValueError for a bad n or non-finite w.
    A host tensor is quantised by the numba kernel (kernels/numba_quantize.py: the same bytes,
    several times faster), any other by the torch reference."""
    check_quantize_input(w, "q8_0")
    if w.device.type != "cpu":
        return quantize_q8_0_reference(w)
    from hybridmoe.kernels.numba_quantize import quantize

    return quantize("q8_0", w)


def quantize_q8_0_reference(w: torch.Tensor) -> torch.Tensor:
    """The torch reference of quantize_q8_0, in chunks (any device)."""
    return quantize_blocks(w, "q8_0", BLOCK_BYTES, _quantize_chunk)


def dequantize_q8_0(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 q [..., nb * 34] -> new contiguous dtype [..., nb * 32], weight = fp16(d) * q,
    computed in fp32 (exact) then cast to dtype."""
    return dequantize_blocks(q, "q8_0", BLOCK_BYTES, _dequantize_chunk, dtype)


def q8_0_blocks_f32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 x [b, 32] (finite) -> (d float32 [b], q int8 [b, 32]): ggml's Q8_0 of each
    block before its scale is stored as fp16 (quantize_row_q8_0_ref: d = max|x| / 127,
    q = roundf(x * (1 / d)), halves away from zero). Does not modify x."""
    d, q = _quantize_chunk(x)
    return d[:, 0], q.view(torch.int8)


def _int8_blocks(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 q [..., nb * 34] -> (int8 [..., nb, 32], float32 scales [..., nb])."""
    blocks = q.reshape(-1, BLOCK_BYTES)  # [B, 34]
    scales = block_scales(blocks)[:, 0].reshape(*q.shape[:-1], -1)
    values = blocks[:, 2:].view(torch.int8).reshape(*q.shape[:-1], -1, BLOCK_SIZE)
    return values, scales


def _quantize_chunk(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.abs().amax(dim=1, keepdim=True) / 127  # [b, 1]; nan/inf propagate to d
    inv_d = torch.where(d == 0, 0.0, 1.0 / d)  # [b, 1]; ggml: id = d ? 1.0f/d : 0.0f
    q = _round_half_away_from_zero(x * inv_d)  # [b, 32] int8, in [-127, 127]
    return d, q.view(torch.uint8)


def _dequantize_chunk(blocks: torch.Tensor) -> torch.Tensor:
    q = blocks[:, 2:].view(torch.int8)  # [b, 32]
    return q.to(torch.float32) * block_scales(blocks)  # [b, 32]; exact: 11 x 8 bit product


def _round_half_away_from_zero(v: torch.Tensor) -> torch.Tensor:
    """C's roundf for |v| < 2^23, as int8 (torch.round rounds half to even). v + copysign(h, v)
    with h = 0.5 - 2^-25, the float just below 1/2, then truncation: a fraction of exactly 1/2
    gives at least |n| + 1 - 2^-25, which rounds up to |n| + 1 (at 1 - 2^-25 a tie, to even
    1.0); a smaller fraction stays below |n| + 1. Adding 0.5 instead would be wrong for
    v = 0.5 - 2^-25: the sum 1 - 2^-25 rounds to 1.0. Modifies v."""
    half_down = torch.tensor(0.5 - 2.0**-25, dtype=v.dtype)
    return v.add_(torch.copysign(half_down, v)).to(torch.int8)  # the cast truncates, as C's


def _dequantize_block_ir(builder, block):
    """LLVM IR: the weights d * q of the block at byte pointer `block`, <32 x float>."""
    from hybridmoe.kernels import llvm_ir as ll

    scale = ll.splat(builder, ll.fp16_scale(builder, block))
    quants = ll.load(builder, builder.gep(block, [ll.i64(2)]), ll.vector(ll.I8, 32))
    return builder.fmul(builder.sitofp(quants, ll.V32F), scale)


def _int8_block_ir(builder, block):
    """LLVM IR: (q <32 x i8>, byte pointer to the fp16 d) of the block at byte pointer
    `block`."""
    from hybridmoe.kernels import llvm_ir as ll

    return ll.load(builder, builder.gep(block, [ll.i64(2)]), ll.vector(ll.I8, 32)), block


Q8_0 = register_format(
    WeightFormat(
        "q8_0",
        BLOCK_SIZE,
        BLOCK_BYTES,
        torch.uint8,
        quantize_q8_0,
        dequantize_q8_0,
        KernelFormat("q8_0", BLOCK_BYTES, _dequantize_block_ir, int8_block_ir=_int8_block_ir),
        scale_offsets=(0,),
        int8_blocks_fn=_int8_blocks,
    )
)
