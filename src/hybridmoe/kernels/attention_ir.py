"""LLVM vector code for the decode attention kernel (kernels/numba_attention.py): the scores
q . k of a tile of query heads against a run of cached keys (four keys' <4 x float> partial
sums in one vector), and the weighted sum of the run's values into those heads' outputs, over
head_dim in vectors of LANES floats.

LANES is the target's widest float vector (16 with AVX-512, else 8), chosen when numba compiles
(llvm_ir.target_has; its on-disk cache is keyed on the CPU features). A bfloat16 key or value is
widened exactly (its 16 bits shifted into a float32's high half); float32 is read as it is.

Summation orders, those of torch's CPU flash attention in bfloat16 (its GEMMs are MKL's
gemm_bf16bf16f32, whose order is MKL's choice for the CPU; numba_attention.kernel_order finds a
machine's): a bfloat16 product is exact in float32, so only the order of the additions matters.
An intrinsic takes the order (ORDERS) at run time.
QUADS, measured bit for bit on an AMD EPYC (AVX-512, MKL's generic path):
  qk_tile: four interleaved partial sums, lane l over d = l (mod 4) in ascending order,
    added as (s0 + s2) + (s1 + s3), then the tail dims (head_dim % 4) one by one; the sum is
    multiplied by `scale`.
  pv_tile: over the keys in groups of four counted from the run's first (a softmax block's
    first key), each group's products added as (t0 + t2) + (t1 + t3), then the group's sum
    added to out[d]; the last n % 4 keys (a block's last) added to out[d] one by one, the
    last first; every dim alike. t0 + t2 and t1 + t3 are fused multiply-adds: for exact
    (bfloat16) products the same bits.
PAIRS, measured bit for bit on an Intel Xeon (Sapphire Rapids: MKL's AVX512-BF16 path, whose
VDPBF16PS adds a lane's two products one at a time, the odd one first):
  qk_tile: sixteen lanes, lane l summing from 0 the products of dims 32 c + 2 l + 1, then
    32 c + 2 l, for each chunk c of 32 dims in turn (a dim past head_dim: no term); then lane
    l + lane l + 8 (eight sums), neighbours (2 j, 2 j + 1), pairs of those, the two halves.
  pv_tile: over the keys in groups of eight counted from the run's first, each group's
    products summed from 0 as t1, t0, t3, t2, t5, t4, t7, t6 (a group of m < 8 keys, the
    block's last: its pairs so, a last odd key alone, last), then the group's sum added to
    out[d]; every dim alike.
A tile of 8, 4, 2 or 1 heads (a compile-time literal) shares each key's or value's loads; its
results do not depend on the tile (each head's sum is its own chain), so neither on the
grouped-query ratio's split into tiles.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hybridmoe.kernels.llvm_ir import (
    F32,
    I16,
    I32,
    const_vec,
    declare,
    i64,
    splat,
    vector,
)

TILES = (8, 4, 2, 1)  # heads per tile
QUADS, PAIRS = 0, 1  # the summation orders above
ORDERS = (QUADS, PAIRS)


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


def fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a * b + c rounded once (float or float vectors): llvm.fma, the FMA instruction where
    the target has one, else libm's fmaf (the same bits on every path; a bfloat16 product is
    exact, so it is fadd's rounding)."""
    ty = a.type
    suffix = f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else "f32"
    return builder.call(declare(builder, f"llvm.fma.{suffix}", ty, [ty] * 3), [a, b, c])


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


