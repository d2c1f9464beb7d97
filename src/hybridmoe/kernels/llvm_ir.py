"""LLVM IR building blocks shared by the CPU kernels (numba_simd.py) and the formats' own block
dequantisers (`KernelFormat.dequantize_block_ir` in quant/), which import this module lazily,
when numba compiles a kernel, so that `import hybridmoe.quant` needs no llvmlite.

A 32-weight block dequantises into one <32 x float> register (`V32F`); a k-quant super-block
into eight of them, one per 32-weight piece.
"""

from __future__ import annotations

from llvmlite import ir

F32, I8, I16, I32, I64 = ir.FloatType(), *(ir.IntType(n) for n in (8, 16, 32, 64))
HALF = ir.HalfType()
V32F = ir.VectorType(F32, 32)


def target_has(feature: str) -> bool:
    """Whether the CPU numba compiles for has the LLVM feature `feature` ("avx2"): the host's,
    or those NUMBA_CPU_FEATURES names (numba's own choice; its on-disk cache is keyed on them),
    so IR using a target's intrinsics is only emitted where they run."""
    from numba.core import config
    from numba.core.codegen import get_host_cpu_features

    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    return f"+{feature}" in features.split(",")


def declare(builder: ir.IRBuilder, name: str, ret: ir.Type, params: list[ir.Type]) -> ir.Function:
    """The function `name` (an LLVM intrinsic) of type ret(params), declared once a module."""
    module = builder.module
    fnty = ir.FunctionType(ret, params)
    return module.globals.get(name) or ir.Function(module, fnty, name)


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


def splat(builder: ir.IRBuilder, value: ir.Value, count: int = 32) -> ir.Value:
    """The float `value` in all `count` lanes of a <count x float> (default <32 x float>)."""
    vec = ir.Constant(ir.VectorType(value.type, count), ir.Undefined)
    one = builder.insert_element(vec, value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, vec, const_vec(I32, [0] * count))


def fp16_scale(builder: ir.IRBuilder, ptr: ir.Value) -> ir.Value:
    """The little-endian fp16 at byte pointer `ptr`, as a float (GGUF's block scales)."""
    bits = load(builder, ptr, I16)
    return builder.fpext(builder.bitcast(bits, HALF), F32)


def lanes(builder: ir.IRBuilder, vec: ir.Value, indices: list[int]) -> ir.Value:
    """A vector of vec's lanes `indices` (a lane may repeat: a splat of one sub-block's scale
    over its weights)."""
    return builder.shuffle_vector(vec, vec, const_vec(I32, indices))


def bits(
    builder: ir.IRBuilder, vec: ir.Value, shift: int | list[int], mask: int | list[int]
) -> ir.Value:
    """(vec >> shift) & mask, lane by lane, unsigned: a bit field of each packed byte; `shift`
    and `mask` one value for all lanes or one per lane."""
    count, elem = vec.type.count, vec.type.element
    shifts = shift if isinstance(shift, list) else [shift] * count
    masks = mask if isinstance(mask, list) else [mask] * count
    shifted = builder.lshr(vec, const_vec(elem, shifts)) if any(shifts) else vec
    return builder.and_(shifted, const_vec(elem, masks))


def shl(builder: ir.IRBuilder, vec: ir.Value, shift: int) -> ir.Value:
    """vec << shift, every lane."""
    return builder.shl(vec, const_vec(vec.type.element, [shift] * vec.type.count))


def offset(builder: ir.IRBuilder, ptr: ir.Value, nbytes: int) -> ir.Value:
    """The byte pointer `nbytes` past `ptr`."""
    return builder.gep(ptr, [i64(nbytes)]) if nbytes else ptr


def sub_block_scale(builder: ir.IRBuilder, scales: ir.Value, piece: int) -> ir.Value:
    """<32 x float> of a 32-weight piece from per-sub-block `scales`: <8 x float> (sub-blocks
    of 32: scale `piece` in every lane) or <16 x float> (sub-blocks of 16: scale 2 piece in
    lanes 0..15, 2 piece + 1 in lanes 16..31)."""
    if scales.type.count == 8:
        return lanes(builder, scales, [piece] * 32)
    return lanes(builder, scales, [2 * piece] * 16 + [2 * piece + 1] * 16)


def scaled(builder: ir.IRBuilder, values: ir.Value, scale: ir.Value) -> ir.Value:
    """Float scale * values (ints, signed), a vector of the scale's width."""
    return builder.fmul(builder.sitofp(values, scale.type), scale)
