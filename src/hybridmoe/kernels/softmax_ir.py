"""LLVM vector code for the decode attention kernel's softmax (kernels/numba_attention.py), as
torch's CPU flash attention computes it (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp,
`_mul_reduce_max_fusion_kernel` and `_exp_reduce_sum_fusion_kernel`) over one of its key
blocks of float32 scores, with `lanes` the float32 lanes of torch's Vectorized<float> (16 on
its AVX512 build, 8 on AVX2; kernels/glue.softmax_lanes):

- the block's first `whole` = n - n % lanes scores are its vector part, exp by torch's vector
  exp, `fexp_u20` for a bfloat16 attention (a degree-3 polynomial of 2^x's fraction, built
  into the exponent bits; within one bfloat16 ulp) and `exp_u20` for float32 (Cephes'
  reduction, a degree-5 polynomial), summed per lane as torch's loops do: in float32 one
  vector of sums over chunks of `lanes` scores; in bfloat16 the first loop steps by two
  float vectors (one bfloat16 vector) to n - n % (2 lanes), a sum vector for each half, and
  a last single chunk, if any, has a third; then the first + the third + the second, lane by
  lane, and the lanes add by vec_reduce_all's tree (llvm_ir.pairwise_sum);
- the last n % scores are its tail: exp by libm's expf (std::exp), added one by one after;
- each exp is stored in place of its score, rounded to a bfloat16 value for a bfloat16
  attention (torch stores them in a bfloat16 buffer), the sum is of the unrounded ones.

Both exps are restated instruction for instruction (fused multiply-adds where torch's are,
llvm.floor for its floor/round-down conversion, truncation for cvttps), so their bits are
torch's: tests/layers/test_decode_attention.py holds the kernel to SDPA's bfloat16 output bit
for bit where numba_attention.gives_sdpa_bits says the machine's SDPA is reproduced (one exp
off in its last bit changes some outputs of every long row).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hybridmoe.kernels.attention_ir import array_data, int_args
from hybridmoe.kernels.attention_ir import fma as _fma
from hybridmoe.kernels.llvm_ir import F32, I32, const_vec, declare, i64, pairwise_sum, splat, vector

MODES = (8, 9, 16, 17)  # exp_block's literal: torch's lanes, + 1 for bfloat16 (fexp_u20)


def _f32(bits: int) -> float:
    return float(np.uint32(bits).view(np.float32))


LN_FLT_MIN, LN_FLT_MAX = _f32(0xC2AEAC50), _f32(0x42B17218)  # ~ ln of float's min and max
LOG2E, LN2 = _f32(0x3FB8AA3B), _f32(0x3F317218)
# exp_u20's polynomial of r = x - n ln2: 1 + r (F1 + r (F2 + ...)), then times 2^(n-1) and 2
_U20 = tuple(float(np.float32(c)) for c in (0.00828929059, 0.0418978221, 0.166676521,
                                             0.499991506, 0.999999701, 1.0))  # fmt: skip
# fexp_u20's polynomial of the fraction f of x log2(e): c0 + f (c1 + f (c2 + f c3))
_FEXP = tuple(
    float(np.float32(c))
    for c in (
        -0.079204240219773236,
        -0.22433836478672356,
        0.30354260500649682,
        1.0703434948458272e-4,
    )
)
_FEXP_A, _FEXP_B = float(np.float32(2.0**23)), float(np.float32(2.0**23 * 127))


def _const(ty: ir.Type, value: float | int) -> ir.Constant:
    """`value` in every lane of `ty` (or the scalar of type `ty`)."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [value] * ty.count)
    return ir.Constant(ty, value)


def _int_type(ty: ir.Type) -> ir.Type:
    return vector(I32, ty.count) if isinstance(ty, ir.VectorType) else I32


def _suffix(ty: ir.Type) -> str:
    return f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else "f32"


