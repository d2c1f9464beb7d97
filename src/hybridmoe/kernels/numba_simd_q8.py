"""LLVM vector code for the q8 activation contract (quant/activation_q8.py): a tile of weight
rows of an int8-block format (KernelFormat.int8_block_ir: q8_0, q4_0) or of a k-quant with
integer super-blocks (KernelFormat.superblock_ints_ir: q2_k ... q6_k) dotted with up to 4
rows of q8-quantised activations by integer dot products.

A block's dot Σ v_i q_i is taken 32 bytes at a time into <8 x i32> partial sums by the best
instructions the target has (`dot_path`, chosen when numba compiles, so for the machine it
runs on or what NUMBA_CPU_FEATURES names): AVX-512 VNNI or AVX-VNNI `vpdpbusd` (one intrinsic:
LLVM encodes it as the target allows), AVX2 `vpmaddubsw` + `vpmaddwd`, or portable widening
multiplies. VNNI takes v + 128 unsigned (one xor per weight block) and subtracts 128 B, B =
Σ q the block's activation sum (from the 16-weight sums, one `vpmaddwd` per 8 blocks); AVX2
takes |v| unsigned and q with v's sign (sign(q, v)), exact since |v|, |q| <= 127 (no int16
saturation, which v + 128 would hit). Both give Σ v q exactly in int32. Eight consecutive
blocks' partials are then summed exactly into one <8 x i32> of block sums (a transpose-add
tree within 128-bit halves, then one cross-half add), converted to float, scaled
by d_w * d_x and added into the lane accumulator of the contract: lane j holds blocks j, j + 8,
...; blocks after the last whole group of 8 are added one by one into their lanes. The result
is the contract's to the bit on every path. The 8 blocks' fp16 scales of a row are gathered as
integers and converted in one instruction.

4-bit blocks (KernelFormat.nibble_block_ir: q4_0) take their own group step on the VNNI and
AVX2 paths when the tile has an even number of weight rows (_nibble_pair_step): two rows'
blocks side by side in one vector, nibbles dotted unsigned (u = v + 8, the bias 8 B), the pair's
sums reduced together. Same integers, same bits; the T = 1 tile 7.9 -> 4.9 ns per 256 weights
on an AVX-512 EPYC (the scales' conversion included), a 2 x 4 tile 5.6 -> 3.4.

A k-quant super-block (_superblock_step) is 8 pieces of 32 unsigned weights u: each piece's
pair sums u_2l q_2l + u_2l+1 q_2l+1 (`vpmaddubsw`: u unsigned, q signed, |sum| <= 2 * 63 * 127
< 2^15, no saturation; or portable widening multiplies) times the pairs' sub-block scales into
<8 x i32> (`vpdpwssd` with VNNI, else `vpmaddwd` + `vpaddd`), in two independent chains
in a one-token tile (CHAINS); the minimum (or offset) term from the activations' 16-weight
sums (`vpmaddwd`). The S and M vectors of 4 (weight row, activation row) pairs are reduced
together, exactly, by one transpose-add tree, then converted and scaled as one vector; each
pair's product is added into lane (super-block mod 8) of its accumulator, the lanes of 4 pairs
held side by side (one vector add); a 1 x 1 tile (a k-quant decode step's) reduces the S and M
of 4 consecutive super-blocks of its row together instead, their products added into 4 lanes.

The activations' quantisation (the contract's step 1, `quantize_block`) runs in vectors of 16
floats with generic LLVM operations (every target): the block's max |x| by `maxnum` (exact in
any order), then per lane the scalar reference's product and its rounding (truncate, compare
the exact fraction with +-0.5). The scalar loop it replaces cost 4.5 us per 2048 floats on the
AVX-512 EPYC, 1.0 vectorised; it ran on the calling thread before every q8 projection's
parallel loop, and in prefill over every token's row (a 384-token prefill 1.17x faster).
"""

from __future__ import annotations

import functools

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hybridmoe.kernels import llvm_ir as ll
from hybridmoe.kernels.llvm_ir import (
    F32,
    I8,
    I16,
    I32,
    const_vec,
    declare,
    fp16_scale,
    i64,
    load,
    pairwise_sum,
    splat,
    target_has,
)
from hybridmoe.kernels.numba_simd import LINE_BYTES, PREFETCH_LOCALITY, TILES, prefetch_distance
from hybridmoe.quant.activation_q8 import LANES
from hybridmoe.quant.formats import KERNEL_BLOCK, NIBBLE_ZERO, KernelFormat

V8I, V8F, V32B, V16B = (ir.VectorType(t, n) for t, n in ((I32, 8), (F32, 8), (I8, 32), (I8, 16)))
V16S, V32S, V8H = (ir.VectorType(I16, n) for n in (16, 32, 8))
V8HALF = ir.VectorType(ir.HalfType(), 8)
DOT_PATHS = ("vnni", "avx2", "portable")
# a pair's super-block sum S is accumulated in two independent chains (pieces p, p + 2, ...
# in chain p mod 2), added at the end: one chain of 8 dependent `vpdpwssd` (~4 cycles
# each) was the T = 1 tile's critical path. Measured (the AMD EPYC, 4 x 1 tile, q4_k, rows of
# 768 / 2048 / 4096 weights in cache): 1 chain 8.2 / 7.6 / 6.5 ns per 256 weights, 2 chains
# 7.0 / 6.5 / 6.5, 4 chains 7.0 / 6.6 / 6.6; the same integers (int32 sums, any order). Only
# in tiles of one activation row: with more, the tile's pairs are chains enough (both
# codegens in one process, ns per 256 weights and token, q4_k / q6_k: 4 x 1 9.19 -> 7.86 /
# 7.11 -> 7.03, 2 x 1 8.61 -> 8.58 / 8.12 -> 7.55; 4 x 2 4.39 -> 4.62 / 4.71 -> 4.82, 2 x 3
# 4.12 -> 4.29 / 4.22 -> 4.37, 2 x 4 4.12 -> 4.01 / 3.83 -> 3.87, 1 x 4 3.69 -> 3.84 / 3.74 ->
# 3.73)
CHAINS = 2
# a k-quant tile of one weight row and this many activation rows (beside TILES), where the
# target has AVX-512's 32 vector registers (one piece's u, scales and 8 q beside 8 sums; on
# AVX2's 16 they would spill): a row's unpacking and scales shared by 8 tokens, not 4.
# Measured (the AMD EPYC, 2026-12-07, one thread, 16 rows of 2048 weights in L1, ns per 256
# weights and token, 2 x 4 -> 1 x 8): q4_k 3.82 -> 3.42, q5_k 4.14 -> 3.52, q6_k 3.83 -> 3.21;
# 4 x 4 4.30 / 4.87 / 3.85 (no gain, so not built), q4_0 2 x 8 3.61 against 2 x 4's 3.53
WIDE_TOKENS = 8
# super-blocks a 1 x 1 tile reduces together (_superblock_loop)
RUN = 4
OFFSET = 128  # VNNI's weight bias: v + 128 is an unsigned byte
# the most words _gathered_scales loads (two zmm registers: one vpermi2w). Measured (the AMD
# EPYC, 2026-12-07, `bench_cpu_moe.py --tile`, 4 x 1 tile from L1, ns per 256 weights, inserts
# -> gathered, 2 runs each): q4_0 (64 words) 5.1 -> 4.5-4.6; q8_0 (128 words, a tree of
# permutes over four registers) 5.5 -> 5.7, so q8_0 keeps the inserts
GATHER_WORDS = 64


