"""LLVM vector code for numba: a tile of weight rows dotted with up to 4 activation rows.

Numba's auto-vectoriser turns a 32-weight block loop into scalar code (it cannot prove the
bytes it reads and the floats it writes do not alias), so the block loop is written here
directly in LLVM IR: each 32-weight block is dequantised once into a <32 x float> register
and multiplied into one register accumulator per (weight row, activation row) pair; each
activation block is loaded once for all weight rows. Nothing is written to memory until the
end of the rows. While a tile's rows are read, the same place whole tiles on (at least
PREFETCH_AHEAD_BYTES) is prefetched into L2 (every cache line): a later tile of a contiguous
run of rows, so that a row's first lines are not demand misses and one thread keeps enough
reads in flight to stream (as kernels/dense_ir.py does; a prefetch into L1 holds one of the
core's few line-fill buffers until the line arrives). A tile of one weight row of a
32-weight-block format prefetches nothing: it reads one ascending stream, which the hardware
prefetchers follow (numba_moe reads bf16 and f16 experts so for one token). `prefetch_rows`
starts the first tile of a run the caller reads next.

Every format is read from a flat uint8 array at a byte offset; the activations are a flat
float32 array. What a format's bytes are is its `KernelFormat` (quant/formats.py), which the
intrinsics take as their first argument: its numba type `KernelFormatType` holds the
descriptor, so the format is a compile-time constant and each format compiles its own loop,
with its block size and its own IR dequantiser (`dequantize_block_ir`, in the format's module).
A k-quant's block is a super-block of `pieces` 32-weight pieces: the loop then steps one
super-block at a time, decodes its scales once and dequantises each piece into a register.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.imputils import lower_constant, lower_getattr
from numba.core.typing.templates import AttributeTemplate, infer_getattr
from numba.extending import intrinsic, models, register_model, typeof_impl

from hybridmoe.kernels.llvm_ir import F32, I8, I32, V32F, i64, load, pairwise_sum, target_has
from hybridmoe.quant.formats import KERNEL_BLOCK, KernelFormat

# (weight rows, activation rows) of a tile_dot call: at most 8 <32 x float> accumulators,
# which with the dequantised blocks and activations fit AVX-512's 32 vector registers
TILES = ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2), (1, 3), (2, 3), (1, 4), (2, 4))
PREFETCH_LOCALITY = 2  # llvm.prefetch locality: 2 = into L2 (prefetcht1)
# a tile prefetches the blocks it reads this far on, in whole tiles: one tile of short rows
# (a Qwen3-30B-A3B down row of q4_k is 432 B, its 4-row tile 1.7 KB) is read back in about a
# DRAM latency, too late. Measured (AMD EPYC, one thread streaming 768-weight q4_k rows by the
# q8 tile): 1 tile ahead 10.0-13.9 GB/s, >= 4 KB ahead 10.9-16.7, >= 8 KB 8.9-16.6 (64 to
# 1536-row regions); rows of 2048 weights (a 4.6 KB tile) gain nothing from 2 tiles ahead
PREFETCH_AHEAD_BYTES = 4096
LINE_BYTES = 64


def prefetch_distance(builder: ir.IRBuilder, row_bytes: ir.Value, wrows: int) -> ir.Value:
    """Bytes from a tile's block to the block it prefetches: the fewest whole tiles of
    `wrows` rows of `row_bytes` (an i64) that reach PREFETCH_AHEAD_BYTES."""
    tile_bytes = builder.mul(row_bytes, i64(wrows))
    tiles = builder.udiv(builder.add(tile_bytes, i64(PREFETCH_AHEAD_BYTES - 1)), tile_bytes)
    return builder.mul(tile_bytes, tiles)


class KernelFormatType(types.Type):
    """The numba type of one KernelFormat: a jitted function that takes (or closes over) a
    format is compiled for that format; the value itself carries nothing at run time."""

    def __init__(self, kernel: KernelFormat) -> None:
        self.kernel = kernel
        super().__init__(name=f"KernelFormat({kernel.name})")

    @property
    def key(self) -> KernelFormat:
        return self.kernel


register_model(KernelFormatType)(models.OpaqueModel)


@typeof_impl.register(KernelFormat)
def _typeof_kernel_format(kernel: KernelFormat, context) -> KernelFormatType:
    return KernelFormatType(kernel)


@lower_constant(KernelFormatType)
def _lower_kernel_format(context, builder, ty, kernel):
    return context.get_dummy_value()


@infer_getattr
class _KernelFormatAttributes(AttributeTemplate):
    """fmt.block_bytes, fmt.block_weights, fmt.partial_blocks, fmt.one_token_rows and
    fmt.short_row_rows in jitted code: constants, lowered in place."""

    key = KernelFormatType

    def resolve_block_bytes(self, fmt: KernelFormatType) -> types.Type:
        return types.intp

    def resolve_block_weights(self, fmt: KernelFormatType) -> types.Type:
        return types.intp

    def resolve_partial_blocks(self, fmt: KernelFormatType) -> types.Type:
        return types.boolean

    def resolve_one_token_rows(self, fmt: KernelFormatType) -> types.Type:
        return types.intp

    def resolve_short_row_rows(self, fmt: KernelFormatType) -> types.Type:
        return types.intp


@lower_getattr(KernelFormatType, "block_bytes")
def _lower_block_bytes(context, builder, ty, value):
    return context.get_constant(types.intp, ty.kernel.block_bytes)


@lower_getattr(KernelFormatType, "block_weights")
def _lower_block_weights(context, builder, ty, value):
    return context.get_constant(types.intp, ty.kernel.block_weights)


@lower_getattr(KernelFormatType, "partial_blocks")
def _lower_partial_blocks(context, builder, ty, value):
    return context.get_constant(types.boolean, ty.kernel.partial_blocks)


@lower_getattr(KernelFormatType, "one_token_rows")
def _lower_one_token_rows(context, builder, ty, value):
    return context.get_constant(types.intp, ty.kernel.one_token_rows)


@lower_getattr(KernelFormatType, "short_row_rows")
def _lower_short_row_rows(context, builder, ty, value):
    return context.get_constant(types.intp, ty.kernel.short_row_rows)


def _declare(builder: ir.IRBuilder, name: str, ret: ir.Type, params: list[ir.Type]):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, params), name)


def _tile_dot_codegen(kernel: KernelFormat, wrows: int, xrows: int):
    """The tile's code: one <32 x float> accumulator per (weight row, activation row) pair,
    whatever the tile's shape, summing the row's blocks in order (a super-block's pieces in
    order), then its lanes by a pairwise tree. So a route's output does not depend on the
    tile its rows and tokens landed in, that is on which other tokens of a batch share its
    expert. (Until 2026-12-06 a tile of few pairs spread its blocks over 4 // (rows x tokens)
    accumulator sets, for more FMA chains: a bf16 expert's row dotted by a 1 x 1 tile, one
    token, and by a 4 x 2 tile, two, differed in the last bits, and a batch of 4 prompts gave
    other tokens than each prompt alone. One accumulator of a bf16 block's 64 bytes is two
    independent FMA chains, 16 bytes a cycle, above what a core reads from DRAM: the
    Qwen3-30B-A3B bf16 layer measured 0.97-1.02x the time of the sets.)"""

    def codegen(context, builder, sig, args):
        w_ty, _, _, _, x_ty, offs_ty, _, out_ty, _, _ = sig.args[3:]
        weights, w_off, row_bytes, nblocks, x, x_offs, first, out, out_off, out_stride = args[3:]
        w_data = context.make_array(w_ty)(context, builder, weights).data
        w_rows = [
            builder.gep(w_data, [builder.add(w_off, builder.mul(row_bytes, i64(r)))])
            for r in range(wrows)
        ]
        x_data = context.make_array(x_ty)(context, builder, x).data
        offs_data = context.make_array(offs_ty)(context, builder, x_offs).data
        x_rows = [
            builder.gep(
                x_data, [builder.load(builder.gep(offs_data, [builder.add(first, i64(c))]))]
            )
            for c in range(xrows)
        ]
        tile_bytes = prefetch_distance(builder, row_bytes, wrows)  # a later tile's block
        zero = ir.Constant(V32F, None)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in x_rows] for _ in w_rows]
        for group in _row_groups(wrows, xrows):  # each row's sums alike in any group
            rows = [w_rows[r] for r in group]
            _block_loops(
                builder, kernel, rows, x_rows, tile_bytes, nblocks, [accs[r] for r in group]
            )
        out_data = context.make_array(out_ty)(context, builder, out).data
        for r in range(wrows):
            for c in range(xrows):
                total = builder.load(accs[r][c])
                index = builder.add(out_off, builder.add(builder.mul(out_stride, i64(c)), i64(r)))
                slot = builder.gep(out_data, [index])
                builder.store(pairwise_sum(builder, total, 32), slot)
        return context.get_dummy_value()

    return codegen


def _row_groups(wrows: int, xrows: int) -> list[range]:
    """The tile's weight rows whose block loops run together: all of them where the vector
    registers hold every accumulator with the activations and a dequantised block (AVX-512's
    32: the TILES are sized for it); on a 16-register target (AVX2, where a <32 x float> is 4
    registers) the 4 x 1 tile (one accumulator a row: decode's tile) as two pairs of rows, or
    its loop keeps accumulators on the stack (q4_0's: 38 of its 162 instructions were stack
    loads and stores; split, the tile alone ran q4_k 1.16x and q6_k 1.09x faster, best of 3,
    on an AVX2 EPYC). A row's accumulators add the same products in the same order in any
    group (the same bits); a group re-reads the activation blocks, from L1. The tiles of more
    accumulators a row stay whole: split, they measured no faster (q4_k's 2 x 2 slower)."""
    if target_has("avx512f") or xrows != 1:
        return [range(wrows)]
    return [range(r, min(r + 2, wrows)) for r in range(0, wrows, 2)]


def _block_loops(
    builder: ir.IRBuilder,
    kernel: KernelFormat,
    w_rows: list[ir.Value],
    x_rows: list[ir.Value],
    tile_bytes: ir.Value,
    nblocks: ir.Value,
    accs: list[list[ir.Value]],
) -> None:
    """The loop over a row's `nblocks` blocks (whole super-blocks for a super-block format)
    for `w_rows`, into accs[wrow][xrow]."""
    if kernel.pieces > 1:
        step = _superblock_step(builder, kernel, w_rows, x_rows, tile_bytes)
        nblocks = builder.udiv(nblocks, i64(kernel.pieces))
    else:
        step = _block_step(builder, kernel, w_rows, x_rows, tile_bytes)
    with cgutils.for_range(builder, nblocks) as loop:
        step(loop.index, accs)


def _block_step(
    builder: ir.IRBuilder,
    kernel: KernelFormat,
    w_rows: list[ir.Value],
    x_rows: list[ir.Value],
    tile_bytes: ir.Value,
):
    """step(block_index, accs[wrow][xrow]): per weight row, prefetch the block `tile_bytes`
    on (a later tile's: prefetch_distance; each line the block touches) and dequantise it once
    (the format's own IR); FMA it with each activation row's 32 values (each loaded once per
    block)."""
    fma = _declare(builder, "llvm.fma.v32f32", V32F, [V32F] * 3)
    prefetch = _declare(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), *[I32] * 3])
    hints = [ir.Constant(I32, v) for v in (0, PREFETCH_LOCALITY, 1)]
    # one row: one ascending stream, left to the hardware prefetchers (module docstring)
    lines = range(0, kernel.block_bytes, LINE_BYTES) if len(w_rows) > 1 else ()

    def step(index: ir.Value, accs: list[list[ir.Value]]) -> None:
        first_weight = builder.mul(index, i64(KERNEL_BLOCK))
        xs = [load(builder, builder.gep(x_row, [first_weight]), V32F, align=4) for x_row in x_rows]
        for w_row, row_accs in zip(w_rows, accs, strict=True):
            block = builder.gep(w_row, [builder.mul(index, i64(kernel.block_bytes))])
            for line in lines:
                ahead = builder.gep(block, [builder.add(tile_bytes, i64(line))])
                builder.call(prefetch, [ahead, *hints])
            w = kernel.dequantize_block_ir(builder, block)
            for acc, xv in zip(row_accs, xs, strict=True):
                builder.store(builder.call(fma, [w, xv, builder.load(acc)]), acc)

    return step