def _qk_codegen(tile: int, bf16: bool):
    def codegen(context, builder, sig, args):
        _, order, q, _, kc, _, _, s, _, _, scale, _ = args
        g0, off, n, s_stride, s_off, dim = int_args(context, builder, sig, args, "---i-ii-ii-i")
        q_data, s_data = (
            array_data(context, builder, sig.args[2], q),
            array_data(context, builder, sig.args[7], s),
        )
        k_data = array_data(context, builder, sig.args[4], kc)
        quads = builder.udiv(dim, i64(4))
        tail_start = builder.mul(quads, i64(4))
        q_rows = [
            builder.gep(q_data, [builder.mul(builder.add(g0, i64(g)), dim)]) for g in range(tile)
        ]
        s_rows = [
            builder.gep(
                s_data, [builder.add(builder.mul(builder.add(g0, i64(g)), s_stride), s_off)]
            )
            for g in range(tile)
        ]

        def keys(first: ir.Value, pack: int) -> None:
            """The scores of keys first .. first + pack - 1: each key's four partial sums in
            its own four lanes of one <4 pack x float> per head (one FMA feeds `pack` keys)."""
            width = 4 * pack
            vec = vector(F32, width)
            k_rows = [
                builder.gep(
                    k_data, [builder.add(off, builder.mul(builder.add(first, i64(j)), dim))]
                )
                for j in range(pack)
            ]
            accs = [cgutils.alloca_once(builder, vec) for _ in range(tile)]
            for acc in accs:
                builder.store(ir.Constant(vec, None), acc)
            with cgutils.for_range(builder, quads) as quad:
                at = builder.mul(quad.index, i64(4))
                kv = _widen_rows(builder, [builder.gep(row, [at]) for row in k_rows], bf16)
                for q_row, acc in zip(q_rows, accs, strict=True):
                    qv = _widen(builder, builder.gep(q_row, [at]), False, 4)
                    qv = builder.shuffle_vector(qv, qv, const_vec(I32, [0, 1, 2, 3] * pack))
                    builder.store(fma(builder, qv, kv, builder.load(acc)), acc)
            for q_row, s_row, acc in zip(q_rows, s_rows, accs, strict=True):
                sums = _quad_sums(builder, builder.load(acc), pack)
                for j, k_row in enumerate(k_rows):
                    total = cgutils.alloca_once(builder, F32)
                    builder.store(builder.extract_element(sums, ir.Constant(I32, 4 * j)), total)
                    with cgutils.for_range(builder, builder.sub(dim, tail_start)) as rest:
                        at = builder.add(tail_start, rest.index)
                        kx = _widen(builder, builder.gep(k_row, [at]), bf16, 1)
                        qx = builder.load(builder.gep(q_row, [at]), align=4)
                        builder.store(fma(builder, qx, kx, builder.load(total)), total)
                    score = builder.fmul(builder.load(total), scale)
                    builder.store(score, builder.gep(s_row, [builder.add(first, i64(j))]))

        pairs = builder.icmp_signed("==", order, ir.Constant(order.type, PAIRS))
        with builder.if_else(pairs) as (by_pairs, by_quads):
            with by_pairs:
                _qk_pairs(builder, bf16, q_rows, s_rows, k_data, off, n, dim, scale)
            with by_quads:
                fours = builder.udiv(n, i64(4))
                with cgutils.for_range(builder, fours) as four:
                    keys(builder.mul(four.index, i64(4)), 4)
                with cgutils.for_range(builder, builder.urem(n, i64(4))) as rest:
                    keys(builder.add(builder.mul(fours, i64(4)), rest.index), 1)
        return context.get_dummy_value()

    return codegen


_ODD, _EVEN = list(range(1, 32, 2)), list(range(0, 32, 2))
SPLIT_DIMS = 256  # q split once per call up to this head_dim (PAIRS)


