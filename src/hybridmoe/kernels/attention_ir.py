"""LLVM vector code for the decode attention kernel (kernels/numba_attention.py): the scores
q . k of a tile of query heads against a run of cached keys, and the weighted sum of the run's
values into those heads' outputs, over head_dim in vectors of LANES floats.

LANES is the target's widest float vector (16 with AVX-512, else 8), chosen when numba compiles
(llvm_ir.target_has; its on-disk cache is keyed on the CPU features). A bfloat16 key or value is
widened exactly (its 16 bits shifted into a float32's high half); float32 is read as it is.

Summation orders (each lane in ascending index order by llvm.fmuladd: one rounding per step
where the target fuses, two where it does not):
  qk_tile: lane l sums q[d] k[d] over d = l (mod LANES) of the whole vectors, the lanes are
    added by llvm_ir.pairwise_sum's tree, then the tail dims (head_dim % LANES) one by one;
    the sum is multiplied by `scale`.
  pv_tile: out[d] += p[j] v[j, d] over the run's keys j in ascending order, every dim alike.
A tile of 4, 2 or 1 heads (a compile-time literal) shares each key's or value's loads; its
results do not depend on the tile (each head's sum is its own chain), so neither on the
grouped-query ratio's split into tiles.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hybridmoe.kernels.llvm_ir import F32, I16, I32, declare, i64, pairwise_sum, splat, vector

TILES = (4, 2, 1)  # heads per tile


def lanes() -> int:
    """Floats per vector on the target numba compiles for."""
    from hybridmoe.kernels.llvm_ir import target_has

    return 16 if target_has("avx512f") else 8


def _widen(builder: ir.IRBuilder, ptr: ir.Value, bf16: bool, count: int) -> ir.Value:
    """<count x float> of the `count` elements at element pointer `ptr` (i16 holding bfloat16
    bits, or float); count 1: a float."""
    if not bf16:
        if count == 1:
            return builder.load(ptr, align=4)
        return builder.load(builder.bitcast(ptr, vector(F32, count).as_pointer()), align=4)
    if count == 1:
        wide = builder.shl(builder.zext(builder.load(ptr, align=2), I32), ir.Constant(I32, 16))
        return builder.bitcast(wide, F32)
    raw = builder.load(builder.bitcast(ptr, vector(I16, count).as_pointer()), align=2)
    wide = builder.zext(raw, vector(I32, count))
    shifted = builder.shl(wide, ir.Constant(vector(I32, count), [16] * count))
    return builder.bitcast(shifted, vector(F32, count))


def fmuladd(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a * b + c (float or float vectors): fused where the target has FMA."""
    ty = a.type
    suffix = f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else "f32"
    return builder.call(declare(builder, f"llvm.fmuladd.{suffix}", ty, [ty] * 3), [a, b, c])


def array_data(context, builder, ty, value) -> ir.Value:
    return context.make_array(ty)(context, builder, value).data


def int_args(context, builder, sig, args, names: str) -> list[ir.Value]:
    """The integer arguments at the positions `names` marks with 'i' as i64."""
    return [
        context.cast(builder, a, t, types.int64)
        for a, t, mark in zip(args, sig.args, names, strict=True)
        if mark == "i"
    ]


def _is_cache(ty) -> bool:
    return (
        isinstance(ty, types.Array) and ty.ndim == 1 and ty.dtype in (types.uint16, types.float32)
    )


def _qk_codegen(tile: int, width: int, bf16: bool):
    def codegen(context, builder, sig, args):
        _, q, _, kc, _, _, s, _, scale, _ = args
        g0, off, n, s_stride, dim = int_args(context, builder, sig, args, "--i-ii-i-i")
        q_data, s_data = (
            array_data(context, builder, sig.args[1], q),
            array_data(context, builder, sig.args[6], s),
        )
        k_data = array_data(context, builder, sig.args[3], kc)
        vec = vector(F32, width)
        accs = [cgutils.alloca_once(builder, vec) for _ in range(tile)]
        totals = [cgutils.alloca_once(builder, F32) for _ in range(tile)]
        chunks = builder.udiv(dim, i64(width))
        tail_start = builder.mul(chunks, i64(width))
        q_rows = [
            builder.gep(q_data, [builder.mul(builder.add(g0, i64(g)), dim)]) for g in range(tile)
        ]
        with cgutils.for_range(builder, n) as key:
            k_row = builder.gep(k_data, [builder.add(off, builder.mul(key.index, dim))])
            for acc in accs:
                builder.store(ir.Constant(vec, None), acc)
            with cgutils.for_range(builder, chunks) as chunk:
                at = builder.mul(chunk.index, i64(width))
                kv = _widen(builder, builder.gep(k_row, [at]), bf16, width)
                for q_row, acc in zip(q_rows, accs, strict=True):
                    qv = _widen(builder, builder.gep(q_row, [at]), False, width)
                    builder.store(fmuladd(builder, qv, kv, builder.load(acc)), acc)
            for acc, total in zip(accs, totals, strict=True):
                builder.store(pairwise_sum(builder, builder.load(acc), width), total)
            with cgutils.for_range(builder, builder.sub(dim, tail_start)) as rest:
                at = builder.add(tail_start, rest.index)
                kx = _widen(builder, builder.gep(k_row, [at]), bf16, 1)
                for q_row, total in zip(q_rows, totals, strict=True):
                    qx = builder.load(builder.gep(q_row, [at]), align=4)
                    builder.store(fmuladd(builder, qx, kx, builder.load(total)), total)
            for g, total in enumerate(totals):
                s_row = builder.mul(builder.add(g0, i64(g)), s_stride)
                score = builder.fmul(builder.load(total), scale)
                builder.store(score, builder.gep(s_data, [builder.add(s_row, key.index)]))
        return context.get_dummy_value()

    return codegen


