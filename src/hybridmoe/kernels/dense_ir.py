"""LLVM vector code for the dense decode projection (kernels/numba_dense.py): groups of weight
rows, each dotted with up to 4 tokens' activations, the row loop inside the IR.

Each 32-weight block is dequantised once into a <32 x float> (the format's own IR: bf16 by a
16-bit shift, q8_0 / q4_0 by their scale) and FMAed into one accumulator per (row, token)
pair of each of SETS accumulator sets; the activations of a block are loaded once for the
group's rows. While a group is read, the next group's bytes are prefetched (each row's line
`rows` rows on: one group ahead in a contiguous stream, so a row's first lines are not
demand misses), every cache line, into L2, so that one thread keeps enough reads in flight
to stream (a prefetch into L1 holds one of the core's few line-fill buffers until the line
arrives). A group of one row prefetches nothing: it reads one ascending stream, which the
hardware prefetchers follow (numba_dense reads bf16 and f16 weights that way for one token).

The summation order (the contract the scalar reference `dense_reference` restates): block b of
a row goes into set b % SETS while whole rounds of SETS blocks remain, the rest into set 0;
each of the 32 lanes sums its blocks in ascending order by fused multiply-adds; the sets are
added lane by lane in order (set 0 + set 1 + ...), then the 32 lanes by a pairwise tree (lane
j + lane j + 16, then + 8, ...). SETS and the tree do not depend on the group's width or the
token count, so a row's value does not depend on which rows share its call.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hybridmoe.kernels.llvm_ir import (
    F32,
    I8,
    I32,
    V32F,
    declare,
    i64,
    load,
    pairwise_sum,
)
from hybridmoe.kernels.numba_simd import KernelFormatType
from hybridmoe.quant.formats import KERNEL_BLOCK, KernelFormat

SETS = 2  # accumulator sets: blocks b, b + 1 go to independent FMA chains
# (rows, tokens) of a dense_rows call: rows * tokens * SETS <= 8 <32 x float> accumulators
GROUPS = ((4, 1), (2, 1), (1, 1), (2, 2), (1, 2), (2, 3), (1, 3), (2, 4), (1, 4))
PREFETCH_BYTES = 0  # prefetched: one group of rows ahead, and this many bytes further
PREFETCH_LOCALITY = 2  # llvm.prefetch locality: 2 = into L2 (prefetcht1)
LINE_BYTES = 64


def _block_step(builder, kernel: KernelFormat, prefetch_bytes: int | None, locality: int):
    """step(w_rows, x_rows, block index, accs[row][token]): prefetch (unless prefetch_bytes
    is None), dequantise, FMA."""
    fma = declare(builder, "llvm.fma.v32f32", V32F, [V32F] * 3)
    prefetch = declare(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), *[I32] * 3])
    hints = [ir.Constant(I32, v) for v in (0, locality, 1)]
    lines = range(0, kernel.block_bytes, LINE_BYTES) if prefetch_bytes is not None else ()

    def step(w_rows, x_rows, index, accs, ahead) -> None:
        first_weight = builder.mul(index, i64(KERNEL_BLOCK))
        xs = [load(builder, builder.gep(x_row, [first_weight]), V32F, align=4) for x_row in x_rows]
        for w_row, row_accs in zip(w_rows, accs, strict=True):
            block = builder.gep(w_row, [builder.mul(index, i64(kernel.block_bytes))])
            for line in lines:
                at = builder.add(ahead, i64(prefetch_bytes + line))
                builder.call(prefetch, [builder.gep(block, [at]), *hints])
            w = kernel.dequantize_block_ir(builder, block)
            for acc, xv in zip(row_accs, xs, strict=True):
                builder.store(builder.call(fma, [w, xv, builder.load(acc)]), acc)

    return step


def _superblock_step(builder, kernel: KernelFormat, prefetch_bytes: int | None, locality: int):
    """step(w_rows, x_rows, super-block index i, accs[set][row][token], ahead) for a k-quant:
    its scales decoded once a row, then piece p (32-weight block 8 i + p) into set p % SETS,
    the set the order above gives block 8 i + p."""
    fma = declare(builder, "llvm.fma.v32f32", V32F, [V32F] * 3)
    prefetch = declare(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), *[I32] * 3])
    hints = [ir.Constant(I32, v) for v in (0, locality, 1)]
    lines = range(0, kernel.block_bytes, LINE_BYTES) if prefetch_bytes is not None else ()

    def step(w_rows, x_rows, index, accs, ahead) -> None:
        pieces = []
        for w_row in w_rows:
            block = builder.gep(w_row, [builder.mul(index, i64(kernel.block_bytes))])
            for line in lines:
                at = builder.add(ahead, i64(prefetch_bytes + line))
                builder.call(prefetch, [builder.gep(block, [at]), *hints])
            pieces.append(kernel.dequantize_block_ir(builder, block))
        first_weight = builder.mul(index, i64(kernel.block_weights))
        for p in range(kernel.pieces):
            at = builder.add(first_weight, i64(p * KERNEL_BLOCK))
            xs = [load(builder, builder.gep(x_row, [at]), V32F, align=4) for x_row in x_rows]
            for piece, row_accs in zip(pieces, accs[p % SETS], strict=True):
                w = piece(p)
                for acc, xv in zip(row_accs, xs, strict=True):
                    builder.store(builder.call(fma, [w, xv, builder.load(acc)]), acc)

    return step


def _group_body(builder, kernel, rows, tokens, step, args):
    """The IR of one group: `args` = (w_data, w_off, row_bytes, nblocks, x_rows, accs,
    out_data, out_off, out_stride, group)."""
    w_data, w_off, row_bytes, nblocks, x_rows, accs, out_data, out_off, out_stride, g = args
    first_row = builder.mul(g, i64(rows))
    w_rows = [
        builder.gep(
            w_data, [builder.add(w_off, builder.mul(row_bytes, builder.add(first_row, i64(r))))]
        )
        for r in range(rows)
    ]
    # the same place `rows` rows on: the memory right after the group's, one group ahead
    ahead = builder.mul(row_bytes, i64(rows))
    zero = ir.Constant(V32F, None)
    for acc in (a for acc_set in accs for row in acc_set for a in row):
        builder.store(zero, acc)
    if kernel.pieces > 1:  # whole super-blocks (SETS divides the pieces: whole rounds)
        with cgutils.for_range(builder, builder.udiv(nblocks, i64(kernel.pieces))) as loop:
            step(w_rows, x_rows, loop.index, accs, ahead)
    else:
        rounds = builder.udiv(nblocks, i64(SETS))
        with cgutils.for_range(builder, rounds) as loop:
            first_block = builder.mul(loop.index, i64(SETS))
            for s, acc_set in enumerate(accs):
                step(w_rows, x_rows, builder.add(first_block, i64(s)), acc_set, ahead)
        done = builder.mul(rounds, i64(SETS))
        with cgutils.for_range(builder, builder.sub(nblocks, done)) as loop:
            step(w_rows, x_rows, builder.add(done, loop.index), accs[0], ahead)
    for r in range(rows):
        for t in range(tokens):
            total = builder.load(accs[0][r][t])
            for acc_set in accs[1:]:
                total = builder.fadd(total, builder.load(acc_set[r][t]))
            index = builder.add(out_off, builder.add(builder.mul(out_stride, i64(t)), first_row))
            value = pairwise_sum(builder, total, KERNEL_BLOCK)
            builder.store(value, builder.gep(out_data, [builder.add(index, i64(r))]))


def dense_rows_codegen(
    kernel: KernelFormat, rows: int, tokens: int, prefetch_bytes: int, locality: int
):
    """The codegen of dense_rows for one format and group shape (prefetch as given)."""

    def codegen(context, builder, sig, args):
        w_ty, _, _, _, _, x_ty, _, out_ty = sig.args[3:11]
        weights, w_off, row_bytes, nblocks, groups, x, x_stride, out, out_off, out_stride = args[3:]
        w_data = context.make_array(w_ty)(context, builder, weights).data
        x_data = context.make_array(x_ty)(context, builder, x).data
        out_data = context.make_array(out_ty)(context, builder, out).data
        x_rows = [builder.gep(x_data, [builder.mul(x_stride, i64(t))]) for t in range(tokens)]
        accs = [
            [[cgutils.alloca_once(builder, V32F) for _ in range(tokens)] for _ in range(rows)]
            for _ in range(SETS)
        ]
        make_step = _superblock_step if kernel.pieces > 1 else _block_step
        # one row: one ascending stream, left to the hardware prefetchers (module docstring)
        step = make_step(builder, kernel, prefetch_bytes if rows > 1 else None, locality)
        with cgutils.for_range(builder, groups) as loop:
            body_args = (w_data, w_off, row_bytes, nblocks, x_rows, accs, out_data, out_off)
            _group_body(builder, kernel, rows, tokens, step, (*body_args, out_stride, loop.index))
        return context.get_dummy_value()

    return codegen


def make_dense_rows(prefetch_bytes: int = PREFETCH_BYTES, locality: int = PREFETCH_LOCALITY):
    """The dense_rows intrinsic with the given prefetch (benchmarks compare settings)."""

    @intrinsic
    def dense_rows(
        typingctx,
        fmt,
        rows,
        tokens,
        w,
        w_off,
        row_bytes,
        nblocks,
        groups,
        x,
        x_stride,
        out,
        out_off,
        out_stride,
    ):
        """For g < groups, r < rows, t < tokens: out[out_off + t * out_stride + g * rows + r] =
        Σ over `nblocks` 32-weight blocks of weight row g * rows + r (at byte w_off + (g * rows
        + r) * row_bytes of `w`, KernelFormat `fmt`) · x[t * x_stride :], in the order of the
        module docstring. `fmt`, `rows` and `tokens` are compile-time constants (GROUPS)."""
        if not isinstance(fmt, KernelFormatType):
            return None
        if not all(isinstance(v, types.IntegerLiteral) for v in (rows, tokens)):
            return None
        shape = (rows.literal_value, tokens.literal_value)
        if shape not in GROUPS:
            return None
        args = (w, w_off, row_bytes, nblocks, groups, x, x_stride, out, out_off, out_stride)
        sig = types.void(fmt, rows, tokens, *args)
        return sig, dense_rows_codegen(fmt.kernel, *shape, prefetch_bytes, locality)

    return dense_rows


dense_rows = make_dense_rows()


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c in float32 with one rounding (llvm.fma.f32): the tail weights and the
    reference's scalar steps."""
    if not all(isinstance(v, types.Float) for v in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        fn = declare(builder, "llvm.fma.f32", F32, [F32] * 3)
        vals = [
            context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args, strict=True)
        ]
        return builder.call(fn, vals)

    return types.float32(types.float32, types.float32, types.float32), codegen