def _floor(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    ty = x.type
    return builder.call(declare(builder, f"llvm.floor.{_suffix(ty)}", ty, [ty]), [x])


def exp_u20_ir(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """torch's Vectorized<float>::exp_u20 of a float or float vector, lane by lane."""
    ty = x.type
    less = builder.fcmp_ordered("<", x, _const(ty, LN_FLT_MIN))
    src = builder.select(
        builder.fcmp_ordered("<", x, _const(ty, LN_FLT_MAX)), x, _const(ty, LN_FLT_MAX)
    )
    src = builder.select(
        builder.fcmp_ordered(">", src, _const(ty, LN_FLT_MIN)), src, _const(ty, LN_FLT_MIN)
    )
    fx = _floor(builder, _fma(builder, src, _const(ty, LOG2E), _const(ty, 0.5)))
    r = _fma(builder, builder.fneg(fx), _const(ty, LN2), src)
    res = _fma(builder, r, _const(ty, _U20[0]), _const(ty, _U20[1]))
    for c in _U20[2:]:
        res = _fma(builder, r, res, _const(ty, c))
    ity = _int_type(ty)
    n = builder.fptosi(builder.fsub(fx, _const(ty, 1.0)), ity)
    power = builder.shl(builder.add(n, _const(ity, 127)), _const(ity, 23))
    power = builder.select(less, _const(ty, 0.0), builder.bitcast(power, ty))
    return builder.fmul(builder.fmul(res, power), _const(ty, 2.0))


def fexp_u20_ir(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """torch's Vectorized<float>::fexp_u20 of a float or float vector, lane by lane: 0 below
    ln(FLT_MIN), inf above ln(FLT_MAX)."""
    ty = x.type
    src = builder.fmul(x, _const(ty, LOG2E))
    fraction = builder.fsub(src, _floor(builder, src))
    res = _fma(builder, fraction, _const(ty, _FEXP[0]), _const(ty, _FEXP[1]))
    res = _fma(builder, fraction, res, _const(ty, _FEXP[2]))
    res = _fma(builder, fraction, res, _const(ty, _FEXP[3]))
    wide = _fma(builder, _const(ty, _FEXP_A), builder.fsub(src, res), _const(ty, _FEXP_B))
    # cvttps: truncation (out of range only where the selects below replace the value)
    result = builder.bitcast(builder.fptosi(wide, _int_type(ty)), ty)
    result = builder.select(
        builder.fcmp_ordered("<", x, _const(ty, LN_FLT_MIN)), _const(ty, 0.0), result
    )
    return builder.select(
        builder.fcmp_ordered(">", x, _const(ty, LN_FLT_MAX)), _const(ty, float("inf")), result
    )


def libm_exp_ir(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """std::exp(float): libm's expf (llvm.exp.f32 is lowered to a call of it)."""
    return builder.call(declare(builder, "llvm.exp.f32", F32, [F32]), [x])


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


def _max_codegen(width: int):
    """max(init, s[first:][:n]): lanes, their tree, then the tail (a max's value does not
    depend on its order)."""

    def codegen(context, builder, sig, args):
        s, _, _, init = args
        first, n = int_args(context, builder, sig, args, "-ii-")
        data = builder.gep(array_data(context, builder, sig.args[0], s), [first])
        vec = vector(F32, width)
        total = cgutils.alloca_once(builder, vec)
        builder.store(splat(builder, init, width), total)
        chunks = builder.udiv(n, i64(width))
        with cgutils.for_range(builder, chunks) as chunk:
            ptr = builder.bitcast(
                builder.gep(data, [builder.mul(chunk.index, i64(width))]), vec.as_pointer()
            )
            x, acc = builder.load(ptr, align=4), builder.load(total)
            builder.store(builder.select(builder.fcmp_ordered(">", x, acc), x, acc), total)
        result = cgutils.alloca_once(builder, F32)
        builder.store(_tree_max(builder, builder.load(total), width), result)
        with cgutils.for_range(builder, builder.sub(n, builder.mul(chunks, i64(width)))) as rest:
            x = builder.load(
                builder.gep(data, [builder.add(builder.mul(chunks, i64(width)), rest.index)])
            )
            acc = builder.load(result)
            builder.store(builder.select(builder.fcmp_ordered(">", x, acc), x, acc), result)
        return builder.load(result)

    return codegen


def _tree_max(builder: ir.IRBuilder, vec: ir.Value, width: int) -> ir.Value:
    """The max of a vector's `width` lanes (a power of two), halves against halves."""
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(vec, vec, const_vec(I32, list(range(width))))
        hi = builder.shuffle_vector(vec, vec, const_vec(I32, list(range(width, 2 * width))))
        vec = builder.select(builder.fcmp_ordered(">", hi, lo), hi, lo)
    return builder.extract_element(vec, ir.Constant(I32, 0))


def _exp_codegen(width: int, bf16: bool):
    """exp_block for torch's `width` lanes; fexp_u20 and bfloat16 stores where `bf16`."""
    vec_exp = fexp_u20_ir if bf16 else exp_u20_ir
    # torch's first loop steps by a vector of the output dtype: 2 float vectors for bfloat16
    group = 2 if bf16 else 1

    def store(builder, value, ptr):
        builder.store(round_bf16_ir(builder, value) if bf16 else value, ptr, align=4)

    def codegen(context, builder, sig, args):
        s, _, _, _, _, top, _ = args
        base, start, stop, n = int_args(context, builder, sig, args, "-iiii--")
        data = builder.gep(array_data(context, builder, sig.args[0], s), [base])
        vec = vector(F32, width)
        whole = builder.sub(n, builder.urem(n, i64(width)))  # the vector part's end
        paired = builder.sub(n, builder.urem(n, i64(width * group)))  # the first loop's end
        sums = [cgutils.alloca_once(builder, vec) for _ in range(3)]  # a0, a1, the loose one
        for acc in sums:
            builder.store(ir.Constant(vec, None), acc)
        vector_end = builder.select(builder.icmp_signed("<", stop, whole), stop, whole)
        chunks = builder.sdiv(builder.sub(vector_end, start), i64(width))
        tops = splat(builder, top, width)
        with cgutils.for_range(
            builder, builder.select(builder.icmp_signed(">", chunks, i64(0)), chunks, i64(0))
        ) as chunk:
            at = builder.add(start, builder.mul(chunk.index, i64(width)))
            ptr = builder.bitcast(builder.gep(data, [at]), vec.as_pointer())
            e = vec_exp(builder, builder.fsub(builder.load(ptr, align=4), tops))
            store(builder, e, ptr)
            second = builder.icmp_unsigned(
                "!=", builder.urem(builder.udiv(at, i64(width)), i64(group)), i64(0)
            )
            acc = builder.select(second, sums[1], sums[0])
            acc = builder.select(builder.icmp_signed(">=", at, paired), sums[2], acc)
            builder.store(builder.fadd(builder.load(acc), e), acc)
        first, second, loose = (builder.load(acc) for acc in sums)
        lanes = builder.fadd(builder.fadd(first, loose), second)
        total = cgutils.alloca_once(builder, F32)
        builder.store(pairwise_sum(builder, lanes, width), total)
        tail_start = builder.select(builder.icmp_signed(">", start, whole), start, whole)
        tail = builder.sub(stop, tail_start)
        with cgutils.for_range(
            builder, builder.select(builder.icmp_signed(">", tail, i64(0)), tail, i64(0))
        ) as rest:
            ptr = builder.gep(data, [builder.add(tail_start, rest.index)])
            e = libm_exp_ir(builder, builder.fsub(builder.load(ptr, align=4), top))
            store(builder, e, ptr)
            builder.store(builder.fadd(builder.load(total), e), total)
        return builder.load(total)

    return codegen


@intrinsic
def block_max(typingctx, s, first, n, init):
    """max(init, s[first:][:n]) of a flat float32 array (a nan is skipped)."""
    if not (isinstance(s, types.Array) and s.dtype == types.float32 and init == types.float32):
        return None
    from hybridmoe.kernels.attention_ir import lanes

    return types.float32(s, first, n, init), _max_codegen(lanes())


@intrinsic
def exp_block(typingctx, s, base, start, stop, n, top, mode):
    """The exps of a block's scores s[base + i], start <= i < stop, minus `top`, and their
    sum, as torch's _exp_reduce_sum_fusion_kernel computes them for a block of n scores
    (`start` a multiple of the lanes where it is in the block's vector part, `stop` one where
    it is): `mode` (a literal of MODES) is torch's lanes, + 1 for a bfloat16 attention
    (fexp_u20, the exps stored rounded to bfloat16 values), else exp_u20. Each exp replaces
    its score; returns the float32 sum. A score of -inf gives an exp of 0 (a masked key: it
    adds nothing)."""
    if not (isinstance(mode, types.IntegerLiteral) and mode.literal_value in MODES):
        return None
    if not (isinstance(s, types.Array) and s.dtype == types.float32 and top == types.float32):
        return None
    value = mode.literal_value
    sig = types.float32(s, base, start, stop, n, top, mode)
    return sig, _exp_codegen(value & ~1, bool(value & 1))