@intrinsic
def qk_tile(typingctx, tile, q, g0, kc, off, n, s, s_stride, scale, dim):
    """For g < tile, j < n: s[(g0 + g) * s_stride + j] = (q[(g0 + g) * dim :][:dim] .
    kc[off + j * dim :][:dim]) * scale, in the module's order. q, s: flat float32; kc: flat
    uint16 (bfloat16 bits) or float32; `tile` a literal of TILES; scale float32."""
    if not (isinstance(tile, types.IntegerLiteral) and tile.literal_value in TILES):
        return None
    if not _is_cache(kc) or scale != types.float32:
        return None
    sig = types.void(tile, q, g0, kc, off, n, s, s_stride, scale, dim)
    return sig, _qk_codegen(tile.literal_value, lanes(), kc.dtype == types.uint16)


def _pv_codegen(tile: int, width: int, bf16: bool):
    def codegen(context, builder, sig, args):
        _, acc, _, p, _, vc, _, _, _ = args
        g0, p_stride, off, n, dim = int_args(context, builder, sig, args, "--i-i-iii")
        acc_data, p_data = (
            array_data(context, builder, sig.args[1], acc),
            array_data(context, builder, sig.args[3], p),
        )
        v_data = array_data(context, builder, sig.args[5], vc)
        vec = vector(F32, width)
        sums = [cgutils.alloca_once(builder, vec) for _ in range(tile)]
        scalars = [cgutils.alloca_once(builder, F32) for _ in range(tile)]
        chunks = builder.udiv(dim, i64(width))
        tail_start = builder.mul(chunks, i64(width))
        heads = [builder.add(g0, i64(g)) for g in range(tile)]
        acc_rows = [builder.gep(acc_data, [builder.mul(h, dim)]) for h in heads]
        p_rows = [builder.gep(p_data, [builder.mul(h, p_stride)]) for h in heads]
        v_first = builder.gep(v_data, [off])
        with cgutils.for_range(builder, chunks) as chunk:
            at = builder.mul(chunk.index, i64(width))
            slots = [builder.bitcast(builder.gep(row, [at]), vec.as_pointer()) for row in acc_rows]
            for slot, total in zip(slots, sums, strict=True):
                builder.store(builder.load(slot, align=4), total)
            with cgutils.for_range(builder, n) as key:
                v_row = builder.gep(v_first, [builder.add(builder.mul(key.index, dim), at)])
                vv = _widen(builder, v_row, bf16, width)
                for p_row, total in zip(p_rows, sums, strict=True):
                    weight = splat(builder, builder.load(builder.gep(p_row, [key.index])), width)
                    builder.store(fmuladd(builder, weight, vv, builder.load(total)), total)
            for slot, total in zip(slots, sums, strict=True):
                builder.store(builder.load(total), slot, align=4)
        with cgutils.for_range(builder, builder.sub(dim, tail_start)) as rest:
            at = builder.add(tail_start, rest.index)
            for row, total in zip(acc_rows, scalars, strict=True):
                builder.store(builder.load(builder.gep(row, [at])), total)
            with cgutils.for_range(builder, n) as key:
                vx = _widen(
                    builder,
                    builder.gep(v_first, [builder.add(builder.mul(key.index, dim), at)]),
                    bf16,
                    1,
                )
                for p_row, total in zip(p_rows, scalars, strict=True):
                    weight = builder.load(builder.gep(p_row, [key.index]))
                    builder.store(fmuladd(builder, weight, vx, builder.load(total)), total)
            for row, total in zip(acc_rows, scalars, strict=True):
                builder.store(builder.load(total), builder.gep(row, [at]))
        return context.get_dummy_value()

    return codegen


@intrinsic
def pv_tile(typingctx, tile, acc, g0, p, p_stride, vc, off, n, dim):
    """For g < tile, d < dim: acc[(g0 + g) * dim + d] += Σ_{j < n} p[(g0 + g) * p_stride + j]
    vc[off + j * dim + d], in the module's order. acc, p: flat float32; vc: flat uint16
    (bfloat16 bits) or float32; `tile` a literal of TILES."""
    if not (isinstance(tile, types.IntegerLiteral) and tile.literal_value in TILES):
        return None
    if not _is_cache(vc):
        return None
    sig = types.void(tile, acc, g0, p, p_stride, vc, off, n, dim)
    return sig, _pv_codegen(tile.literal_value, lanes(), vc.dtype == types.uint16)
