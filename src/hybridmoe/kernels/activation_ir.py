"""LLVM vector code for the routed experts' SiLU (numba_moe._swiglu) with torch's bits, and the
exp it is made of, one lane of which the router's softmax calls (numba_glue, `sleef_expf`).

torch's CPU silu (aten/src/ATen/native/cpu/Activation.cpp) computes x / (1 + exp(-x)) over
Vectorized<float> (a bfloat16 tensor: its values widened to float, the result rounded back),
and Vectorized<float>::exp on its AVX2 and AVX512 builds is SLEEF's expf_u10 (`xexpf`, built
with FMA): q = rint(d / ln2), s = d - q ln2 in two fused steps, a degree-6 polynomial of s,
times 2^q as two factors; 0 below -104, inf above 100. Restated here lane by lane (the same
operations in any vector width, so every width and the one-lane tail give the same bits), it
matches torch.nn.functional.silu bit for bit where torch's loop is vectorised: all of a
tensor whose size is a multiple of 64 (torch's scalar tail, n mod 2 vectors, calls libm's expf
in bfloat16 steps). libm's expf, which the kernel called before, differs from it in the last
bit of ~4 % of float32 results, and ran one call per value (the layer's activation was ~4 % of
a 4-token Qwen3-30B-A3B q4_k layer on the AMD EPYC).

Where the target has no AVX2 (torch's default and ARM builds are other code) the kernel keeps
libm's expf (`SILU_LANES` 0)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from hybridmoe.kernels.llvm_ir import F32, I32, declare, target_has, vector


def _f32(value: float) -> float:
    return float(np.float32(value))


_R_LN2 = _f32(1.442695040888963407359924681001892137426645954152985934135449406931)
_L2U, _L2L = _f32(0.693145751953125), _f32(1.428606765330187045e-06)
_POLY = tuple(
    _f32(c)
    for c in (
        0.000198527617612853646278381,
        0.00139304355252534151077271,
        0.00833336077630519866943359,
        0.0416664853692054748535156,
        0.166666671633720397949219,
        0.5,
    )
)
# |d / ln2| is clamped to this before its conversion to an integer: exp is 0 or inf outside
# [-104, 100] whatever q is (the selects below), and NaN or inf must not reach the conversion
_Q_LIMIT = 256.0


def silu_lanes() -> int:
    """Floats per vector of the SiLU on the target numba compiles for (torch's AVX512 and AVX2
    builds use SLEEF's exp), 0 where the kernels keep libm's expf."""
    if not target_has("avx2"):
        return 0
    return 16 if target_has("avx512f") else 8


def _const(ty: ir.Type, value: float | int) -> ir.Constant:
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [value] * ty.count)
    return ir.Constant(ty, value)


def _call(builder: ir.IRBuilder, name: str, *args: ir.Value) -> ir.Value:
    ty = args[0].type
    suffix = f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else "f32"
    return builder.call(declare(builder, f"llvm.{name}.{suffix}", ty, [ty] * len(args)), args)


def sleef_expf_ir(builder: ir.IRBuilder, d: ir.Value) -> ir.Value:
    """SLEEF's xexpf (u10, with FMA) of a float or float vector, lane by lane."""
    ty = d.type
    ity = vector(I32, ty.count) if isinstance(ty, ir.VectorType) else I32
    scaled = builder.fmul(d, _const(ty, _R_LN2))
    scaled = _call(builder, "maxnum", scaled, _const(ty, -_Q_LIMIT))
    scaled = _call(builder, "minnum", scaled, _const(ty, _Q_LIMIT))
    q = builder.fptosi(_call(builder, "rint", scaled), ity)  # nearest, ties to even (vrint)
    qf = builder.sitofp(q, ty)
    s = _call(builder, "fma", qf, _const(ty, -_L2U), d)
    s = _call(builder, "fma", qf, _const(ty, -_L2L), s)
    u = _const(ty, _POLY[0])
    for c in _POLY[1:]:
        u = _call(builder, "fma", u, s, _const(ty, c))
    u = builder.fadd(_const(ty, 1.0), _call(builder, "fma", builder.fmul(s, s), u, s))
    half = builder.ashr(q, _const(ity, 1))  # vldexp2: u * 2^(q >> 1) * 2^(q - (q >> 1))
    for e in (half, builder.sub(q, half)):
        power = builder.shl(builder.add(e, _const(ity, 127)), _const(ity, 23))
        u = builder.fmul(u, builder.bitcast(power, ty))
    u = builder.select(builder.fcmp_ordered("<", d, _const(ty, -104.0)), _const(ty, 0.0), u)
    return builder.select(
        builder.fcmp_ordered("<", _const(ty, 100.0), d), _const(ty, float("inf")), u
    )


def silu_ir(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """torch's vectorised silu of a float or float vector: x / (1 + exp(-x)), exp SLEEF's."""
    one = _const(x.type, 1.0)
    return builder.fdiv(x, builder.fadd(one, sleef_expf_ir(builder, builder.fneg(x))))


def sigmoid_ir(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """torch's vectorised sigmoid (UnaryOpsKernel.cpp): 1 / (exp(0 - x) + 1), exp SLEEF's."""
    ty = x.type
    e = sleef_expf_ir(builder, builder.fsub(_const(ty, 0.0), x))
    return builder.fdiv(_const(ty, 1.0), builder.fadd(e, _const(ty, 1.0)))


@intrinsic
def activation_at(typingctx, values, first, width, sigmoid):
    """values[first : first + width] = silu_ir(values[...]), or sigmoid_ir's where `sigmoid`,
    in place (a float32 array; `width` a literal lane count, 1 for a tail value; `sigmoid` a
    literal bool)."""
    if not (
        isinstance(values, types.Array)
        and values.dtype == types.float32
        and isinstance(first, types.Integer)
        and isinstance(width, types.IntegerLiteral)
        and isinstance(sigmoid, types.BooleanLiteral)
    ):
        return None
    count, fn = width.literal_value, sigmoid_ir if sigmoid.literal_value else silu_ir

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        at = builder.gep(data, [context.cast(builder, args[1], sig.args[1], types.int64)])
        ty = vector(F32, count) if count > 1 else F32
        ptr = builder.bitcast(at, ty.as_pointer())
        builder.store(fn(builder, builder.load(ptr, align=4)), ptr, align=4)
        return context.get_dummy_value()

    return types.none(values, first, width, sigmoid), codegen


@intrinsic
def sleef_expf(typingctx, d):
    """sleef_expf_ir of a float32 (torch's Vectorized<float>::exp of one lane)."""
    if d != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return sleef_expf_ir(builder, args[0])

    return types.float32(d), codegen