def dot_path() -> str:
    """The integer dot instructions of the target numba compiles for: `vnni` (AVX-512 VNNI
    with VL, or AVX-VNNI), `avx2` or `portable`."""
    if (target_has("avx512vnni") and target_has("avx512vl")) or target_has("avxvnni"):
        return "vnni"
    return "avx2" if target_has("avx2") else "portable"


def _block_dot(builder: ir.IRBuilder, path: str):
    """(prepare, dot, bias): dot(prepare(v), q) -> <8 x i32> whose lanes sum to Σ v_i q_i +
    bias Σ q_i of two <32 x i8>; `prepare(v)` is computed once per weight block (shared by the
    activation rows)."""
    if path == "portable":

        def prepare(v):
            return builder.sext(v, ir.VectorType(I32, 32))

        def dot(wide, q):
            prod = builder.mul(wide, builder.sext(q, ir.VectorType(I32, 32)))
            parts = [
                builder.shuffle_vector(prod, prod, const_vec(I32, list(range(k, 32, 4))))
                for k in range(4)
            ]
            return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))

        return prepare, dot, 0
    if path == "vnni":
        dpbusd = declare(builder, "llvm.x86.avx512.vpdpbusd.256", V8I, [V8I] * 3)

        def prepare(v):  # v + 128 as unsigned bytes
            return builder.bitcast(builder.xor(v, const_vec(I8, [0x80] * 32)), V8I)

        def dot(biased, q):
            return builder.call(dpbusd, [ir.Constant(V8I, None), biased, builder.bitcast(q, V8I)])

        return prepare, dot, OFFSET
    abs_fn = declare(builder, "llvm.abs.v32i8", V32B, [V32B, ir.IntType(1)])
    sign_fn = declare(builder, "llvm.x86.avx2.psign.b", V32B, [V32B, V32B])
    maddubs = declare(builder, "llvm.x86.avx2.pmadd.ub.sw", V16S, [V32B, V32B])
    maddwd = declare(builder, "llvm.x86.avx2.pmadd.wd", V8I, [V16S, V16S])
    ones = ir.Constant(V16S, [1] * 16)

    def prepare(v):
        return v, builder.call(abs_fn, [v, ir.Constant(ir.IntType(1), 0)])

    def dot(prepared, q):
        v, magnitude = prepared
        pairs = builder.call(maddubs, [magnitude, builder.call(sign_fn, [q, v])])
        return builder.call(maddwd, [pairs, ones])

    return prepare, dot, 0


def _half_sums(builder: ir.IRBuilder, parts: list[ir.Value]) -> list[ir.Value]:
    """4k x <8 x i32> -> k vectors: lane i of half h of vector v is the sum of the 4 lanes of
    half h of parts[4v + i] (exact), by two levels of pairwise adds within 128-bit halves."""
    even = const_vec(I32, [0, 2, 8, 10, 4, 6, 12, 14])
    odd = const_vec(I32, [1, 3, 9, 11, 5, 7, 13, 15])
    for _ in range(2):
        parts = [
            builder.add(builder.shuffle_vector(a, b, even), builder.shuffle_vector(a, b, odd))
            for a, b in zip(parts[::2], parts[1::2], strict=True)
        ]
    return parts


def _transpose_sum(builder: ir.IRBuilder, parts: list[ir.Value]) -> ir.Value:
    """8 (or 4) x <8 x i32> -> <8 (or 4) x i32> whose lane b is the sum of parts[b]'s lanes
    (exact): pairwise adds within 128-bit halves (`vphaddd`, no lane crossing) down to one
    vector, then each half-sum added to its other half's (one cross-half shuffle per operand)."""
    parts = _half_sums(builder, parts)
    if len(parts) == 1:  # 4 parts: lanes 0-3 their sums over lanes 0-3, 4-7 over lanes 4-7
        (sums,) = parts
        halves = [
            builder.shuffle_vector(sums, sums, const_vec(I32, [*range(h, h + 4)])) for h in (0, 4)
        ]
        return builder.add(*halves)
    low, high = parts  # lanes 0-3: parts[0..3]'s sums over lanes 0-3, 4-7: over lanes 4-7
    first = builder.shuffle_vector(low, high, const_vec(I32, [0, 1, 2, 3, 8, 9, 10, 11]))
    second = builder.shuffle_vector(low, high, const_vec(I32, [4, 5, 6, 7, 12, 13, 14, 15]))
    return builder.add(first, second)


def _bias_sums(builder: ir.IRBuilder, bias: int):
    """None for a dot without bias, else sums(s_row, block, n): bias B_b for the n 32-blocks
    from `block` on (<8 x i32> for n = 8, an i32 for n = 1), B_b = Σ q of block b, from the
    pairs of 16-weight sums (int16) at s_row; exact (|bias B_b| <= 128 * 32 * 127)."""
    if not bias:
        return None

    def sums(s_row: ir.Value, block: ir.Value, n: int) -> ir.Value:
        at = builder.gep(s_row, [builder.mul(block, i64(2))])
        wide = ir.VectorType(I32, 2 * n)
        pairs = builder.sext(load(builder, at, ir.VectorType(ir.IntType(16), 2 * n), align=2), wide)
        even, odd = (const_vec(I32, list(range(k, 2 * n, 2))) for k in (0, 1))
        both = builder.add(
            builder.shuffle_vector(pairs, pairs, even), builder.shuffle_vector(pairs, pairs, odd)
        )  # <n x i32>: B_b
        scaled = builder.mul(both, ir.Constant(both.type, [bias] * n))
        return scaled if n > 1 else builder.extract_element(scaled, ir.Constant(I32, 0))

    return sums


def _pair_ops(builder: ir.IRBuilder, path: str):
    """(pairs, scaled_add, madd): pairs(u, q) <16 x i16> of <32 x i8> u (unsigned) and q
    (signed): lane l = u_2l q_2l + u_2l+1 q_2l+1 (|.| < 2^15 for u < 64: exact); madd(a, b)
    <8 x i32>: lane l = a_2l b_2l + a_2l+1 b_2l+1 of two <16 x i16>; scaled_add(acc, a, b) =
    acc + madd(a, b)."""
    if path == "portable":

        def halves_sum(vec):
            n = vec.type.count
            even, odd = (const_vec(I32, list(range(k, n, 2))) for k in (0, 1))
            return builder.add(
                builder.shuffle_vector(vec, vec, even), builder.shuffle_vector(vec, vec, odd)
            )

        def pairs(u, q):
            return halves_sum(builder.mul(builder.zext(u, V32S), builder.sext(q, V32S)))

        def madd(a, b):
            wide = ir.VectorType(I32, 16)
            return halves_sum(builder.mul(builder.sext(a, wide), builder.sext(b, wide)))

        return pairs, lambda acc, a, b: builder.add(acc, madd(a, b)), madd
    maddubs = declare(builder, "llvm.x86.avx2.pmadd.ub.sw", V16S, [V32B, V32B])
    maddwd = declare(builder, "llvm.x86.avx2.pmadd.wd", V8I, [V16S, V16S])

    def pairs(u, q):
        return builder.call(maddubs, [u, q])

    def madd(a, b):
        return builder.call(maddwd, [a, b])

    if path != "vnni":
        return pairs, lambda acc, a, b: builder.add(acc, madd(a, b)), madd
    dpwssd = declare(builder, "llvm.x86.avx512.vpdpwssd.256", V8I, [V8I] * 3)

    def scaled_add(acc, a, b):
        return builder.call(dpwssd, [acc, builder.bitcast(a, V8I), builder.bitcast(b, V8I)])

    return pairs, scaled_add, madd


def _pair_chunks(wrows: int, xrows: int) -> list[list[tuple[int, int]]]:
    """The tile's (weight row, activation row) pairs, activation row major, in the chunks of 4
    whose super-block products are reduced and scaled as one vector (their S and M: 8 partial
    vectors)."""
    pairs = [(r, c) for c in range(xrows) for r in range(wrows)]
    return [pairs[k : k + 4] for k in range(0, len(pairs), 4)]


def _superblock_step(builder: ir.IRBuilder, kernel: KernelFormat, path: str, rows: tuple):
    """(step, run): step(block, lane) adds super-block `block` of every (weight row, activation
    row) pair into lane `lane` of its accumulator by the contract's super-block steps; the same
    super-block of a later tile (`tile_bytes` on: prefetch_distance) prefetched into L2. A
    chunk's (_pair_chunks) S and M partial vectors are summed together (_transpose_sum),
    converted and scaled in one vector, and added into lane `lane` of its lane accumulators
    (lanes[lane]: one <n x float> for the chunk's n pairs). Each pair's S:
    _pair_sums_one_token for a tile of one activation row, else _pair_sums_piece_by_piece (the
    same integers either way). run(block, m, lane), for a tile of one pair: super-blocks
    block .. block + m - 1 (m <= 4) into lanes lane .. lane + m - 1, their S and M reduced,
    converted and scaled together as a chunk's pairs are (each super-block's product and its
    lane's sum the same operations as step's: the same bits, a quarter of the reductions)."""
    w_rows, q_rows, d_rows, s_rows, chunks, tile_bytes = rows
    _, _, madd = _pair_ops(builder, path)
    prefetch = declare(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), *[I32] * 3])
    hints = [ir.Constant(I32, v) for v in (0, PREFETCH_LOCALITY, 1)]
    pieces = kernel.pieces
    one_token = all(c == 0 for chunk, _ in chunks for _, c in chunk)

    def block_terms(block: ir.Value) -> list[list[tuple]]:
        """Per chunk, per pair: (S, M or None, fl(d d_x), fl(dmin d_x) or None) of the
        super-block `block` (M None: the minimum term taken from S)."""
        weights, made = [], []  # per weight row: its SuperBlockIntsIR; one token: its pieces
        for w_row in w_rows:
            at = builder.gep(w_row, [builder.mul(block, i64(kernel.block_bytes))])
            for line in range(0, kernel.block_bytes, LINE_BYTES):
                builder.call(
                    prefetch, [builder.gep(at, [builder.add(tile_bytes, i64(line))]), *hints]
                )
            ints = kernel.superblock_ints_ir(builder, at)
            weights.append(ints)
            if one_token:  # (pair scales, u) of every piece, shared by the x rows
                scales = [ints.pair_scales(p) for p in range(pieces)]
                made.append((scales, [ints.piece(p) for p in range(pieces)]))
        first = builder.mul(block, i64(KERNEL_BLOCK * pieces))
        activations, qs = [], []  # per activation row: (16-weight sums, d_x); one token: q
        for q_row, d_row, s_row in zip(q_rows, d_rows, s_rows, strict=True):
            if one_token:
                qs.append([_q_piece(builder, q_row, first, p) for p in range(pieces)])
            sums = load(builder, builder.gep(s_row, [builder.mul(block, i64(16))]), V16S, align=2)
            activations.append((sums, builder.load(builder.gep(d_row, [block]))))
        if one_token:
            sum_of = _pair_sums_one_token(builder, path, made, qs, pieces)
        else:
            tile_pairs = [pair for chunk, _ in chunks for pair in chunk]
            rows = (weights, q_rows, first)
            sum_of = _pair_sums_piece_by_piece(builder, path, rows, tile_pairs, pieces)
        terms = []
        for chunk, _ in chunks:
            chunk_terms = []
            for r, c in chunk:
                ints, (sums, dx) = weights[r], activations[c]
                acc, low = sum_of(r, c), madd(ints.lows, sums)
                if ints.dmin is None:
                    chunk_terms.append(
                        (builder.sub(acc, low), None, builder.fmul(ints.d, dx), None)
                    )
                else:
                    s_scale, m_scale = builder.fmul(ints.d, dx), builder.fmul(ints.dmin, dx)
                    chunk_terms.append((acc, low, s_scale, m_scale))
            terms.append(chunk_terms)
        return terms

    def products(terms: list[tuple]) -> ir.Value:
        """<n x float> of n terms: lane k fl(S_k) fl(d d_x)_k - fl(M_k) fl(dmin d_x)_k (or
        fl(S_k - L_k) fl(d d_x)_k), the n terms' sums reduced together."""
        n = len(terms)
        s_parts, m_parts = [t[0] for t in terms], [t[1] for t in terms if t[1] is not None]
        s_scales, m_scales = [t[2] for t in terms], [t[3] for t in terms if t[3] is not None]
        scaled = _scaled_sums(builder, s_parts + m_parts, s_scales + m_scales)
        product = builder.shuffle_vector(scaled, scaled, const_vec(I32, [*range(n)]))
        if m_parts:  # fl(S) fl(d dx) - fl(M) fl(dmin dx)
            minimum = builder.shuffle_vector(scaled, scaled, const_vec(I32, [*range(n, 2 * n)]))
            product = builder.fsub(product, minimum)
        return product

    def add_into(lanes: ir.Value, lane: ir.Value, product: ir.Value) -> None:
        """lanes[lane ...] += product, one lane per element of `product` (<n x float>)."""
        at = builder.gep(lanes, [ir.Constant(I32, 0), lane])
        at = builder.bitcast(at, product.type.as_pointer())
        builder.store(builder.fadd(builder.load(at, align=4), product), at, align=4)

    def step(block: ir.Value, lane: ir.Value) -> None:
        for (_, lanes), terms in zip(chunks, block_terms(block), strict=True):
            add_into(lanes, lane, products(terms))

    def run(block: ir.Value, m: int, lane: ir.Value) -> None:
        ((_, lanes),) = chunks
        terms = [block_terms(builder.add(block, i64(j)))[0][0] for j in range(m)]
        add_into(lanes, lane, products(terms))

    return step, run


def _q_piece(builder: ir.IRBuilder, q_row: ir.Value, first: ir.Value, p: int) -> ir.Value:
    """<32 x i8>: the q8 activations of piece p of the super-block starting at q_row[first]."""
    return load(builder, builder.gep(q_row, [builder.add(first, i64(p * KERNEL_BLOCK))]), V32B)


def _pair_sums_one_token(builder, path, made, qs, pieces):
    """sum_of(r, c) -> <8 x i32>, the super-block's S of pair (r, c) of a one-token tile,
    emitted where called, from its pieces made first (made[r]: weight row r's (pair scales,
    u) of each piece; qs[c]: the activation row's q of each piece: all the super-block's
    loads early, as a one-token tile streams from memory); in CHAINS chains (pieces p mod
    CHAINS) added at the end."""
    pairs, scaled_add, _ = _pair_ops(builder, path)

    def sum_of(r: int, c: int) -> ir.Value:
        (scales, us), q = made[r], qs[c]
        chains = [ir.Constant(V8I, None)] * CHAINS
        for p in range(pieces):
            k = p % CHAINS
            chains[k] = scaled_add(chains[k], pairs(us[p], q[p]), scales[p])
        return functools.reduce(builder.add, chains)

    return sum_of


def _pair_sums_piece_by_piece(builder, path, rows, tile_pairs, pieces):
    """_pair_sums_one_token's sum_of for a tile of more activation rows (`rows`: the weight
    rows' SuperBlockIntsIR, the activation rows' q, the super-block's first weight), every
    pair's S emitted here, piece by piece: each piece's u, scales and q dotted into every
    pair's S before the next piece's are made, so only one piece's values are live beside the
    sums (made all first, the 2 x 4 q4_k tile's loop held 73 stack loads and stores in 414
    instructions; 27 in 371 so). The same integers."""
    weights, q_rows, first = rows
    pairs, scaled_add, _ = _pair_ops(builder, path)
    sums = dict.fromkeys(tile_pairs, ir.Constant(V8I, None))
    for p in range(pieces):
        us = [ints.piece(p) for ints in weights]
        scales = [ints.pair_scales(p) for ints in weights]  # shared by the activation rows
        qs = [_q_piece(builder, q_row, first, p) for q_row in q_rows]
        for r, c in tile_pairs:
            sums[r, c] = scaled_add(sums[r, c], pairs(us[r], qs[c]), scales[r])
    return lambda r, c: sums[r, c]


def _scaled_sums(builder: ir.IRBuilder, parts: list[ir.Value], scales: list[ir.Value]) -> ir.Value:
    """<4 or 8 x float>: lane k = fl(Σ lanes of parts[k]) * scales[k] (each product rounded
    to float32), k < len(parts) <= 8; zero parts pad the sum to 4 or 8 vectors."""
    width = 4 if len(parts) <= 4 else LANES
    zero = ir.Constant(V8I, None)
    sums = _transpose_sum(builder, parts + [zero] * (width - len(parts)))
    scale = ir.Constant(ir.VectorType(F32, width), None)
    for k, value in enumerate(scales):
        scale = builder.insert_element(scale, value, ir.Constant(I32, k))
    return builder.fmul(builder.sitofp(sums, scale.type), scale)


def _add_to_lane(builder: ir.IRBuilder, acc: ir.Value, lane: ir.Value, product: ir.Value) -> None:
    """Lane `lane` (an i32, constant or not) of the <8 x float> at `acc` += `product`."""
    vec = builder.load(acc)
    summed = builder.fadd(builder.extract_element(vec, lane), product)
    builder.store(builder.insert_element(vec, summed, lane), acc)


def _superblock_loop(builder, kernel, path, rows, shape, nblocks, store) -> None:
    """The tile's loop over super-blocks: each pair chunk's lane accumulators (zeroed), the
    super-block steps, then per pair the contract's lane sum (elementwise over a chunk's pairs)
    handed to store(r, c, y). A tile of one pair (1 x 1) takes its super-blocks RUN at a time
    (_superblock_step's run; the last 1 to RUN - 1 together too): its S and M reduced as a
    4-pair chunk's are, not one super-block's alone. Measured (the AMD EPYC, 2026-12-07, one
    thread, 16 rows of 2048 weights in L1, ns per 256 weights, one super-block at a time -> 4:
    q4_k 7.8 -> 7.0-7.1, q5_k 8.7 -> 8.1, q6_k 8.2 -> 7.3-7.4; 2 at a time: q4_k 7.4, q6_k
    7.2; the 4 x 1 tile 6.2 / 7.3 / 6.9)."""
    w_rows, q_rows, d_rows, s_rows, tile_bytes = rows
    chunks = []
    for chunk in _pair_chunks(*shape):
        lanes_type = ir.ArrayType(ir.VectorType(F32, len(chunk)), LANES)
        chunks.append((chunk, cgutils.alloca_once_value(builder, ir.Constant(lanes_type, None))))
    step, run = _superblock_step(
        builder, kernel, path, (w_rows, q_rows, d_rows, s_rows, chunks, tile_bytes)
    )

    def lane_of(block: ir.Value) -> ir.Value:
        return builder.trunc(builder.and_(block, i64(LANES - 1)), I32)

    if shape == (1, 1):
        runs = builder.udiv(nblocks, i64(RUN))
        with cgutils.for_range(builder, runs) as loop:
            block = builder.mul(loop.index, i64(RUN))
            run(block, RUN, lane_of(block))
        done = builder.mul(runs, i64(RUN))
        left = builder.sub(nblocks, done)
        for m in range(RUN - 1, 0, -1):
            with builder.if_then(builder.icmp_unsigned("==", left, i64(m))):
                run(done, m, lane_of(done))
    else:
        with cgutils.for_range(builder, nblocks) as loop:
            step(loop.index, lane_of(loop.index))
    for chunk, lanes in chunks:
        values = [builder.load(builder.gep(lanes, [i64(0), i64(j)])) for j in range(LANES)]
        while len(values) > 1:  # ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
            half = len(values) // 2
            values = [builder.fadd(a, b) for a, b in zip(values[:half], values[half:], strict=True)]
        for k, (r, c) in enumerate(chunk):
            store(r, c, builder.extract_element(values[0], ir.Constant(I32, k)))


def _tile_codegen(kernel: KernelFormat, wrows: int, xrows: int):
    path = dot_path()
    superblocks = kernel.superblock_ints_ir is not None
    weights_per_block = KERNEL_BLOCK * kernel.pieces

    def codegen(context, builder, sig, args):
        w_ty, _, _, _, q_ty, d_ty, s_ty, offs_ty, _, out_ty, _, _ = sig.args[3:]
        weights, w_off, row_bytes, nblocks, xq, xd, xs, x_offs, first, out, out_off, stride = args[
            3:
        ]
        w_data = context.make_array(w_ty)(context, builder, weights).data
        w_rows = [
            builder.gep(w_data, [builder.add(w_off, builder.mul(row_bytes, i64(r)))])
            for r in range(wrows)
        ]
        q_data = context.make_array(q_ty)(context, builder, xq).data
        d_data = context.make_array(d_ty)(context, builder, xd).data
        offs_data = context.make_array(offs_ty)(context, builder, x_offs).data
        x_starts = [
            builder.load(builder.gep(offs_data, [builder.add(first, i64(c))])) for c in range(xrows)
        ]
        q_rows = [builder.gep(q_data, [s]) for s in x_starts]
        shift = i64(weights_per_block.bit_length() - 1)  # a block's scale: one per block
        d_rows = [builder.gep(d_data, [builder.lshr(s, shift)]) for s in x_starts]
        tile_bytes = prefetch_distance(builder, row_bytes, wrows)  # a later tile's block
        s_data = context.make_array(s_ty)(context, builder, xs).data
        s_rows = [builder.gep(s_data, [builder.lshr(s, i64(4))]) for s in x_starts]
        out_data = context.make_array(out_ty)(context, builder, out).data

        def store(r: int, c: int, total: ir.Value) -> None:
            index = builder.add(out_off, builder.add(builder.mul(stride, i64(c)), i64(r)))
            builder.store(total, builder.gep(out_data, [index]))

        if superblocks:
            rows = (w_rows, q_rows, d_rows, s_rows, tile_bytes)
            _superblock_loop(builder, kernel, path, rows, (wrows, xrows), nblocks, store)
            return context.get_dummy_value()
        accs = [
            [cgutils.alloca_once_value(builder, ir.Constant(V8F, None)) for _ in range(xrows)]
            for _ in range(wrows)
        ]
        rows = (w_rows, q_rows, d_rows, s_rows, accs, tile_bytes)
        groups = builder.udiv(nblocks, i64(LANES))
        nibble_pairs = kernel.nibble_block_ir is not None and path != "portable" and wrows % 2 == 0
        group_step = (_nibble_pair_step if nibble_pairs else _group_step)(
            builder, kernel, path, rows
        )
        with cgutils.for_range(builder, groups) as loop:
            group_step(builder.mul(loop.index, i64(LANES)))
        done = builder.mul(groups, i64(LANES))
        tail_step = _tail_step(builder, kernel, path, rows)
        with cgutils.for_range(builder, builder.sub(nblocks, done)) as loop:
            tail_step(builder.add(done, loop.index), loop.index)
        for r in range(wrows):
            for c in range(xrows):
                store(r, c, pairwise_sum(builder, builder.load(accs[r][c]), LANES))
        return context.get_dummy_value()

    return codegen


def _fp16_to_float(builder: ir.IRBuilder, bits: ir.Value) -> ir.Value:
    """<8 x float> of 8 fp16 scales' bits (<8 x i16>), converted at once (one vcvtph2ps;
    exact): 8 blocks' scales gathered as integers, not converted one by one."""
    return builder.fpext(builder.bitcast(bits, V8HALF), V8F)


def _group_starts(builder: ir.IRBuilder, kernel: KernelFormat, w_rows: list, tile_bytes: ir.Value):
    """starts(first_block) -> per weight row a byte pointer to its blocks first_block .. + 7;
    the same blocks of a later tile (`tile_bytes` on) prefetched into L2, every line, as
    numba_simd.tile_dot does."""
    prefetch = declare(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), *[I32] * 3])
    hints = [ir.Constant(I32, v) for v in (0, PREFETCH_LOCALITY, 1)]
    group_bytes = LANES * kernel.block_bytes

    def starts(first_block: ir.Value) -> list[ir.Value]:
        groups = []
        for w_row in w_rows:
            group = builder.gep(w_row, [builder.mul(first_block, i64(kernel.block_bytes))])
            for line in range(0, group_bytes, LINE_BYTES):
                ahead = builder.gep(group, [builder.add(tile_bytes, i64(line))])
                builder.call(prefetch, [ahead, *hints])
            groups.append(group)
        return groups

    return starts


def _gathered_scales(
    builder: ir.IRBuilder, kernel: KernelFormat, group: ir.Value, scale_ptrs: list[tuple]
) -> ir.Value | None:
    """<8 x i16>: the fp16 scales' bits of the LANES blocks at byte pointer `group` (whose
    block IR gave `scale_ptrs`), from one vector load of the group and one word permute
    (AVX-512 BW's vpermw / vpermi2w) instead of a word insert per block (28 of the q4_0 4 x 1
    tile's 223 instructions a group, each a load and a shuffle). None where the target lacks
    the permute, or a block's scale is not its first 2 bytes (q8_0's and q4_0's layout, ggml's:
    read off the block IR, which hands back the block's own pointer), or the load would read
    past the group."""
    stride, odd = divmod(kernel.block_bytes, 2)
    at_starts = all(d is ptr for d, ptr in scale_ptrs)
    if not target_has("avx512bw") or odd or not at_starts:
        return None
    last = (LANES - 1) * stride  # the last block's scale, in words from the group's start
    words = 1 << last.bit_length()  # a power of two past it: q4_0 64, q8_0 128
    if words > GATHER_WORDS or 2 * words > LANES * kernel.block_bytes:
        return None
    group_words = load(builder, group, ir.VectorType(I16, words))
    return ll.lanes(builder, group_words, [b * stride for b in range(LANES)])


def _inserted_scales(builder: ir.IRBuilder, scale_ptrs: list[tuple]) -> ir.Value:
    """<8 x i16>: the fp16 scales' bits at the LANES blocks' scale pointers, a word insert each
    (every target; _gathered_scales where it can)."""
    scales = ir.Constant(V8H, None)
    for b, (d, _) in enumerate(scale_ptrs):
        scales = builder.insert_element(scales, load(builder, d, I16), ir.Constant(I32, b))
    return scales


def _group_scales(
    builder: ir.IRBuilder, kernel: KernelFormat, group: ir.Value, scale_ptrs: list[tuple]
) -> ir.Value:
    """<8 x float>: the LANES blocks' scales (`scale_ptrs`: per block (its scale pointer, its
    own pointer)), converted at once; the same values either way they are gathered."""
    bits = _gathered_scales(builder, kernel, group, scale_ptrs)
    return _fp16_to_float(builder, _inserted_scales(builder, scale_ptrs) if bits is None else bits)


def _add_products(builder: ir.IRBuilder, acc: ir.Value, sums: ir.Value, dw: ir.Value, dx: ir.Value):
    """The lane accumulator at `acc` += fl(sums) * fl(dw * dx), 8 blocks' products (<8 x i32>
    block sums, <8 x float> weight and activation scales)."""
    products = builder.fmul(builder.sitofp(sums, V8F), builder.fmul(dw, dx))
    builder.store(builder.fadd(builder.load(acc), products), acc)


def _group_step(builder: ir.IRBuilder, kernel: KernelFormat, path: str, rows: tuple):
    """step(first_block): blocks first_block .. + 7 of every (weight row, activation row)
    pair into its lane accumulator; the same blocks of a later tile prefetched
    (_group_starts)."""
    w_rows, q_rows, d_rows, s_rows, accs, tile_bytes = rows
    prepare, dot, bias = _block_dot(builder, path)
    bias_sums = _bias_sums(builder, bias)
    starts = _group_starts(builder, kernel, w_rows, tile_bytes)

    def step(first_block: ir.Value) -> None:
        weights = []  # per weight row: ([prepared block] * 8, <8 x float> scales)
        for group in starts(first_block):
            blocks, scale_ptrs = [], []
            for b in range(LANES):
                block = builder.gep(group, [i64(b * kernel.block_bytes)])
                v, d = kernel.int8_block_ir(builder, block)
                blocks.append(prepare(v))
                scale_ptrs.append((d, block))
            weights.append((blocks, _group_scales(builder, kernel, group, scale_ptrs)))
        at = builder.mul(first_block, i64(KERNEL_BLOCK))
        for c, (q_row, d_row, s_row) in enumerate(zip(q_rows, d_rows, s_rows, strict=True)):
            qs = [
                load(builder, builder.gep(q_row, [builder.add(at, i64(b * KERNEL_BLOCK))]), V32B)
                for b in range(LANES)
            ]
            dx = load(builder, builder.gep(d_row, [first_block]), V8F, align=4)
            biases = bias_sums and bias_sums(s_row, first_block, LANES)
            for (blocks, dw), row_accs in zip(weights, accs, strict=True):
                sums = _transpose_sum(builder, [dot(w, q) for w, q in zip(blocks, qs, strict=True)])
                sums = builder.sub(sums, biases) if bias_sums else sums
                _add_products(builder, row_accs[c], sums, dw, dx)

    return step


def _nibble_dot(builder: ir.IRBuilder, path: str):
    """dot(low, high, q_low, q_high) -> <8 x i32> whose lanes 0-3 sum to Σ u_i q_i over the
    low 16 bytes of each operand and lanes 4-7 over the high 16, for unsigned 4-bit u (`low`,
    `high`: <32 x i8>, the nibbles of two blocks side by side) and signed q: `vpdpbusd` twice
    (VNNI), or `vpmaddubsw` twice (each pair sum |.| <= 2 * 15 * 127, their sum < 2^15: exact)
    and one `vpmaddwd` (AVX2)."""
    if path == "vnni":
        dpbusd = declare(builder, "llvm.x86.avx512.vpdpbusd.256", V8I, [V8I] * 3)

        def dot(low, high, q_low, q_high):
            acc = ir.Constant(V8I, None)
            for u, q in ((low, q_low), (high, q_high)):
                acc = builder.call(dpbusd, [acc, builder.bitcast(u, V8I), builder.bitcast(q, V8I)])
            return acc

        return dot
    maddubs = declare(builder, "llvm.x86.avx2.pmadd.ub.sw", V16S, [V32B, V32B])
    maddwd = declare(builder, "llvm.x86.avx2.pmadd.wd", V8I, [V16S, V16S])
    ones = ir.Constant(V16S, [1] * 16)

    def dot(low, high, q_low, q_high):
        pairs = builder.add(
            builder.call(maddubs, [low, q_low]), builder.call(maddubs, [high, q_high])
        )
        return builder.call(maddwd, [pairs, ones])

    return dot


def _nibble_pair_step(builder: ir.IRBuilder, kernel: KernelFormat, path: str, rows: tuple):
    """_group_step for 4-bit blocks (KernelFormat.nibble_block_ir: q4_0) on the VNNI and AVX2
    paths, weight rows two at a time: block b of rows r and r + 1 loaded side by side into one
    <32 x i8>, its low nibbles (weights 0-15 of each) and high nibbles (16-31) each one vector,
    dotted unsigned (_nibble_dot) with the activation block's halves broadcast to both 128-bit
    lanes; the 8 blocks' vectors of a pair reduce to row r's block sums in one half and row
    r + 1's in the other (_half_sums), then one shuffle each. Σ u q - NIBBLE_ZERO B (B from the
    16-weight sums) is _group_step's Σ (u - NIBBLE_ZERO) q, exactly: the same bits. Against
    _group_step per row and block: no widening shuffle, no bias xor, half the unpacking ops and
    half the transpose tree."""
    w_rows, q_rows, d_rows, s_rows, accs, tile_bytes = rows
    dot = _nibble_dot(builder, path)
    bias_sums = _bias_sums(builder, NIBBLE_ZERO)
    starts = _group_starts(builder, kernel, w_rows, tile_bytes)
    both = const_vec(I32, list(range(32)))
    low_mask, shift = const_vec(I8, [0xF] * 32), const_vec(I8, [4] * 32)
    halves = [const_vec(I32, [*range(h, h + 4), *range(8 + h, 12 + h)]) for h in (0, 4)]
    twice = const_vec(I32, [*range(16)] * 2)

    def step(first_block: ir.Value) -> None:
        groups = starts(first_block)
        scale_ptrs = [[] for _ in groups]  # per weight row: (scale pointer, block) of block b
        pairs = []  # per pair of weight rows: [(low, high) nibbles of block b] * 8
        for r in range(0, len(w_rows), 2):
            blocks = []
            for b in range(LANES):
                packed = []
                for k in (r, r + 1):
                    at = builder.gep(groups[k], [i64(b * kernel.block_bytes)])
                    nibbles, d = kernel.nibble_block_ir(builder, at)
                    packed.append(load(builder, nibbles, V16B))
                    scale_ptrs[k].append((d, at))
                packed = builder.shuffle_vector(*packed, both)
                blocks.append((builder.and_(packed, low_mask), builder.lshr(packed, shift)))
            pairs.append(blocks)
        scales = [
            _group_scales(builder, kernel, group, ptrs)
            for group, ptrs in zip(groups, scale_ptrs, strict=True)
        ]
        at = builder.mul(first_block, i64(KERNEL_BLOCK))
        for c, (q_row, d_row, s_row) in enumerate(zip(q_rows, d_rows, s_rows, strict=True)):
            qs = []  # per block: its activations 0-15 and 16-31, each in both 128-bit lanes
            for b in range(LANES):
                block = builder.gep(q_row, [builder.add(at, i64(b * KERNEL_BLOCK))])
                halves16 = (load(builder, builder.gep(block, [i64(h)]), V16B) for h in (0, 16))
                qs.append([builder.shuffle_vector(h, h, twice) for h in halves16])
            dx = load(builder, builder.gep(d_row, [first_block]), V8F, align=4)
            biases = bias_sums(s_row, first_block, LANES)
            for p, blocks in enumerate(pairs):
                parts = [dot(*w, *q) for w, q in zip(blocks, qs, strict=True)]
                first, second = _half_sums(builder, parts)
                for k, half in enumerate(halves):
                    r = 2 * p + k
                    sums = builder.sub(builder.shuffle_vector(first, second, half), biases)
                    _add_products(builder, accs[r][c], sums, scales[r], dx)

    return step


def _tail_step(builder: ir.IRBuilder, kernel: KernelFormat, path: str, rows: tuple):
    """step(block, lane): one block of every pair added into lane `lane` of its accumulator."""
    w_rows, q_rows, d_rows, s_rows, accs, _ = rows
    prepare, dot, bias = _block_dot(builder, path)
    bias_sums = _bias_sums(builder, bias)
    reduce_add = declare(builder, "llvm.vector.reduce.add.v8i32", I32, [V8I])

    def step(block: ir.Value, lane: ir.Value) -> None:
        weights = []
        for w_row in w_rows:
            at = builder.gep(w_row, [builder.mul(block, i64(kernel.block_bytes))])
            v, d = kernel.int8_block_ir(builder, at)
            weights.append((prepare(v), fp16_scale(builder, d)))
        for c, (q_row, d_row, s_row) in enumerate(zip(q_rows, d_rows, s_rows, strict=True)):
            q = load(builder, builder.gep(q_row, [builder.mul(block, i64(KERNEL_BLOCK))]), V32B)
            dx = builder.load(builder.gep(d_row, [block]))
            bias_sum = bias_sums and bias_sums(s_row, block, 1)
            for (w, dw), row_accs in zip(weights, accs, strict=True):
                total = builder.call(reduce_add, [dot(w, q)])
                total = builder.sub(total, bias_sum) if bias_sums else total
                product = builder.fmul(builder.sitofp(total, F32), builder.fmul(dw, dx))
                _add_to_lane(builder, row_accs[c], lane, product)

    return step


@intrinsic
def tile_dot_q8(
    typingctx,
    fmt,
    wrows,
    xrows,
    weights,
    w_off,
    row_bytes,
    nblocks,
    xq,
    xd,
    xs,
    x_offs,
    first,
    out,
    out_off,
    out_stride,
):
    """out[out_off + c * out_stride + r] = the q8 contract's dot of weight row r (`nblocks`
    blocks of `fmt`, a KernelFormat with int8_block_ir or superblock_ints_ir, at byte w_off +
    r * row_bytes of `weights`) with the quantised activation row starting at
    xq[x_offs[first + c]] (int8), whose block scales start at xd[x_offs[first + c] / W] (W the
    block's weights: 32, or 256 a super-block) and its 16-weight sums (int16) at
    xs[x_offs[first + c] / 16], for r < wrows, c < xrows (TILES)."""
    from hybridmoe.kernels.numba_simd import KernelFormatType

    if not isinstance(fmt, KernelFormatType):
        return None
    if fmt.kernel.int8_block_ir is None and fmt.kernel.superblock_ints_ir is None:
        return None
    if not all(isinstance(v, types.IntegerLiteral) for v in (wrows, xrows)):
        return None
    shape = (wrows.literal_value, xrows.literal_value)
    if shape not in TILES and shape != (1, WIDE_TOKENS):  # 1 x WIDE_TOKENS: every format's,
        return None  # as matmul_q8's branch for it is compiled; only the k-quants take it
    args = (weights, w_off, row_bytes, nblocks, xq, xd, xs, x_offs, first, out, out_off, out_stride)
    return types.void(fmt, wrows, xrows, *args), _tile_codegen(fmt.kernel, *shape)


QUANT_LANES = 16  # floats a step of quantize_block reads: one AVX-512 register, two AVX2 ones


def _quantize_codegen(weights: int):
    """quantize_block's code for blocks of `weights` (32 or 256) floats."""
    steps = weights // QUANT_LANES
    vf = ir.VectorType(F32, QUANT_LANES)
    vi = ir.VectorType(I32, QUANT_LANES)

    def codegen(context, builder, sig, args):
        x_ty, _, q_ty, d_ty, _, _ = sig.args
        x, first, q, d, block, _ = args
        x_data = builder.gep(context.make_array(x_ty)(context, builder, x).data, [first])
        q_data = builder.gep(context.make_array(q_ty)(context, builder, q).data, [first])
        d_at = builder.gep(context.make_array(d_ty)(context, builder, d).data, [block])
        fabs = declare(builder, "llvm.fabs.v16f32", vf, [vf])
        maxnum = _maxnum(builder, QUANT_LANES)
        trunc = declare(builder, "llvm.trunc.v16f32", vf, [vf])
        values = [
            load(builder, builder.gep(x_data, [i64(s * QUANT_LANES)]), vf, align=4)
            for s in range(steps)
        ]
        amax = ir.Constant(vf, None)  # zeros: max |x| of finite x, the order immaterial
        for v in values:
            amax = builder.call(maxnum, [amax, builder.call(fabs, [v])])
        width = QUANT_LANES
        while width > 1:  # the lanes' max by halves
            width //= 2
            low = builder.shuffle_vector(amax, amax, const_vec(I32, list(range(width))))
            high = builder.shuffle_vector(amax, amax, const_vec(I32, list(range(width, 2 * width))))
            amax = builder.call(_maxnum(builder, width), [low, high])
        amax = builder.extract_element(amax, ir.Constant(I32, 0))
        scale = builder.fdiv(amax, ir.Constant(F32, 127.0))
        zero = ir.Constant(F32, 0.0)
        nonzero = builder.fcmp_ordered("!=", scale, zero)
        inverse = builder.select(nonzero, builder.fdiv(ir.Constant(F32, 1.0), scale), zero)
        builder.store(scale, d_at)
        inv = splat(builder, inverse, QUANT_LANES)
        half, minus_half = (ir.Constant(vf, [v] * QUANT_LANES) for v in (0.5, -0.5))
        for s, v in enumerate(values):
            scaled = builder.fmul(v, inv)  # each product rounded, as the scalar step's
            whole = builder.call(trunc, [scaled])
            frac = builder.fsub(scaled, whole)  # exact
            up = builder.zext(builder.fcmp_ordered(">=", frac, half), vi)
            down = builder.zext(builder.fcmp_ordered("<=", frac, minus_half), vi)
            rounded = builder.sub(builder.add(builder.fptosi(whole, vi), up), down)
            at = builder.gep(q_data, [i64(s * QUANT_LANES)])
            ptr = builder.bitcast(at, ir.VectorType(I8, QUANT_LANES).as_pointer())
            builder.store(builder.trunc(rounded, ir.VectorType(I8, QUANT_LANES)), ptr, align=1)
        return context.get_dummy_value()

    return codegen


def _maxnum(builder: ir.IRBuilder, width: int) -> ir.Function:
    """llvm.maxnum of two <width x float>."""
    ty = ir.VectorType(F32, width)
    return declare(builder, f"llvm.maxnum.v{width}f32", ty, [ty, ty])


@intrinsic
def quantize_block(typingctx, x, first, q, d, block, weights):
    """Step 1 of the q8 contract (quant/activation_q8.py) for the block of `weights` (a
    literal: 32, or 256 a super-block) floats x[first:]: q[first:first + weights] int8 and
    d[block] float32, as numba_moe_q8.quantize_rows_reference computes them (d = max|x| / 127,
    q = roundf(x * (1 / d)), halves away from zero), with vectors of QUANT_LANES floats: the
    max in any order (exact), each product and rounding lane by lane. x finite."""
    if not isinstance(weights, types.IntegerLiteral) or weights.literal_value not in (32, 256):
        return None
    return types.void(x, first, q, d, block, weights), _quantize_codegen(weights.literal_value)