def _superblock_step(
    builder: ir.IRBuilder,
    kernel: KernelFormat,
    w_rows: list[ir.Value],
    x_rows: list[ir.Value],
    tile_bytes: ir.Value,
):
    """step(superblock_index, accs[wrow][xrow]): per weight row, prefetch the super-block
    `tile_bytes` on (a later tile's: prefetch_distance; each of its cache lines) and decode its
    scales once (the format's DequantizeSuperBlockIR); then piece by piece, the activations' 32
    values loaded once and each row's piece dequantised and FMAed into its accumulator."""
    fma = _declare(builder, "llvm.fma.v32f32", V32F, [V32F] * 3)
    prefetch = _declare(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), *[I32] * 3])
    hints = [ir.Constant(I32, v) for v in (0, PREFETCH_LOCALITY, 1)]
    lines = [*range(0, kernel.block_bytes, LINE_BYTES), kernel.block_bytes - 1]  # all it spans

    def step(index: ir.Value, accs: list[list[ir.Value]]) -> None:
        pieces = []
        for w_row in w_rows:
            block = builder.gep(w_row, [builder.mul(index, i64(kernel.block_bytes))])
            for line in lines:
                ahead = builder.gep(block, [builder.add(tile_bytes, i64(line))])
                builder.call(prefetch, [ahead, *hints])
            pieces.append(kernel.dequantize_block_ir(builder, block))
        first_weight = builder.mul(index, i64(kernel.block_weights))
        for p in range(kernel.pieces):
            at = builder.add(first_weight, i64(p * KERNEL_BLOCK))
            xs = [load(builder, builder.gep(x_row, [at]), V32F, align=4) for x_row in x_rows]
            for piece, row_accs in zip(pieces, accs, strict=True):
                w = piece(p)
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
    blocks (for a super-block format, a multiple of its pieces); weight row r starts at byte
    w_off + r * row_bytes of `weights`.

    `fmt` (a KernelFormat), `wrows` and `xrows` are compile-time constants; TILES lists the
    (wrows, xrows) pairs that fit the vector registers."""
    if not isinstance(fmt, KernelFormatType):
        return None
    if not all(isinstance(v, types.IntegerLiteral) for v in (wrows, xrows)):
        return None
    shape = (wrows.literal_value, xrows.literal_value)
    if shape not in TILES:
        return None
    args = (weights, w_off, row_bytes, nblocks, x, x_offs, first, out, out_off, out_stride)
    sig = types.void(fmt, wrows, xrows, *args)
    return sig, _tile_dot_codegen(fmt.kernel, *shape)


@intrinsic
def load_weight(typingctx, fmt, weights, byte_off):
    """One weight of format `fmt` (a KernelFormat whose rows may end in part of a block) at
    byte `byte_off` of `weights`, as float32: the tail of a row whose length is not a multiple
    of 32. Other formats have no tails (their rows are whole blocks); for them this is never
    reached and gives 0."""
    if not isinstance(fmt, KernelFormatType):
        return None
    kernel = fmt.kernel

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[1])(context, builder, args[1]).data
        ptr = builder.gep(data, [args[2]])
        if not kernel.partial_blocks:
            return ir.Constant(F32, 0.0)
        return kernel.load_weight_ir(builder, ptr)

    return types.float32(fmt, weights, byte_off), codegen


@intrinsic
def prefetch_rows(typingctx, weights, byte_off, nbytes):
    """Prefetch weights[byte_off : byte_off + nbytes] into L2, each cache line once: the first
    tile of the run of rows a caller reads next (tile_dot prefetches the rest of a run as it
    goes). Addresses past the array are harmless: a prefetch never faults."""
    if not isinstance(weights, types.Array):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        prefetch = _declare(
            builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), *[I32] * 3]
        )
        hints = [ir.Constant(I32, v) for v in (0, PREFETCH_LOCALITY, 1)]
        start = builder.gep(data, [args[1]])
        lines = builder.udiv(builder.add(args[2], i64(LINE_BYTES - 1)), i64(LINE_BYTES))
        with cgutils.for_range(builder, lines) as loop:
            at = builder.gep(start, [builder.mul(loop.index, i64(LINE_BYTES))])
            builder.call(prefetch, [at, *hints])
        return context.get_dummy_value()

    return types.void(weights, types.intp, types.intp), codegen
