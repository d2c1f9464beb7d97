"""MXFP4 (OCP microscaling FP4) as GGUF/ggml stores it (type MXFP4, 39): blocks of 32 weights in
17 bytes, one E8M0 exponent byte e, then 16 bytes of 4-bit E2M1 codes; byte j holds weight j
in its low nibble and weight j + 16 in its high nibble (as q4_0). A code is sign (bit 3) and
magnitude (bits 0-2) {0, 0.5, 1, 1.5, 2, 3, 4, 6}; weight = value * 2^(e - 127).

Computed as ggml does (gguf.quants.MXFP4, ggml_e8m0_to_fp32_half): the doubled magnitudes
{0, 1, 2, 3, 4, 6, 8, 12} (integers) times the half scale 2^(e - 128), one exact fp32 product.
So every byte e is a finite scale (2^-128 .. 2^127; e = 255 is not OCP's NaN), a weight is
inf only where value * 2^(e - 127) reaches 2^128 (e >= 253), and code 8 (-0) reads as +0.0,
as gguf's.

Quantisation is ggml's `quantize_row_mxfp4_ref` (OCP's rule): e = floor(log2(max |x|)) - 2
+ 127, so max |x| / 2^(e - 127) lies in [4, 8) and values beyond 6 clip to 6; each weight is
rounded to the nearest code, ties to the smaller magnitude (ggml's first best code), -0 and
values rounding to 0 as code 0. The exponent comes from torch.frexp (exact), not log2f; a block
whose max |x| is below 2^-125 gets e = 0 (gguf's numpy wraps its exponent below 0 around).

The Hugging Face layout (gpt-oss's `*_blocks` and `*_scales`) holds the same codes and
exponents, apart and with another nibble order: `bank_from_hf_mxfp4` rearranges them into
these blocks, without dequantising.
"""

from __future__ import annotations

import torch

from hybridmoe.quant._blocks import (
    BLOCK_SIZE,
    CHUNK_BLOCKS,
    check_quantize_input,
    dequantize_blocks,
    quantize_blocks,
)
from hybridmoe.quant.formats import KernelFormat, WeightFormat, register_format

__all__ = ["BLOCK_BYTES", "MXFP4", "dequantize_mxfp4", "e8m0_half", "quantize_mxfp4"]

BLOCK_BYTES = 17  # E8M0 e + 16 bytes of E2M1 nibbles
_HALF = BLOCK_SIZE // 2
# doubled magnitudes 1, 2, 3, 4, 6, 8, 12 and the midpoints between neighbours: |x| / half
# scale above the k-th midpoint is at least magnitude code k + 1 (at it: the smaller, ggml's)
_MIDPOINTS = (0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0)


def quantize_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """Float w [..., n] (any float dtype, n a multiple of 32, all finite) -> new contiguous
    uint8 [..., n // 32 * 17]; the torch reference, any device. Does not modify w. ValueError
    for a bad n or a non-finite weight (naming its row)."""
    check_quantize_input(w, "mxfp4")
    _check_finite(w, "quantize_mxfp4")
    return quantize_blocks(w, "mxfp4", BLOCK_BYTES, _quantize_chunk)


