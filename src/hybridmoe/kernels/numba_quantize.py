"""Fast Q8_0 / Q4_0 quantisation on the CPU: ggml's reference quantisers in numba, parallel over
groups of blocks (a row is whole blocks, so groups tile rows), the GIL released, each block in
vector registers.

The torch code in quant/q8_0.py and quant/q4_0.py is the reference; these kernels give the same
bytes (tests/quant/test_fast_quantize.py checks them against it and against `gguf.quants`):
every step is the same float32 operation in the same order, with no fast-math (a reciprocal or a
fused multiply-add would change the last bit). A block's 32 weights are one <32 x float> vector
in LLVM IR (`_q8_0_block`, `_q4_0_block`): numba's auto-vectoriser leaves a 32-weight loop
scalar, as it cannot prove the weights it reads and the bytes it writes do not alias (see
numba_simd.py). max |x| is an integer maximum of the weights' bits & 0x7FFFFFFF, which orders
like |x| (a float maximum would need fast-math to vectorise), the first weight of largest |x|
the least lane holding it. Where the reference's result is not a float operation they spell it
out: C's roundf (half away from zero, as the reference computes it), the truncating casts (a
product that is not finite, which only a block of float32 subnormals makes, casts to 0 there,
so it does here), and float32 -> fp16 rounding to nearest even, subnormals included (scalar,
once a block). The input is read as stored, float32 or bfloat16 (widened exactly, bit by bit):
no float32 copy of a bf16 weight.

`quantize(name, w, out=None)` returns the blocks (written into `out`, e.g. an expert's rows of
a bank, when given), or raises ValueError as the reference does for a block with a non-finite
weight or one whose scale overflows fp16.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from hybridmoe import env
from hybridmoe.kernels import llvm_ir as ll
from hybridmoe.kernels.numba_moe import start_pool
from hybridmoe.quant._blocks import CHUNK_BLOCKS, check_quantize_input

BLOCKS_PER_ITEM = 512  # 16 Ki weights per parallel work item
_FLAGS = dict(nogil=True, cache=True)  # no fastmath: every rounding step is the reference's

# one cache directory per version of this file and of the IR helpers its intrinsics emit, as
# kernels/numba_moe.py does for its kernels
_previous_cache_dir = numba.config.CACHE_DIR
numba.config.CACHE_DIR = str(env.kernel_cache_dir(__file__, ll.__file__))


_ABS = 0x7FFFFFFF  # the bits of |x|, ordered as |x| (inf, then nan, above every finite)
_HALF_DOWN = 0.5 - 2.0**-25  # the float just below 1/2 (q8_0.py's rounding)
_FINITE_BELOW = 256.0  # a quantised value this large is the product of an inf or a nan


def _weights_ir(context, builder, array_ty, array, block):
    """LLVM IR: the float32 bit patterns <32 x i32> of block `block` of a flat array of
    float32 bits (uint32) or of bfloat16 bits (int16, widened exactly: shifted left 16)."""
    data = context.make_array(array_ty)(context, builder, array).data
    first = builder.mul(block, ll.i64(32))
    if array_ty.dtype.bitwidth == 32:
        return ll.load(builder, builder.gep(data, [first]), ll.vector(ll.I32, 32), align=4)
    raw = ll.load(builder, builder.gep(data, [first]), ll.vector(ll.I16, 32), align=2)
    return ll.shl(builder, builder.zext(raw, ll.vector(ll.I32, 32)), 16)


def _abs_max_ir(builder, bits):
    """(|x| bits <32 x i32>, max |x| bits i32): |x| of a float compares as its bits &
    0x7FFFFFFF, so the maximum is an integer one (a float maximum would order nan and -0.0
    otherwise); at or above 0x7F800000 when a weight is inf or nan."""
    magnitudes = builder.and_(bits, ll.const_vec(ll.I32, [_ABS] * 32))
    umax = ll.declare(builder, "llvm.vector.reduce.umax.v32i32", ll.I32, [magnitudes.type])
    return magnitudes, builder.call(umax, [magnitudes])


def _inverse_ir(builder, d):
    """ggml's id = d ? 1.0f / d : 0.0f."""
    zero = ir.Constant(ll.F32, 0.0)
    inverse = builder.fdiv(ir.Constant(ll.F32, 1.0), d)
    return builder.select(builder.fcmp_ordered("==", d, zero), zero, inverse)


