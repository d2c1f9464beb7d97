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


def _fmuladd(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a * b + c (float or float vectors): fused where the target has FMA."""
    ty = a.type
    suffix = f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else "f32"
    return builder.call(declare(builder, f"llvm.fmuladd.{suffix}", ty, [ty] * 3), [a, b, c])


def _data(context, builder, ty, value) -> ir.Value:
    return context.make_array(ty)(context, builder, value).data


def _ints(context, builder, sig, args, names: str) -> list[ir.Value]:
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
        g0, off, n, s_stride, dim = _ints(context, builder, sig, args, "--i-ii-i-i")
        q_data, s_data = (
            _data(context, builder, sig.args[1], q),
            _data(context, builder, sig.args[6], s),
        )
        k_data = _data(context, builder, sig.args[3], kc)
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
                    builder.store(_fmuladd(builder, qv, kv, builder.load(acc)), acc)
            for acc, total in zip(accs, totals, strict=True):
                builder.store(pairwise_sum(builder, builder.load(acc), width), total)
            with cgutils.for_range(builder, builder.sub(dim, tail_start)) as rest:
                at = builder.add(tail_start, rest.index)
                kx = _widen(builder, builder.gep(k_row, [at]), bf16, 1)
                for q_row, total in zip(q_rows, totals, strict=True):
                    qx = builder.load(builder.gep(q_row, [at]), align=4)
                    builder.store(_fmuladd(builder, qx, kx, builder.load(total)), total)
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
        g0, p_stride, off, n, dim = _ints(context, builder, sig, args, "--i-i-iii")
        acc_data, p_data = (
            _data(context, builder, sig.args[1], acc),
            _data(context, builder, sig.args[3], p),
        )
        v_data = _data(context, builder, sig.args[5], vc)
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
                    builder.store(_fmuladd(builder, weight, vv, builder.load(total)), total)
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
                    builder.store(_fmuladd(builder, weight, vx, builder.load(total)), total)
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
    n = builder.call(floor, [_fmuladd(builder, safe, _const(ty, _LOG2E), _const(ty, 0.5))])
    r = _fmuladd(builder, n, _const(ty, -_LN2_HI), safe)
    r = _fmuladd(builder, n, _const(ty, -_LN2_LO), r)
    poly = _const(ty, _EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        poly = _fmuladd(builder, poly, r, _const(ty, c))
    r2 = builder.fmul(r, r)
    e = builder.fadd(_fmuladd(builder, poly, r2, r), _const(ty, 1.0))
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
        first, n = _ints(context, builder, sig, args, "-ii" + "-" * (len(args) - 3))
        data = builder.gep(_data(context, builder, sig.args[0], s), [first])
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
    from hybridmoe.kernels.llvm_ir import const_vec

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


@intrinsic
def address_pointer(typingctx, address):
    """The int64 `address` as a void pointer (for numba.carray)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen
