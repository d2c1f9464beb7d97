"""LLVM vector code for numba: a tile of weight rows dotted with up to 4 activation rows.

Numba's auto-vectoriser turns a 32-weight block loop into scalar code (it cannot prove the
bytes it reads and the floats it writes do not alias), so the block loop is written here
directly in LLVM IR: each 32-weight block is dequantised once into a <32 x float> register
and multiplied into one register accumulator per (weight row, activation row) pair; each
activation block is loaded once for all weight rows. Nothing is written to memory until the
end of the rows, and the weight bytes are prefetched ahead of use.

Every format is read from a flat uint8 array at a byte offset; the activations are a flat
float32 array. Formats, by code 0..3: f32, bf16 (32 weights = 128 / 64 bytes)
and GGUF's q8_0 / q4_0 blocks (34 / 18 bytes: fp16 scale, then int8 / 4-bit values).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

BLOCK_BYTES = (128, 64, 34, 18)  # per 32-weight block, by format code: f32, bf16, q8_0, q4_0
# (weight rows, activation rows) of a tile_dot call: at most 8 <32 x float> accumulators,
# which with the dequantised blocks and activations fit AVX-512's 32 vector registers
TILES = ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2), (1, 3), (2, 3), (1, 4), (2, 4))
PREFETCH_BYTES = 1024  # how far ahead of the block being read the weights are prefetched
PREFETCH_LOCALITY = 3  # llvm.prefetch locality: 3 = into L1 (prefetcht0)

_F32, _I8, _I16, _I32, _I64 = ir.FloatType(), *(ir.IntType(n) for n in (8, 16, 32, 64))
_V32F = ir.VectorType(_F32, 32)


def _const_vec(elem: ir.Type, values: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(elem, len(values)), values)


def _load(builder: ir.IRBuilder, ptr: ir.Value, ty: ir.Type, align: int = 1) -> ir.Value:
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=align)


def _splat(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    one = builder.insert_element(ir.Constant(_V32F, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(_V32F, ir.Undefined), _const_vec(_I32, [0] * 32))


def _fp16_scale(builder: ir.IRBuilder, block: ir.Value) -> ir.Value:
    bits = _load(builder, block, _I16)
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), _F32)


def _dequant_block(builder: ir.IRBuilder, fmt: int, block: ir.Value) -> ir.Value:
    """The 32 weights of the block starting at byte pointer `block`, as <32 x float>."""
    if fmt == 0:
        return _load(builder, block, _V32F)
    if fmt == 1:  # bf16: the high half of an fp32
        raw = builder.zext(_load(builder, block, ir.VectorType(_I16, 32)), ir.VectorType(_I32, 32))
        return builder.bitcast(builder.shl(raw, _const_vec(_I32, [16] * 32)), _V32F)
    scale = _splat(builder, _fp16_scale(builder, block))
    values = builder.gep(block, [ir.Constant(_I64, 2)])
    if fmt == 2:  # q8_0
        quants = _load(builder, values, ir.VectorType(_I8, 32))
    else:  # q4_0: low nibbles are weights 0..15, high nibbles 16..31, both offset by 8
        packed = _load(builder, values, ir.VectorType(_I8, 16))
        low = builder.and_(packed, _const_vec(_I8, [0xF] * 16))
        high = builder.lshr(packed, _const_vec(_I8, [4] * 16))
        both = builder.shuffle_vector(low, high, _const_vec(_I32, list(range(32))))
        quants = builder.sub(both, _const_vec(_I8, [8] * 32))
    return builder.fmul(builder.sitofp(quants, _V32F), scale)


def _reduce(builder: ir.IRBuilder, vec: ir.Value) -> ir.Value:
    """Sum of the 32 lanes, as a fixed pairwise tree (deterministic)."""
    width = 32
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(vec, vec, _const_vec(_I32, list(range(width))))
        hi = builder.shuffle_vector(vec, vec, _const_vec(_I32, list(range(width, 2 * width))))
        vec = builder.fadd(lo, hi)
    return builder.extract_element(vec, ir.Constant(_I32, 0))


def _declare(builder: ir.IRBuilder, name: str, ret: ir.Type, params: list[ir.Type]):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, params), name)


def _tile_dot_codegen(fmt: int, wrows: int, xrows: int):
    # An FMA waits ~4 cycles for the previous one on its accumulator: with few accumulators
    # in the tile the loop takes `sets` blocks per iteration, each on its own accumulator set.
    sets = max(1, 4 // (wrows * xrows))

    def codegen(context, builder, sig, args):
        w_ty, _, _, _, x_ty, offs_ty, _, out_ty, _, _ = sig.args[3:]
        weights, w_off, row_bytes, nblocks, x, x_offs, first, out, out_off, out_stride = args[3:]
        w_data = context.make_array(w_ty)(context, builder, weights).data
        w_rows = [
            builder.gep(w_data, [builder.add(w_off, builder.mul(row_bytes, _i64(r)))])
            for r in range(wrows)
        ]
        x_data = context.make_array(x_ty)(context, builder, x).data
        offs_data = context.make_array(offs_ty)(context, builder, x_offs).data
        x_rows = [
            builder.gep(
                x_data, [builder.load(builder.gep(offs_data, [builder.add(first, _i64(c))]))]
            )
            for c in range(xrows)
        ]
        zero = ir.Constant(_V32F, None)
        accs = [
            [[cgutils.alloca_once_value(builder, zero) for _ in x_rows] for _ in w_rows]
            for _ in range(sets)
        ]
        step = _block_step(builder, fmt, w_rows, x_rows)
        main_iters = builder.udiv(nblocks, _i64(sets))
        with cgutils.for_range(builder, main_iters) as loop:
            first_block = builder.mul(loop.index, _i64(sets))
            for s, acc_set in enumerate(accs):
                step(builder.add(first_block, _i64(s)), acc_set)
        done = builder.mul(main_iters, _i64(sets))
        with cgutils.for_range(builder, builder.sub(nblocks, done)) as loop:
            step(builder.add(done, loop.index), accs[0])
        out_data = context.make_array(out_ty)(context, builder, out).data
        for r in range(wrows):
            for c in range(xrows):
                total = builder.load(accs[0][r][c])
                for acc_set in accs[1:]:
                    total = builder.fadd(total, builder.load(acc_set[r][c]))
                index = builder.add(out_off, builder.add(builder.mul(out_stride, _i64(c)), _i64(r)))
                slot = builder.gep(out_data, [index])
                builder.store(_reduce(builder, total), slot)
        return context.get_dummy_value()

    return codegen


def _i64(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


def _block_step(builder: ir.IRBuilder, fmt: int, w_rows: list[ir.Value], x_rows: list[ir.Value]):
    """step(block_index, accs[wrow][xrow]): per weight row, prefetch ahead and dequantise the
    block once; FMA it with each activation row's 32 values (each loaded once per block)."""
    fma = _declare(builder, "llvm.fma.v32f32", _V32F, [_V32F] * 3)
    prefetch = _declare(builder, "llvm.prefetch.p0", ir.VoidType(), [_I8.as_pointer(), *[_I32] * 3])
    read, high_locality, data_cache = (ir.Constant(_I32, v) for v in (0, PREFETCH_LOCALITY, 1))

    def step(index: ir.Value, accs: list[list[ir.Value]]) -> None:
        first_weight = builder.mul(index, _i64(32))
        xs = [
            _load(builder, builder.gep(x_row, [first_weight]), _V32F, align=4) for x_row in x_rows
        ]
        for w_row, row_accs in zip(w_rows, accs, strict=True):
            block = builder.gep(w_row, [builder.mul(index, _i64(BLOCK_BYTES[fmt]))])
            ahead = builder.bitcast(builder.gep(block, [_i64(PREFETCH_BYTES)]), _I8.as_pointer())
            builder.call(prefetch, [ahead, read, high_locality, data_cache])
            w = _dequant_block(builder, fmt, block)
            for acc, xv in zip(row_accs, xs, strict=True):
                builder.store(builder.call(fma, [w, xv, builder.load(acc)]), acc)

    return step


@intrinsic
def tile_dot(
    typingctx,
    fmt,
    wrows,
    xrows,
    weights,
    w_off,
    row_bytes,
    nblocks,
    x,
    x_offs,
    first,
    out,
    out_off,
    out_stride,
):
    """out[out_off + c * out_stride + r] = Σ_b dequant(block b of weight row r) ·
    x[x_offs[first + c] + 32 b : ... + 32] for r < wrows, c < xrows, over `nblocks` 32-weight
    blocks; weight row r starts at byte w_off + r * row_bytes of `weights`.

    `fmt` (a format code, see BLOCK_BYTES), `wrows` and `xrows` are compile-time constants;
    TILES lists the (wrows, xrows) pairs that fit the vector registers."""
    literals = (fmt, wrows, xrows)
    if not all(isinstance(v, types.IntegerLiteral) for v in literals):
        return None
    shape = (wrows.literal_value, xrows.literal_value)
    if fmt.literal_value not in range(4) or shape not in TILES:
        return None
    args = (weights, w_off, row_bytes, nblocks, x, x_offs, first, out, out_off, out_stride)
    sig = types.void(fmt, wrows, xrows, *args)
    return sig, _tile_dot_codegen(fmt.literal_value, *shape)


@intrinsic
def load_weight(typingctx, fmt, weights, byte_off):
    """One f32 (fmt 0) or bf16 (fmt 1) weight at byte `byte_off` of `weights`, as float32:
    the tail of a dense row whose length is not a multiple of 32. Quantised formats have no
    tails (their rows are whole blocks); for them this is never reached and gives 0."""
    if not isinstance(fmt, types.IntegerLiteral) or fmt.literal_value not in range(4):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[1])(context, builder, args[1]).data
        ptr = builder.gep(data, [args[2]])
        if fmt.literal_value >= 2:
            return ir.Constant(_F32, 0.0)
        if fmt.literal_value == 0:
            return _load(builder, ptr, _F32)
        wide = builder.zext(_load(builder, ptr, _I16), _I32)
        return builder.bitcast(builder.shl(wide, ir.Constant(_I32, 16)), _F32)

    return types.float32(fmt, weights, byte_off), codegen