def _truncated_ir(builder, v):
    """C's (int) cast of each lane of <32 x float> v where |v| < 256, else 0 (the
    reference's cast of an inf or nan product: torch's, and x86's, gives 0 in the low byte)."""
    magnitude = builder.bitcast(
        builder.and_(builder.bitcast(v, ll.vector(ll.I32, 32)), ll.const_vec(ll.I32, [_ABS] * 32)),
        ll.V32F,
    )
    finite = builder.fcmp_ordered(
        "<", magnitude, ll.splat(builder, ir.Constant(ll.F32, _FINITE_BELOW))
    )
    return builder.select(
        finite, builder.fptosi(v, ll.vector(ll.I32, 32)), ll.const_vec(ll.I32, [0] * 32)
    )


def _store_payload_ir(context, builder, out_ty, out, block, block_bytes, payload):
    """payload (<n x i8>) into out[block, 2:] (out [B, block_bytes] uint8, C order)."""
    data = context.make_array(out_ty)(context, builder, out).data
    at = builder.add(builder.mul(block, ll.i64(block_bytes)), ll.i64(2))
    ptr = builder.bitcast(builder.gep(data, [at]), payload.type.as_pointer())
    builder.store(payload, ptr, align=1)


@intrinsic
def _q8_0_block(typingctx, x, block, out):
    """Q8_0's 32 int8 quants of block `block` of x (float32 bits uint32 [N], or bf16 bits int16
    [N]) into out[block, 2:] (out [B, 34] uint8); returns the bits of d = max|x| / 127 (uint32).
    q = roundf(x * id) as q8_0.py's reference computes it: v + copysign(1/2 - 2^-25, v),
    truncated; every lane one float32 operation as there, in vector registers."""
    sig = types.uint32(x, types.int64, out)

    def codegen(context, builder, signature, args):
        bits = _weights_ir(context, builder, signature.args[0], args[0], args[1])
        _, amax = _abs_max_ir(builder, bits)
        d = builder.fdiv(builder.bitcast(amax, ll.F32), ir.Constant(ll.F32, 127.0))
        inverse = ll.splat(builder, _inverse_ir(builder, d))
        v = builder.fmul(builder.bitcast(bits, ll.V32F), inverse)
        zero, half = ll.splat(builder, ir.Constant(ll.F32, 0.0)), ir.Constant(ll.F32, _HALF_DOWN)
        nonnegative = builder.fcmp_ordered(">=", v, zero)
        halves = builder.select(
            nonnegative,
            ll.splat(builder, half),
            ll.splat(builder, ir.Constant(ll.F32, -_HALF_DOWN)),
        )
        q = _truncated_ir(builder, builder.fadd(v, halves))
        payload = builder.trunc(q, ll.vector(ll.I8, 32))
        _store_payload_ir(context, builder, signature.args[2], args[2], args[1], 34, payload)
        return builder.bitcast(d, ll.I32)

    return sig, codegen


@intrinsic
def _q4_0_block(typingctx, x, block, out):
    """Q4_0's 16 bytes of nibbles of block `block` of x (as _q8_0_block) into out[block, 2:]
    (out [B, 18] uint8); returns the bits of d = m / -8, m the weight of largest |x| (the
    first on ties: the least lane whose |x| bits are the maximum; +0.0 for a block of zeros).
    v = min(15, trunc(x * id + 8.5)), weight j in the low nibble of byte j, j + 16 high."""
    sig = types.uint32(x, types.int64, out)

    def codegen(context, builder, signature, args):
        bits = _weights_ir(context, builder, signature.args[0], args[0], args[1])
        magnitudes, amax = _abs_max_ir(builder, bits)
        at_max = builder.icmp_unsigned("==", magnitudes, ll.splat(builder, amax))
        lanes = builder.select(
            at_max, ll.const_vec(ll.I32, list(range(32))), ll.const_vec(ll.I32, [32] * 32)
        )
        umin = ll.declare(builder, "llvm.vector.reduce.umin.v32i32", ll.I32, [lanes.type])
        weights = builder.bitcast(bits, ll.V32F)
        m = builder.extract_element(weights, builder.call(umin, [lanes]))
        zero = ir.Constant(ll.F32, 0.0)
        m = builder.select(builder.icmp_unsigned("==", amax, ll.i32(0)), zero, m)
        d = builder.fdiv(m, ir.Constant(ll.F32, -8.0))
        inverse = ll.splat(builder, _inverse_ir(builder, d))
        v = builder.fadd(
            builder.fmul(weights, inverse), ll.splat(builder, ir.Constant(ll.F32, 8.5))
        )
        q = _truncated_ir(builder, v)
        fifteen = ll.const_vec(ll.I32, [15] * 32)
        q = builder.select(builder.icmp_signed("<", q, fifteen), q, fifteen)
        low, high = ll.lanes(builder, q, list(range(16))), ll.lanes(builder, q, list(range(16, 32)))
        packed = builder.or_(low, ll.shl(builder, high, 4))
        _store_payload_ir(
            context,
            builder,
            signature.args[2],
            args[2],
            args[1],
            18,
            builder.trunc(packed, ll.vector(ll.I8, 16)),
        )
        return builder.bitcast(d, ll.I32)

    return sig, codegen


