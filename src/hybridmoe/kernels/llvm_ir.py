"""LLVM IR building blocks shared by the CPU kernels (numba_simd.py) and the formats' own block
dequantisers (`KernelFormat.dequantize_block_ir` in quant/), which import this module lazily,
when numba compiles a kernel, so that `import hybridmoe.quant` needs no llvmlite.

A 32-weight block dequantises into one <32 x float> register (`V32F`).
"""

from __future__ import annotations

from llvmlite import ir

F32, I8, I16, I32, I64 = ir.FloatType(), *(ir.IntType(n) for n in (8, 16, 32, 64))
V32F = ir.VectorType(F32, 32)


def const_vec(elem: ir.Type, values: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(elem, len(values)), values)


def vector(elem: ir.Type, lanes: int) -> ir.VectorType:
    return ir.VectorType(elem, lanes)


def i32(value: int) -> ir.Constant:
    return ir.Constant(I32, value)


def i64(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


def load(builder: ir.IRBuilder, ptr: ir.Value, ty: ir.Type, align: int = 1) -> ir.Value:
    """A `ty` read at byte pointer `ptr` (unaligned unless `align` says otherwise)."""
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=align)


def splat(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """The float `value` in all 32 lanes of a <32 x float>."""
    one = builder.insert_element(ir.Constant(V32F, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(V32F, ir.Undefined), const_vec(I32, [0] * 32))


def fp16_scale(builder: ir.IRBuilder, ptr: ir.Value) -> ir.Value:
    """The little-endian fp16 at byte pointer `ptr`, as a float (GGUF's block scales)."""
    bits = load(builder, ptr, I16)
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), F32)
