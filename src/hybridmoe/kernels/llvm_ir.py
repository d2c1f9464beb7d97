"""LLVM IR building blocks shared by the CPU kernels (numba_simd.py) and the formats' own block
dequantisers (`KernelFormat.dequantize_block_ir` in quant/), which import this module lazily,
when numba compiles a kernel, so that `import hybridmoe.quant` needs no llvmlite.

A 32-weight block dequantises into one <32 x float> register (`V32F`); a k-quant super-block
into eight of them, one per 32-weight piece, each built as two halves of 16 (`halves`: one
AVX-512 register each) from bytes widened to 32-bit lanes or converted half by half, times its
sub-block's scale broadcast from a `ScaleTable` (a register shuffle per piece cost more than
the rest of the piece on AVX-512).
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


def pairwise_sum(builder: ir.IRBuilder, vec: ir.Value, width: int) -> ir.Value:
    """The float sum of a vector's `width` lanes (a power of two) by a pairwise tree: the
    upper half added to the lower, then the upper half of that, ..., to one lane."""
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(vec, vec, const_vec(I32, list(range(width))))
        hi = builder.shuffle_vector(vec, vec, const_vec(I32, list(range(width, 2 * width))))
        vec = builder.fadd(lo, hi)
    return builder.extract_element(vec, ir.Constant(I32, 0))


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


def scaled(builder: ir.IRBuilder, values: ir.Value, scale: ir.Value) -> ir.Value:
    """Float scale * values (ints, signed), a vector of the scale's width."""
    return builder.fmul(builder.sitofp(values, scale.type), scale)


V16F, V16I = ir.VectorType(F32, 16), ir.VectorType(I32, 16)


def widened_bytes(builder: ir.IRBuilder, ptr: ir.Value) -> ir.Value:
    """The 16 bytes at byte pointer `ptr`, zero-extended to <16 x i32>: one vpmovzxbd from
    memory on AVX-512, whose lanes then take shifts and masks without cross-lane shuffles."""
    return builder.zext(load(builder, ptr, vector(I8, 16)), V16I)


def halves(builder: ir.IRBuilder, lo: ir.Value, hi: ir.Value) -> ir.Value:
    """<32 x float> of two <16 x float> (lanes 0..15 `lo`, 16..31 `hi`): free once the
    backend splits the 32 lanes into registers again."""
    return builder.shuffle_vector(lo, hi, const_vec(I32, list(range(32))))


class ScaleTable:
    """A super-block's decoded sub-block scales kept on the stack, each read back as a
    broadcast (one load-port uop on x86, instead of a register shuffle per piece)."""

    def __init__(self, builder: ir.IRBuilder, scales: ir.Value) -> None:
        from numba.core import cgutils

        self.builder = builder
        self.slot = cgutils.alloca_once(builder, scales.type)
        builder.store(scales, self.slot, align=4)
        # an empty asm that may read the slot: LLVM keeps the stores and reloads each scale
        barrier = ir.InlineAsm(
            ir.FunctionType(ir.VoidType(), [self.slot.type]), "", "r,~{memory}", side_effect=True
        )
        builder.call(barrier, [self.slot])

    def splat(self, index: int, count: int = 16) -> ir.Value:
        """Scale `index` in all `count` lanes."""
        ptr = self.builder.gep(self.builder.bitcast(self.slot, F32.as_pointer()), [i32(index)])
        return splat(self.builder, self.builder.load(ptr, align=4), count)


def lookup16(builder: ir.IRBuilder, table: ir.Value, index: ir.Value) -> ir.Value:
    """<16 x float>: lane i = table[index[i] & 15] (table <16 x float>, index <16 x i32>; the
    higher bits of each index are ignored): one AVX-512 vpermps. Only for targets with
    avx512f (target_has)."""
    fn = declare(builder, "llvm.x86.avx512.permvar.sf.512", V16F, [V16F, V16I])
    return builder.call(fn, [table, index])


def scaled_halves(
    builder: ir.IRBuilder,
    values: ir.Value,
    table: ScaleTable,
    scale_at: tuple[int, int],
    low_at: tuple[int, int] | None = None,
    signed: bool = False,
) -> ir.Value:
    """<32 x float> of 32 integers `values` (<32 x i8>, signed or not): each half h of 16 lanes
    times scale `scale_at[h]` of `table`, less its entry `low_at[h]` when given (a sub-block of
    16 weights a half; two of 32 give the same index twice)."""
    convert = builder.sitofp if signed else builder.uitofp
    parts = []
    for h in range(2):
        part = builder.shuffle_vector(
            values, values, const_vec(I32, list(range(16 * h, 16 * h + 16)))
        )
        w = builder.fmul(convert(part, V16F), table.splat(scale_at[h]))
        parts.append(w if low_at is None else builder.fsub(w, table.splat(low_at[h])))
    return halves(builder, *parts)