@njit(inline="always", **_FLAGS)
def _fp16_bits(d_bits):
    """The fp16 bit pattern of the float32 with bits `d_bits`, rounded to nearest even, as
    torch's cast: subnormal results rounded in place, overflow to inf, nan kept a nan."""
    x = np.int64(d_bits)
    sign = (x >> 16) & 0x8000
    x &= 0x7FFFFFFF
    if x >= 0x7F800000:  # inf or nan
        return sign | 0x7C00 | (0x200 if x > 0x7F800000 else 0)
    if x >= 0x477FF000:  # >= 65520: rounds to inf
        return sign | 0x7C00
    if x >= 0x38800000:  # a normal fp16: drop 13 mantissa bits
        half = ((((x >> 23) - 112) << 10) | ((x & 0x7FFFFF) >> 13)) & 0xFFFF
        rest = x & 0x1FFF
        if rest > 0x1000 or (rest == 0x1000 and (half & 1)):
            half += 1  # a carry into the exponent is the right result
        return sign | half
    exponent = x >> 23  # a subnormal fp16 (or zero): value * 2^24, rounded to an integer
    shift = 126 - exponent  # value * 2^24 = mantissa * 2^-shift; shift >= 14
    if exponent == 0 or shift >= 32:  # below half the smallest fp16 subnormal
        return sign
    mantissa = (x & 0x7FFFFF) | 0x800000
    half = mantissa >> shift
    rest, midpoint = mantissa & ((1 << shift) - 1), 1 << (shift - 1)
    if rest > midpoint or (rest == midpoint and (half & 1)):
        half += 1
    return sign | half


@njit(inline="always", **_FLAGS)
def _store_scale(out, block, d_bits, bad, item):
    """The block's fp16 scale into out[block, :2] (little-endian). bad[item] holds the first
    block of the item whose scale d is not finite, i.e. with a non-finite weight (column 0),
    and the first whose fp16 scale is not finite (column 1)."""
    if (d_bits & 0x7FFFFFFF) >= 0x7F800000 and bad[item, 0] < 0:
        bad[item, 0] = block
    half = _fp16_bits(d_bits)
    out[block, 0], out[block, 1] = half & 0xFF, half >> 8
    if (half & 0x7C00) == 0x7C00 and bad[item, 1] < 0:
        bad[item, 1] = block


@njit(parallel=True, **_FLAGS)
def quantize_q8_0_blocks(xf, xb, out, bad):
    """out [B, 34] = Q8_0 blocks of the B * 32 weights in xf (float32 bits, uint32) or, xf
    empty, xb (bf16 bits, int16); bad [items, 2] (-1 filled): per work item the first block
    with a non-finite weight, the first whose scale overflows fp16. ggml's
    quantize_row_q8_0_ref: d = max|x| / 127, q = roundf(x * (1 / d))."""
    n_blocks = out.shape[0]
    for item in prange((n_blocks + BLOCKS_PER_ITEM - 1) // BLOCKS_PER_ITEM):
        for block in range(item * BLOCKS_PER_ITEM, min(n_blocks, (item + 1) * BLOCKS_PER_ITEM)):
            if xf.shape[0]:
                d_bits = _q8_0_block(xf, block, out)
            else:
                d_bits = _q8_0_block(xb, block, out)
            _store_scale(out, block, d_bits, bad, item)


@njit(parallel=True, **_FLAGS)
def quantize_q4_0_blocks(xf, xb, out, bad):
    """As quantize_q8_0_blocks, out [B, 18] Q4_0: ggml's quantize_row_q4_0_ref, d = m / -8
    with m the weight of largest |x|, v = min(15, trunc(x * (1 / d) + 8.5))."""
    n_blocks = out.shape[0]
    for item in prange((n_blocks + BLOCKS_PER_ITEM - 1) // BLOCKS_PER_ITEM):
        for block in range(item * BLOCKS_PER_ITEM, min(n_blocks, (item + 1) * BLOCKS_PER_ITEM)):
            if xf.shape[0]:
                d_bits = _q4_0_block(xf, block, out)
            else:
                d_bits = _q4_0_block(xb, block, out)
            _store_scale(out, block, d_bits, bad, item)


_KERNELS = {"q8_0": (quantize_q8_0_blocks, 34), "q4_0": (quantize_q4_0_blocks, 18)}
numba.config.CACHE_DIR = _previous_cache_dir  # every cached function above is decorated


def quantize(name: str, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Host float w [..., n] (n a multiple of 32; float32 and bfloat16 read as stored, any other
    float dtype cast to float32 first, as the reference does) -> uint8 [..., n // 32 *
    block_bytes], the reference's bytes: written into `out` when given (a contiguous uint8
    host tensor of that shape, e.g. an expert's rows of a bank: no temporary, no copy) and
    returned, else new. ValueError naming the row for a non-finite weight or a scale beyond
    fp16 (`out` then holds unspecified bytes), or for an `out` that does not fit."""
    kernel, block_bytes = _KERNELS[name]
    check_quantize_input(w, name)
    n = w.shape[-1]
    shape = (*w.shape[:-1], n // 32 * block_bytes)
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8)
    elif (
        tuple(out.shape) != shape
        or out.dtype != torch.uint8
        or out.device.type != "cpu"
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"quantize_{name}: out is {out.dtype} {tuple(out.shape)} on {out.device}"
            f"{'' if out.is_contiguous() else ', not contiguous'}; a contiguous host uint8 "
            f"{shape} holds the blocks of {tuple(w.shape)}"
        )
    xf, xb = _kernel_inputs(w)
    blocks = out.view(-1, block_bytes)  # [B, block_bytes]
    bad = np.full((-(-blocks.shape[0] // BLOCKS_PER_ITEM), 2), -1, np.int64)
    if blocks.shape[0]:
        start_pool()
        with numba.parallel_chunksize(1):  # items one at a time: a preempted thread delays one
            kernel(xf, xb, blocks.numpy(), bad)
    _raise_first_bad(name, bad, n // 32)
    return out


def _kernel_inputs(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(float32 bits uint32 [N], bf16 bits int16 [N]) of w's N weights, the unused one empty:
    views of w's memory when it is contiguous float32 or bfloat16, else of a float32 copy."""
    if w.dtype not in (torch.float32, torch.bfloat16):
        w = w.to(torch.float32)
    flat = w.contiguous().view(-1)  # a view when w is contiguous
    if flat.dtype == torch.float32:
        return flat.view(torch.int32).numpy().view(np.uint32), _NO_BF16
    return _NO_F32, flat.view(torch.int16).numpy()


_NO_F32, _NO_BF16 = np.empty(0, np.uint32), np.empty(0, np.int16)


def _raise_first_bad(name: str, bad: np.ndarray, blocks_per_row: int) -> None:
    """The reference's ValueError, if any: it checks CHUNK_BLOCKS blocks at a time, first for a
    non-finite weight, then for an fp16 overflow, and names the first such block's row."""
    firsts = [int(col[col >= 0].min()) if (col >= 0).any() else None for col in bad.T]
    reasons = (
        "has a non-finite weight (inf or nan)",
        "has a block scale beyond the fp16 range (weights too large)",
    )
    found = [
        (block // CHUNK_BLOCKS, kind, block)
        for kind, block in enumerate(firsts)
        if block is not None
    ]
    if found:
        _, kind, block = min(found)
        raise ValueError(
            f"quantize_{name}: the input's row {block // blocks_per_row} {reasons[kind]}"
        )
