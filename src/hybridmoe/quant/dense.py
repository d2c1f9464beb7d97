"""The unquantised formats f32, bf16 and f16: one weight a block, stored as the float itself;
quantising is a cast (round to nearest even for bf16 and f16, as ggml's and gguf's
conversions) and dequantising is exact. In the CPU
kernels a row may end in part of a 32-weight block: that tail is read weight by weight.
"""

from __future__ import annotations

from functools import partial

import torch

from hybridmoe.quant.formats import (
    KERNEL_BLOCK,
    DequantizeBlockIR,
    KernelFormat,
    LoadWeightIR,
    WeightFormat,
    register_format,
)

__all__ = ["BF16", "F16", "F32"]


def _cast(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return w.to(dtype).contiguous()


def _f32_block_ir(builder, block):
    from hybridmoe.kernels import llvm_ir as ll

    return ll.load(builder, block, ll.V32F)


def _f32_weight_ir(builder, ptr):
    from hybridmoe.kernels import llvm_ir as ll

    return ll.load(builder, ptr, ll.F32)


def _bf16_block_ir(builder, block):
    """bf16 is the high half of an fp32: widen each value and shift it up."""
    from hybridmoe.kernels import llvm_ir as ll

    raw = builder.zext(ll.load(builder, block, ll.vector(ll.I16, 32)), ll.vector(ll.I32, 32))
    return builder.bitcast(builder.shl(raw, ll.const_vec(ll.I32, [16] * 32)), ll.V32F)


def _bf16_weight_ir(builder, ptr):
    from hybridmoe.kernels import llvm_ir as ll

    wide = builder.zext(ll.load(builder, ptr, ll.I16), ll.I32)
    return builder.bitcast(builder.shl(wide, ll.i32(16)), ll.F32)


def _f16_block_ir(builder, block):
    """fp16 widens exactly to fp32 (vcvtph2ps)."""
    from hybridmoe.kernels import llvm_ir as ll

    return builder.fpext(ll.load(builder, block, ll.vector(ll.HALF, 32)), ll.V32F)


def _f16_weight_ir(builder, ptr):
    from hybridmoe.kernels import llvm_ir as ll

    return ll.fp16_scale(builder, ptr)


def _dense(
    name: str, dtype: torch.dtype, block_ir: DequantizeBlockIR, weight_ir: LoadWeightIR
) -> WeightFormat:
    kernel = KernelFormat(name, KERNEL_BLOCK * dtype.itemsize, block_ir, weight_ir)
    cast = partial(_cast, dtype=dtype)
    return WeightFormat(name, 1, dtype.itemsize, dtype, cast, _cast, kernel)


F32 = register_format(_dense("f32", torch.float32, _f32_block_ir, _f32_weight_ir))
BF16 = register_format(_dense("bf16", torch.bfloat16, _bf16_block_ir, _bf16_weight_ir))
F16 = register_format(_dense("f16", torch.float16, _f16_block_ir, _f16_weight_ir))