def dequantize_mxfp4(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 q [..., nb * 17] -> new contiguous dtype [..., nb * 32], weight = doubled E2M1
    magnitude (signed) * 2^(e - 128), exact in fp32 (gguf's values), then cast to dtype."""
    return dequantize_blocks(q, "mxfp4", BLOCK_BYTES, _dequantize_chunk, dtype)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """Exponent bytes e (uint8, any shape) -> fp32 2^(e - 128), built from its bits as ggml's
    ggml_e8m0_to_fp32_half: subnormal for e < 2, so exact for every byte."""
    bits = e.to(torch.int32)
    subnormal = torch.full_like(bits, 0x00200000) << bits.clamp(max=1)  # 2^-128, 2^-127
    return torch.where(bits < 2, subnormal, (bits - 1) << 23).view(torch.float32)


def doubled_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 in [0, 15], any shape) -> their doubled values as int8: magnitude code
    m in 0..3 is itself, m = 4, 5 gives 2 (m - 2), m = 6, 7 gives 4 (m - 4); bit 3 the sign.
    Plain arithmetic, no table: nothing is copied to the device (graph capture forbids that)."""
    m = (codes & 7).to(torch.int8)
    mag = torch.where(m < 4, m, torch.where(m < 6, (m - 2) * 2, (m - 4) * 4))
    return torch.where(codes >= 8, -mag, mag)


def _dequantize_chunk(blocks: torch.Tensor) -> torch.Tensor:
    qs = blocks[:, 1:]  # [b, 16]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # [b, 32]: weights 0..15 then 16..31
    if codes.device.type == "cpu":  # a gather from the table: ~4x the arithmetic's speed here
        values = _DOUBLED_CPU[codes.long()]
    else:  # no table to copy to the device: graph capture forbids that copy
        values = doubled_values(codes).to(torch.float32)
    return values * e8m0_half(blocks[:, :1])  # [b, 32]


_DOUBLED_CPU = doubled_values(torch.arange(16, dtype=torch.uint8)).to(torch.float32)  # [16]


def _quantize_chunk(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, 32] fp32 -> (no fp16 scales [b, 0], the whole blocks [b, 17]): the E8M0 byte is
    part of the payload."""
    amax = x.abs().amax(dim=1, keepdim=True)  # [b, 1]
    _, exponent = torch.frexp(amax)  # amax = m 2^exponent, m in [0.5, 1): floor(log2) + 1
    e = torch.where(amax > 0, (exponent + 124).clamp(0, 254), 0)  # [b, 1] int32
    half = e8m0_half(e)  # [b, 1]: 2^(e - 128), exact
    a = x.abs()  # |x| against half * midpoint: exact products, so the ties are exact
    mag = sum((a > half * m).to(torch.uint8) for m in _MIDPOINTS)  # [b, 32] in [0, 7]
    codes = mag | ((x < 0) & (mag > 0)).to(torch.uint8) << 3  # [b, 32]
    packed = codes[:, :_HALF] | (codes[:, _HALF:] << 4)  # [b, 16]
    return x.new_empty(x.shape[0], 0), torch.cat([e.to(torch.uint8), packed], dim=1)


def _check_finite(w: torch.Tensor, what: str) -> None:
    """ValueError naming the first row [..., n] of w holding inf or nan (an fp16-scale format
    finds it in its scale; an E8M0 exponent would not show it), a chunk of rows at a time."""
    rows = w.reshape(-1, w.shape[-1])  # [R, n]
    step = max(1, CHUNK_BLOCKS * BLOCK_SIZE // max(1, rows.shape[1]))
    for start in range(0, rows.shape[0], step):
        bad = ~rows[start : start + step].isfinite().all(dim=1)
        if bad.any():
            row = start + int(bad.nonzero()[0])
            raise ValueError(f"{what}: the input's row {row} has a non-finite weight (inf or nan)")


def doubled_values_ir(builder, codes):
    """LLVM IR: E2M1 codes (<32 x i8> in [0, 15]) -> their doubled values (<32 x i8>, signed),
    doubled_values' arithmetic in selects over i8 lanes (any CPU)."""
    from hybridmoe.kernels import llvm_ir as ll

    def splat8(value: int):
        return ll.const_vec(ll.I8, [value] * 32)

    m = builder.and_(codes, splat8(7))
    two = ll.shl(builder, builder.sub(m, splat8(2)), 1)  # m 4, 5 -> 4, 6
    four = ll.shl(builder, builder.sub(m, splat8(4)), 2)  # m 6, 7 -> 8, 12
    high = builder.select(builder.icmp_unsigned("<", m, splat8(6)), two, four)
    mag = builder.select(builder.icmp_unsigned("<", m, splat8(4)), m, high)
    negative = builder.icmp_unsigned(">=", codes, splat8(8))
    return builder.select(negative, builder.neg(mag), mag)


def doubled_values_pshufb_ir(builder, codes):
    """LLVM IR: doubled_values_ir in one AVX2 byte shuffle (vpshufb) of the 16 doubled values,
    the table in both 128-bit halves."""
    from hybridmoe.kernels import llvm_ir as ll

    v32i8 = ll.vector(ll.I8, 32)
    table = [int(v) for v in doubled_values(torch.arange(16, dtype=torch.uint8))] * 2
    pshufb = ll.declare(builder, "llvm.x86.avx2.pshuf.b", v32i8, [v32i8, v32i8])
    return builder.call(pshufb, [ll.const_vec(ll.I8, table), codes])


def e8m0_half_ir(builder, ptr):
    """LLVM IR: the float 2^(e - 128) of the exponent byte at byte pointer `ptr` (e8m0_half)."""
    from hybridmoe.kernels import llvm_ir as ll

    e = builder.zext(ll.load(builder, ptr, ll.I8), ll.I32)
    normal = builder.shl(builder.sub(e, ll.i32(1)), ll.i32(23))
    one_bit = builder.and_(e, ll.i32(1))  # e < 2: shift 0x00200000 by e itself
    subnormal = builder.shl(ll.i32(0x00200000), one_bit)
    bits = builder.select(builder.icmp_unsigned("<", e, ll.i32(2)), subnormal, normal)
    return builder.bitcast(bits, ll.F32)


def dequantize_block_ir(builder, block, values_ir=None):
    """LLVM IR: the weights of the block at byte pointer `block`, <32 x float>: its doubled
    E2M1 values (`values_ir`; None: a lookup in the block's table of the 16 products where the
    target CPU has AVX-512, else the byte shuffle where it has AVX2, else the selects) times
    2^(e - 128), the reference's exact product."""
    from hybridmoe.kernels import llvm_ir as ll

    if values_ir is None and ll.target_has("avx512f"):
        doubled = doubled_values(torch.arange(16, dtype=torch.uint8)).tolist()
        levels = ll.ir.Constant(ll.V16F, [float(v) for v in doubled])
        table = builder.fmul(levels, ll.splat(builder, e8m0_half_ir(builder, block), 16))
        return ll.nibble_lookup(builder, ll.offset(builder, block, 1), table)
    if values_ir is None:
        values_ir = doubled_values_pshufb_ir if ll.target_has("avx2") else doubled_values_ir
    scale = ll.splat(builder, e8m0_half_ir(builder, block))
    packed = ll.load(builder, ll.offset(builder, block, 1), ll.vector(ll.I8, 16))
    low = builder.and_(packed, ll.const_vec(ll.I8, [0xF] * 16))  # weights 0..15
    high = builder.lshr(packed, ll.const_vec(ll.I8, [4] * 16))  # weights 16..31
    codes = builder.shuffle_vector(low, high, ll.const_vec(ll.I32, list(range(32))))
    return ll.scaled(builder, values_ir(builder, codes), scale)


def dequantize_block_selects_ir(builder, block):
    """dequantize_block_ir with the portable selects whatever the CPU (what tests compare)."""
    return dequantize_block_ir(builder, block, doubled_values_ir)


MXFP4 = register_format(
    WeightFormat(
        "mxfp4",
        BLOCK_SIZE,
        BLOCK_BYTES,
        torch.uint8,
        quantize_mxfp4,
        dequantize_mxfp4,
        KernelFormat("mxfp4", BLOCK_BYTES, dequantize_block_ir),
        scale_offsets=(0,),
        scale_dtype=torch.float8_e8m0fnu,
    )
)
