"""LLVM vector code for the decode attention kernel's softmax (kernels/numba_attention.py):
a block's max, its weights exp(s - max) (rounded to bfloat16 values for a bfloat16 cache) and
their sum, over a block of float32 scores in vectors of attention_ir.lanes() floats, the tail
element by element with the same arithmetic (a score's weight does not depend on its lane).

exp is Cephes' expf (reduction by n ln2 in two parts, a degree-5 polynomial; within 2 ulp of
the exact value for the arguments here, x <= 0): torch's flash attention uses its own
vectorised exp, so the weights' last bits are not torch's either way; the kernel's tolerance
(numba_attention) covers it. Sums: the lanes in ascending chunk order, then
llvm_ir.pairwise_sum's tree, then the tail in order.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hybridmoe.kernels.attention_ir import array_data, fmuladd, int_args, lanes
from hybridmoe.kernels.llvm_ir import F32, I32, const_vec, declare, i64, pairwise_sum, splat, vector

# expf by Cephes' reduction and polynomial (within 2 ulp): x = n ln2 + r, |r| <= ln2 / 2,
# exp(r) ~ 1 + r + r^2 P(r), times 2^n by the exponent's bits; x below EXP_MIN gives 0
EXP_MIN = -87.33654  # ~ ln(2^-126): 2^n stays a normal float
_LN2_HI, _LN2_LO, _LOG2E = 0.693359375, -2.12194440e-4, 1.44269504088896341
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
             1.6666665459e-1, 5.0000001201e-1)  # fmt: skip


def _const(ty: ir.Type, value: float | int) -> ir.Constant:
    """`value` in every lane of `ty` (or the scalar of type `ty`)."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [value] * ty.count)
    return ir.Constant(ty, value)


def _int_type(ty: ir.Type) -> ir.Type:
    return vector(I32, ty.count) if isinstance(ty, ir.VectorType) else I32


def exp_ir(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """exp(x) of a float or float vector x <= 0 (lane by lane the same arithmetic, so a value's
    exp does not depend on its lane); 0 below EXP_MIN and for -inf."""
    ty = x.type
    floor = declare(builder, f"llvm.floor.{_suffix(ty)}", ty, [ty])
    safe = builder.select(builder.fcmp_ordered(">=", x, _const(ty, EXP_MIN)), x, _const(ty, 0.0))
    n = builder.call(floor, [fmuladd(builder, safe, _const(ty, _LOG2E), _const(ty, 0.5))])
    r = fmuladd(builder, n, _const(ty, -_LN2_HI), safe)
    r = fmuladd(builder, n, _const(ty, -_LN2_LO), r)
    poly = _const(ty, _EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        poly = fmuladd(builder, poly, r, _const(ty, c))
    r2 = builder.fmul(r, r)
    e = builder.fadd(fmuladd(builder, poly, r2, r), _const(ty, 1.0))
    ity = _int_type(ty)
    power = builder.shl(builder.add(builder.fptosi(n, ity), _const(ity, 127)), _const(ity, 23))
    e = builder.fmul(e, builder.bitcast(power, ty))
    return builder.select(builder.fcmp_ordered(">=", x, _const(ty, EXP_MIN)), e, _const(ty, 0.0))


def _suffix(ty: ir.Type) -> str:
    return f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else "f32"


def round_bf16_ir(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """x (float or float vector) rounded to a bfloat16 value, nearest, ties to even (torch's
    cast); inf and nan kept."""
    ity = _int_type(x.type)
    b = builder.bitcast(x, ity)
    odd = builder.and_(builder.lshr(b, _const(ity, 16)), _const(ity, 1))
    rounded = builder.and_(
        builder.add(b, builder.add(odd, _const(ity, 0x7FFF))), _const(ity, -65536)
    )
    special = builder.icmp_unsigned(
        "==", builder.and_(b, _const(ity, 0x7F800000)), _const(ity, 0x7F800000)
    )
    return builder.bitcast(builder.select(special, b, rounded), x.type)


def _block_codegen(width: int, mode: str):
    """mode "max": the max of s[first:][:n] and init; "exp": s[first + j] = exp(s - top), rounded
    when asked, returning the sum of the unrounded values."""

    def codegen(context, builder, sig, args):
        s, _, _, value, *flag = args
        first, n = int_args(context, builder, sig, args, "-ii" + "-" * (len(args) - 3))
        data = builder.gep(array_data(context, builder, sig.args[0], s), [first])
        vec = vector(F32, width)
        round_p = context.cast(builder, flag[0], sig.args[4], types.boolean) if flag else None
        if mode == "max":
            start = splat(builder, value, width)
        else:
            start = ir.Constant(vec, None)
        total = cgutils.alloca_once(builder, vec)
        builder.store(start, total)
        chunks = builder.udiv(n, i64(width))
        tail_start = builder.mul(chunks, i64(width))

        def step(at, count, acc):
            ptr = builder.gep(data, [at])
            if count > 1:
                ptr = builder.bitcast(ptr, vec.as_pointer())
            x = builder.load(ptr, align=4)
            if mode == "max":
                return builder.select(builder.fcmp_ordered(">", x, acc), x, acc)
            top = value if count == 1 else splat(builder, value, width)
            e = exp_ir(builder, builder.fsub(x, top))
            builder.store(builder.select(round_p, round_bf16_ir(builder, e), e), ptr, align=4)
            return builder.fadd(acc, e)

        with cgutils.for_range(builder, chunks) as chunk:
            at = builder.mul(chunk.index, i64(width))
            builder.store(step(at, width, builder.load(total)), total)
        if mode == "max":
            lanes_value = _tree(builder, builder.load(total), width, "max")
        else:
            lanes_value = pairwise_sum(builder, builder.load(total), width)
        result = cgutils.alloca_once(builder, F32)
        builder.store(lanes_value, result)
        with cgutils.for_range(builder, builder.sub(n, tail_start)) as rest:
            at = builder.add(tail_start, rest.index)
            builder.store(step(at, 1, builder.load(result)), result)
        return builder.load(result)

    return codegen


def _tree(builder: ir.IRBuilder, vec: ir.Value, width: int, mode: str) -> ir.Value:
    """The max of a vector's `width` lanes (a power of two), halves against halves."""
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(vec, vec, const_vec(I32, list(range(width))))
        hi = builder.shuffle_vector(vec, vec, const_vec(I32, list(range(width, 2 * width))))
        vec = builder.select(builder.fcmp_ordered(">", hi, lo), hi, lo)
    return builder.extract_element(vec, ir.Constant(I32, 0))


@intrinsic
def block_max(typingctx, s, first, n, init):
    """max(init, s[first:][:n]) of a flat float32 array (a nan is skipped)."""
    if not (isinstance(s, types.Array) and s.dtype == types.float32 and init == types.float32):
        return None
    return types.float32(s, first, n, init), _block_codegen(lanes(), "max")


@intrinsic
def exp_block(typingctx, s, first, n, top, round_p):
    """s[first + j] = exp_ir(s[first + j] - top) for j < n, rounded to bfloat16 values when
    `round_p`; returns the float32 sum of the unrounded values (lanes by pairwise_sum's tree,
    then the tail in order)."""
    if not (isinstance(s, types.Array) and s.dtype == types.float32 and top == types.float32):
        return None
    return types.float32(s, first, n, top, round_p), _block_codegen(lanes(), "exp")