def _qk_pairs(builder, bf16, q_rows, s_rows, k_data, off, n, dim, scale) -> None:
    """The PAIRS order's scores of keys 0 .. n - 1 for the tile's heads: a key at a time, each
    head's sixteen lane sums in one <16 x float>, a chunk of 32 dims two FMAs (the odd dims',
    then the even dims'); a last chunk of fewer dims from zeroed copies (a zero product leaves
    a sum as it is: no sum here is -0). The heads' q are split into odd and even dims once
    (up to SPLIT_DIMS dims; beyond, at every key); a bfloat16 key's by shifts."""
    vec = vector(F32, 16)
    chunks, rest = builder.udiv(dim, i64(32)), builder.urem(dim, i64(32))
    tail = builder.mul(chunks, i64(32))
    k_part = cgutils.alloca_once(builder, F32, size=32)
    q_parts = [cgutils.alloca_once(builder, F32, size=32) for _ in q_rows]
    # per head and chunk: <16 x float> odd dims, then even dims (the last chunk's zero-padded)
    q_split = [cgutils.alloca_once(builder, vec, size=2 * SPLIT_DIMS // 32) for _ in q_rows]
    presplit = builder.icmp_unsigned("<=", dim, i64(SPLIT_DIMS))

    def wide32(ptr: ir.Value) -> ir.Value:
        return builder.load(builder.bitcast(ptr, vector(F32, 32).as_pointer()), align=4)

    def split(v: ir.Value) -> tuple[ir.Value, ir.Value]:
        odd = builder.shuffle_vector(v, v, const_vec(I32, _ODD))
        return odd, builder.shuffle_vector(v, v, const_vec(I32, _EVEN))

    def split_key(ptr: ir.Value) -> tuple[ir.Value, ir.Value]:
        """A whole chunk of the key at element pointer `ptr`: (odd dims, even dims)."""
        if not bf16:
            return split(wide32(ptr))
        words = builder.load(builder.bitcast(ptr, vector(I32, 16).as_pointer()), align=2)
        high = builder.and_(words, ir.Constant(vector(I32, 16), [-65536] * 16))
        low = builder.shl(words, ir.Constant(vector(I32, 16), [16] * 16))
        return builder.bitcast(high, vec), builder.bitcast(low, vec)

    def fill_tail(row: ir.Value, part: ir.Value, widen: bool) -> None:
        """part[:32] = the row's last dim % 32 dims (widened bfloat16 where `widen`), zeros."""
        for i in range(32):
            builder.store(ir.Constant(F32, 0), builder.gep(part, [i64(i)]))
        with cgutils.for_range(builder, rest) as r:
            at = builder.add(tail, r.index)
            if widen:
                value = _widen(builder, builder.gep(row, [at]), True, 1)
            else:
                value = builder.load(builder.gep(row, [at]), align=4)
            builder.store(value, builder.gep(part, [r.index]))

    has_tail = builder.icmp_unsigned("!=", rest, i64(0))
    with builder.if_then(presplit):
        for row, part, halves in zip(q_rows, q_parts, q_split, strict=True):
            with cgutils.for_range(builder, chunks) as c:
                odd, even = split(wide32(builder.gep(row, [builder.mul(c.index, i64(32))])))
                builder.store(odd, builder.gep(halves, [builder.mul(c.index, i64(2))]))
                slot = builder.add(builder.mul(c.index, i64(2)), i64(1))
                builder.store(even, builder.gep(halves, [slot]))
            with builder.if_then(has_tail):
                fill_tail(row, part, False)
                odd, even = split(wide32(part))
                builder.store(odd, builder.gep(halves, [builder.mul(chunks, i64(2))]))
                slot = builder.add(builder.mul(chunks, i64(2)), i64(1))
                builder.store(even, builder.gep(halves, [slot]))

    def q_halves(c: ir.Value, row: ir.Value, halves: ir.Value, part: ir.Value | None):
        """Head `row`'s chunk c as (odd, even): kept split, or split here (`part`: the
        zero-padded last chunk's copy)."""
        out_odd = cgutils.alloca_once(builder, vec)
        out_even = cgutils.alloca_once(builder, vec)
        with builder.if_else(presplit) as (kept, here):
            with kept:
                builder.store(builder.load(builder.gep(halves, [builder.mul(c, i64(2))])), out_odd)
                slot = builder.add(builder.mul(c, i64(2)), i64(1))
                builder.store(builder.load(builder.gep(halves, [slot])), out_even)
            with here:
                ptr = part if part is not None else builder.gep(row, [builder.mul(c, i64(32))])
                odd, even = split(wide32(ptr))
                builder.store(odd, out_odd)
                builder.store(even, out_even)
        return builder.load(out_odd), builder.load(out_even)

    with cgutils.for_range(builder, n) as key:
        k_row = builder.gep(k_data, [builder.add(off, builder.mul(key.index, dim))])
        accs = [cgutils.alloca_once(builder, vec) for _ in q_rows]
        for acc in accs:
            builder.store(ir.Constant(vec, None), acc)

        def chunk(c: ir.Value, k_odd: ir.Value, k_even: ir.Value, tail_chunk: bool) -> None:
            for row, part, halves, acc in zip(q_rows, q_parts, q_split, accs, strict=True):
                q_odd, q_even = q_halves(c, row, halves, part if tail_chunk else None)
                total = fma(builder, q_odd, k_odd, builder.load(acc))
                builder.store(fma(builder, q_even, k_even, total), acc)

        with cgutils.for_range(builder, chunks) as c:
            k_odd, k_even = split_key(builder.gep(k_row, [builder.mul(c.index, i64(32))]))
            chunk(c.index, k_odd, k_even, False)
        with builder.if_then(has_tail):
            fill_tail(k_row, k_part, bf16)
            with builder.if_then(builder.not_(presplit)):
                for row, part in zip(q_rows, q_parts, strict=True):
                    fill_tail(row, part, False)
            k_odd, k_even = split(wide32(k_part))
            chunk(chunks, k_odd, k_even, True)
        for s_row, acc in zip(s_rows, accs, strict=True):
            total = _lane_tree(builder, builder.load(acc))
            score = builder.fmul(total, scale)
            builder.store(score, builder.gep(s_row, [key.index]))


def _lane_tree(builder: ir.IRBuilder, acc: ir.Value) -> ir.Value:
    """The PAIRS order's sum of a <16 x float>'s lanes: l + (l + 8), then neighbours, then
    pairs of those, then the two halves."""

    def half(vec: ir.Value, indices: list[int]) -> ir.Value:
        return builder.shuffle_vector(vec, vec, const_vec(I32, indices))

    eights = builder.fadd(half(acc, list(range(8))), half(acc, list(range(8, 16))))
    fours = builder.fadd(half(eights, [0, 2, 4, 6]), half(eights, [1, 3, 5, 7]))
    twos = builder.fadd(half(fours, [0, 2]), half(fours, [1, 3]))
    zero, one = ir.Constant(I32, 0), ir.Constant(I32, 1)
    return builder.fadd(builder.extract_element(twos, zero), builder.extract_element(twos, one))


def _quad_sums(builder: ir.IRBuilder, acc: ir.Value, pack: int) -> ir.Value:
    """Lane 4j of the result: (a0 + a2) + (a1 + a3) of acc's lanes 4j .. 4j + 3, j < pack: the
    order of torch's bfloat16 GEMM (MKL's) for a score's four interleaved partial sums."""
    swap_halves = [4 * j + i for j in range(pack) for i in (2, 3, 0, 1)]
    pairs = builder.fadd(acc, builder.shuffle_vector(acc, acc, const_vec(I32, swap_halves)))
    swap_lanes = [4 * j + i for j in range(pack) for i in (1, 0, 3, 2)]
    return builder.fadd(pairs, builder.shuffle_vector(pairs, pairs, const_vec(I32, swap_lanes)))


def _widen_rows(builder: ir.IRBuilder, ptrs: list[ir.Value], bf16: bool) -> ir.Value:
    """<4 len(ptrs) x float>: the 4 elements at each element pointer, side by side (bfloat16
    bits widened exactly)."""
    count = 4 * len(ptrs)
    elem = I16 if bf16 else F32
    parts = [builder.load(builder.bitcast(p, vector(elem, 4).as_pointer()), align=2) for p in ptrs]
    while len(parts) > 1:  # concatenate pairwise: 4 -> 8 -> 16 lanes
        width = 2 * parts[0].type.count
        joined = const_vec(I32, list(range(width)))
        parts = [
            builder.shuffle_vector(a, b, joined)
            for a, b in zip(parts[::2], parts[1::2], strict=True)
        ]
    raw = parts[0]
    if not bf16:
        return raw
    wide = builder.shl(
        builder.zext(raw, vector(I32, count)), ir.Constant(vector(I32, count), [16] * count)
    )
    return builder.bitcast(wide, vector(F32, count))


@intrinsic
def qk_tile(typingctx, tile, order, q, g0, kc, off, n, s, s_stride, s_off, scale, dim):
    """For g < tile, j < n: s[(g0 + g) * s_stride + s_off + j] = (q[(g0 + g) * dim :][:dim] .
    kc[off + j * dim :][:dim]) * scale, in the module's order `order` (an integer of ORDERS).
    q, s: flat float32; kc: flat uint16 (bfloat16 bits) or float32; `tile` a literal of TILES;
    scale float32."""
    if not (isinstance(tile, types.IntegerLiteral) and tile.literal_value in TILES):
        return None
    if not _is_cache(kc) or scale != types.float32 or not isinstance(order, types.Integer):
        return None
    sig = types.void(tile, order, q, g0, kc, off, n, s, s_stride, s_off, scale, dim)
    return sig, _qk_codegen(tile.literal_value, kc.dtype == types.uint16)


def _pv_codegen(tile: int, width: int, bf16: bool):
    def codegen(context, builder, sig, args):
        _, order, acc, _, p, _, vc, _, _, _ = args
        g0, p_stride, off, n, dim = int_args(context, builder, sig, args, "---i-i-iii")
        acc_data, p_data = (
            array_data(context, builder, sig.args[2], acc),
            array_data(context, builder, sig.args[4], p),
        )
        v_data = array_data(context, builder, sig.args[6], vc)
        heads = [builder.add(g0, i64(g)) for g in range(tile)]
        acc_rows = [builder.gep(acc_data, [builder.mul(h, dim)]) for h in heads]
        p_rows = [builder.gep(p_data, [builder.mul(h, p_stride)]) for h in heads]
        v_first = builder.gep(v_data, [off])
        chunks = builder.udiv(dim, i64(width))
        tail_start = builder.mul(chunks, i64(width))

        def dims(at: ir.Value, count: int) -> None:
            """acc[.., at : at + count] += each group's (t0 + t2) + (t1 + t3), t_i = p_i v_i."""
            ty = vector(F32, count) if count > 1 else F32
            slots = [builder.gep(row, [at]) for row in acc_rows]
            if count > 1:
                slots = [builder.bitcast(slot, ty.as_pointer()) for slot in slots]
            sums = [cgutils.alloca_once(builder, ty) for _ in range(tile)]
            for slot, total in zip(slots, sums, strict=True):
                builder.store(builder.load(slot, align=4), total)

            def group_of_four(first: ir.Value) -> None:
                """Keys first .. first + 3: (t0 + t2) + (t1 + t3), t_i = w_i v_i, t0 + t2 as
                fma(w0, v0, t2) (one rounding, fadd's where the products are exact)."""
                values, weights = [], [[] for _ in range(tile)]
                for i in range(4):
                    key = builder.add(first, i64(i))
                    v_row = builder.gep(v_first, [builder.add(builder.mul(key, dim), at)])
                    values.append(_widen(builder, v_row, bf16, count))
                    for g, p_row in enumerate(p_rows):
                        weight = builder.load(builder.gep(p_row, [key]))
                        weights[g].append(splat(builder, weight, count) if count > 1 else weight)
                for w, total in zip(weights, sums, strict=True):
                    even = fma(builder, w[0], values[0], builder.fmul(w[2], values[2]))
                    odd = fma(builder, w[1], values[1], builder.fmul(w[3], values[3]))
                    builder.store(builder.fadd(builder.load(total), builder.fadd(even, odd)), total)

            def term(key: ir.Value, into: list[ir.Value], fused: bool = True) -> None:
                """into[g] = fma(w_g[key], v[key], into[g]) for the tile's heads (not
                `fused`: into[g] + w_g[key] v[key], the product rounded first)."""
                v_row = builder.gep(v_first, [builder.add(builder.mul(key, dim), at)])
                value = _widen(builder, v_row, bf16, count)
                for p_row, part in zip(p_rows, into, strict=True):
                    weight = builder.load(builder.gep(p_row, [key]))
                    weight = splat(builder, weight, count) if count > 1 else weight
                    if fused:
                        total = fma(builder, weight, value, builder.load(part))
                    else:
                        total = builder.fadd(builder.load(part), builder.fmul(weight, value))
                    builder.store(total, part)

            def group_of_eight(first: ir.Value, keys: ir.Value | None) -> None:
                """PAIRS: keys first .. first + 7 (`keys` None) or first .. first + keys - 1
                summed from 0 as t1, t0, t3, t2, ..., a last odd key alone; into the sums."""
                parts = [cgutils.alloca_once(builder, ty) for _ in range(tile)]
                for part in parts:
                    builder.store(ir.Constant(ty, None), part)
                if keys is None:
                    for i in (1, 0, 3, 2, 5, 4, 7, 6):
                        term(builder.add(first, i64(i)), parts)
                else:
                    with cgutils.for_range(builder, builder.udiv(keys, i64(2))) as pair:
                        even = builder.add(first, builder.mul(pair.index, i64(2)))
                        term(builder.add(even, i64(1)), parts)
                        term(even, parts)
                    odd = builder.icmp_unsigned("==", builder.urem(keys, i64(2)), i64(1))
                    with builder.if_then(odd):
                        term(builder.sub(builder.add(first, keys), i64(1)), parts)
                for part, total in zip(parts, sums, strict=True):
                    builder.store(builder.fadd(builder.load(total), builder.load(part)), total)

            pairs = builder.icmp_signed("==", order, ir.Constant(order.type, PAIRS))
            with builder.if_else(pairs) as (by_pairs, by_quads):
                with by_pairs:
                    eights = builder.udiv(n, i64(8))
                    with cgutils.for_range(builder, eights) as group:
                        group_of_eight(builder.mul(group.index, i64(8)), None)
                    last = builder.urem(n, i64(8))
                    with builder.if_then(builder.icmp_unsigned("!=", last, i64(0))):
                        group_of_eight(builder.mul(eights, i64(8)), last)
                with by_quads:
                    full = builder.udiv(n, i64(4))
                    with cgutils.for_range(builder, full) as group:
                        group_of_four(builder.mul(group.index, i64(4)))
                    loose = builder.urem(n, i64(4))
                    with cgutils.for_range(builder, loose) as back:  # the last keys, last first
                        term(builder.sub(builder.sub(n, i64(1)), back.index), sums, fused=False)
            for slot, total in zip(slots, sums, strict=True):
                builder.store(builder.load(total), slot, align=4)

        with cgutils.for_range(builder, chunks) as chunk:
            dims(builder.mul(chunk.index, i64(width)), width)
        with cgutils.for_range(builder, builder.sub(dim, tail_start)) as rest:
            dims(builder.add(tail_start, rest.index), 1)
        return context.get_dummy_value()

    return codegen


@intrinsic
def pv_tile(typingctx, tile, order, acc, g0, p, p_stride, vc, off, n, dim):
    """For g < tile, d < dim: acc[(g0 + g) * dim + d] += Σ_{j < n} p[(g0 + g) * p_stride + j]
    vc[off + j * dim + d], in the module's order `order` (an integer of ORDERS). acc, p: flat
    float32; vc: flat uint16 (bfloat16 bits) or float32; `tile` a literal of TILES."""
    if not (isinstance(tile, types.IntegerLiteral) and tile.literal_value in TILES):
        return None
    if not _is_cache(vc) or not isinstance(order, types.Integer):
        return None
    sig = types.void(tile, order, acc, g0, p, p_stride, vc, off, n, dim)
    return sig, _pv_codegen(tile.literal_value, lanes(), vc.dtype == types.uint16)
