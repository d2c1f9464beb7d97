"""LLVM IR building blocks shared by the CPU kernels (numba_simd.py) and the formats' own block
dequantisers (`KernelFormat.dequantize_block_ir` in quant/), which import this module lazily,
when numba compiles a kernel, so that `import hybridmoe.quant` needs no llvmlite.

A 32-weight block dequantises into one <32 x float> register (`V32F`); a k-quant super-block
into eight of them, one per 32-weight piece, each built as two halves of 16 (`halves`: one
AVX-512 register each) from bytes widened to 32-bit lanes or converted half by half, times its
sub-block's scale broadcast from a `ScaleTable` (a register shuffle per piece cost more than
the rest of the piece on AVX-512).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

F32, I8, I16, I32, I64 = ir.FloatType(), *(ir.IntType(n) for n in (8, 16, 32, 64))
HALF = ir.HalfType()
V32F = ir.VectorType(F32, 32)


def target_has(feature: str) -> bool:
    """Whether the CPU numba compiles for has the LLVM feature `feature` ("avx2"): the host's,
    or those NUMBA_CPU_FEATURES names (numba's own choice; its on-disk cache is keyed on them),
    so IR using a target's intrinsics is only emitted where they run."""
    from numba.core import config
    from numba.core.codegen import get_host_cpu_features

    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    return f"+{feature}" in features.split(",")


@intrinsic
def address_pointer(typingctx, address):
    """The int64 `address` as a void pointer (for numba.carray of a tensor's data_ptr)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


def declare(builder: ir.IRBuilder, name: str, ret: ir.Type, params: list[ir.Type]) -> ir.Function:
    """The function `name` (an LLVM intrinsic) of type ret(params), declared once a module."""
    module = builder.module
    fnty = ir.FunctionType(ret, params)
    return module.globals.get(name) or ir.Function(module, fnty, name)


def const_vec(elem: ir.Type, values: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(elem, len(values)), values)


def vector(elem: ir.Type, lanes: int) -> ir.VectorType:
    return ir.VectorType(elem, lanes)


def i32(value: int) -> ir.Constant:
    return ir.Constant(I32, value)


def i64(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


def pairwise_sum(builder: ir.IRBuilder, vec: ir.Value, width: int) -> ir.Value:
    """The float sum of a vector's `width` lanes (a power of two) by a pairwise tree: the
    upper half added to the lower, then the upper half of that, ..., to one lane."""
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(vec, vec, const_vec(I32, list(range(width))))
        hi = builder.shuffle_vector(vec, vec, const_vec(I32, list(range(width, 2 * width))))
        vec = builder.fadd(lo, hi)
    return builder.extract_element(vec, ir.Constant(I32, 0))


def load(builder: ir.IRBuilder, ptr: ir.Value, ty: ir.Type, align: int = 1) -> ir.Value:
    """A `ty` read at byte pointer `ptr` (unaligned unless `align` says otherwise)."""
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=align)


def splat(builder: ir.IRBuilder, value: ir.Value, count: int = 32) -> ir.Value:
    """The float `value` in all `count` lanes of a <count x float> (default <32 x float>)."""
    vec = ir.Constant(ir.VectorType(value.type, count), ir.Undefined)
    one = builder.insert_element(vec, value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, vec, const_vec(I32, [0] * count))


def fp16_scale(builder: ir.IRBuilder, ptr: ir.Value) -> ir.Value:
    """The little-endian fp16 at byte pointer `ptr`, as a float (GGUF's block scales)."""
    bits = load(builder, ptr, I16)
    return builder.fpext(builder.bitcast(bits, HALF), F32)


def fp16_splat(builder: ir.IRBuilder, ptr: ir.Value, count: int = 16) -> ir.Value:
    """fp16_scale's float in all `count` lanes, splat as fp16 then widened (exact): one
    vcvtph2psx from a broadcast load on AVX512-FP16 targets, instead of a conversion and a
    register broadcast."""
    half = builder.bitcast(load(builder, ptr, I16), HALF)
    return builder.fpext(splat(builder, half, count), ir.VectorType(F32, count))


def lanes(builder: ir.IRBuilder, vec: ir.Value, indices: list[int]) -> ir.Value:
    """A vector of vec's lanes `indices` (a lane may repeat: a splat of one sub-block's scale
    over its weights)."""
    return builder.shuffle_vector(vec, vec, const_vec(I32, indices))


def bits(
    builder: ir.IRBuilder, vec: ir.Value, shift: int | list[int], mask: int | list[int]
) -> ir.Value:
    """(vec >> shift) & mask, lane by lane, unsigned: a bit field of each packed byte; `shift`
    and `mask` one value for all lanes or one per lane."""
    count, elem = vec.type.count, vec.type.element
    shifts = shift if isinstance(shift, list) else [shift] * count
    masks = mask if isinstance(mask, list) else [mask] * count
    shifted = builder.lshr(vec, const_vec(elem, shifts)) if any(shifts) else vec
    return builder.and_(shifted, const_vec(elem, masks))


def shl(builder: ir.IRBuilder, vec: ir.Value, shift: int) -> ir.Value:
    """vec << shift, every lane."""
    return builder.shl(vec, const_vec(vec.type.element, [shift] * vec.type.count))


def offset(builder: ir.IRBuilder, ptr: ir.Value, nbytes: int) -> ir.Value:
    """The byte pointer `nbytes` past `ptr`."""
    return builder.gep(ptr, [i64(nbytes)]) if nbytes else ptr


def scaled(builder: ir.IRBuilder, values: ir.Value, scale: ir.Value) -> ir.Value:
    """Float scale * values (ints, signed), a vector of the scale's width."""
    return builder.fmul(builder.sitofp(values, scale.type), scale)


V16F, V16I = ir.VectorType(F32, 16), ir.VectorType(I32, 16)


def widened_bytes(builder: ir.IRBuilder, ptr: ir.Value) -> ir.Value:
    """The 16 bytes at byte pointer `ptr`, zero-extended to <16 x i32>: one vpmovzxbd from
    memory on AVX-512, whose lanes then take shifts and masks without cross-lane shuffles."""
    return builder.zext(load(builder, ptr, vector(I8, 16)), V16I)


def halves(builder: ir.IRBuilder, lo: ir.Value, hi: ir.Value) -> ir.Value:
    """<32 x float> of two <16 x float> (lanes 0..15 `lo`, 16..31 `hi`): free once the
    backend splits the 32 lanes into registers again."""
    return builder.shuffle_vector(lo, hi, const_vec(I32, list(range(32))))


class ScaleTable:
    """A super-block's decoded sub-block scales kept on the stack, each read back as a
    broadcast (one load-port uop on x86, instead of a register shuffle per piece)."""

    def __init__(self, builder: ir.IRBuilder, scales: ir.Value) -> None:
        from numba.core import cgutils

        self.builder = builder
        # 3 floats of room after the last scale: each is read as the first of a <4 x float>
        room = cgutils.alloca_once(builder, ir.ArrayType(F32, scales.type.count + 3))
        self.slot = builder.bitcast(room, scales.type.as_pointer())
        builder.store(scales, self.slot, align=4)
        # an empty asm that may read the slot: LLVM keeps the stores and reloads each scale
        barrier = ir.InlineAsm(
            ir.FunctionType(ir.VoidType(), [self.slot.type]), "", "r,~{memory}", side_effect=True
        )
        builder.call(barrier, [self.slot])

    def splat(self, index: int, count: int = 16) -> ir.Value:
        """Scale `index` in all `count` lanes."""
        ptr = self.builder.gep(self.builder.bitcast(self.slot, F32.as_pointer()), [i32(index)])
        # a vector load's lane 0, not a float's: LLVM turns each into one broadcast load, where
        # from float loads it made some a 64-bit load and a register broadcast (a shuffle)
        four = load(self.builder, self.builder.bitcast(ptr, I8.as_pointer()), vector(F32, 4), 4)
        return lanes(self.builder, four, [0] * count)


def lookup16(builder: ir.IRBuilder, table: ir.Value, index: ir.Value) -> ir.Value:
    """<16 x float>: lane i = table[index[i] & 15] (table <16 x float>, index <16 x i32>; the
    higher bits of each index are ignored): one AVX-512 vpermps. Only for targets with
    avx512f (target_has)."""
    fn = declare(builder, "llvm.x86.avx512.permvar.sf.512", V16F, [V16F, V16I])
    return builder.call(fn, [table, index])


def nibble_lookup(builder: ir.IRBuilder, packed: ir.Value, table: ir.Value) -> ir.Value:
    """<32 x float>: lane j = table[nibble j] of the 16 bytes at byte pointer `packed` (GGUF's
    32-weight blocks: byte j holds nibble j low, nibble j + 16 high; table <16 x float>): the
    bytes widened once (vpmovzxbd), the high nibbles shifted down, two vpermps. Only for
    targets with avx512f."""
    wide = widened_bytes(builder, packed)
    high = builder.lshr(wide, const_vec(I32, [4] * 16))
    return halves(builder, lookup16(builder, table, wide), lookup16(builder, table, high))


def five_bit_lookup(
    builder: ir.IRBuilder, packed: ir.Value, low: ir.Value, high: ir.Value
) -> ir.Value:
    """<32 x float>: lane j = the table [low, high] (<16 x float> each: 32 entries) at the 5-bit
    value j of pack_5_bits' 20 bytes at byte pointer `packed` (quant/q5_0.py: a little-endian
    uint32 whose bit j is bit 4 of value j, then nibbles as nibble_lookup's): the nibbles
    widened once, each qh bit rotated to bit 4 of its lane (one vprorvd a half, from the
    broadcast uint32), merged by a bit select, two vpermi2ps. Only for targets with avx512f."""
    wide = widened_bytes(builder, offset(builder, packed, 4))
    nibbles = (wide, builder.lshr(wide, const_vec(I32, [4] * 16)))
    qh = splat(builder, load(builder, packed, I32), 16)  # <16 x i32>
    rotate = declare(builder, "llvm.fshr.v16i32", V16I, [V16I] * 3)
    lookup = declare(builder, "llvm.x86.avx512.vpermi2var.ps.512", V16F, [V16F, V16I, V16F])
    bit4, parts = const_vec(I32, [0x10] * 16), []
    for h, nibble in enumerate(nibbles):
        # bit 16 h + i of qh to bit 4: a right rotation by 16 h + i - 4 (mod 32)
        amounts = const_vec(I32, [(16 * h + i - 4) % 32 for i in range(16)])
        hb = builder.and_(builder.call(rotate, [qh, qh, amounts]), bit4)
        index = builder.or_(builder.and_(nibble, const_vec(I32, [~0x10] * 16)), hb)
        parts.append(builder.call(lookup, [low, index, high]))  # bit 4 picks `high`
    return halves(builder, *parts)


def scaled_halves(
    builder: ir.IRBuilder,
    values: ir.Value,
    table: ScaleTable,
    scale_at: tuple[int, int],
    low_at: tuple[int, int] | None = None,
    signed: bool = False,
) -> ir.Value:
    """<32 x float> of 32 integers `values` (<32 x i8>, signed or not): each half h of 16 lanes
    times scale `scale_at[h]` of `table`, less its entry `low_at[h]` when given (a sub-block of
    16 weights a half; two of 32 give the same index twice; with `low_at` the products must be
    exact in fp32: they are FMAs where the target has FMA)."""
    convert = builder.sitofp if signed else builder.uitofp
    parts = []
    for h in range(2):
        part = builder.shuffle_vector(
            values, values, const_vec(I32, list(range(16 * h, 16 * h + 16)))
        )
        w, scale = convert(part, V16F), table.splat(scale_at[h])
        if low_at is None:
            parts.append(builder.fmul(w, scale))
        else:  # the product exact (the callers'), so fmul then fsub's bits
            parts.append(exact_fma(builder, w, scale, builder.fneg(table.splat(low_at[h]))))
    return halves(builder, *parts)


V64B = ir.VectorType(I8, 64)


def byte_permutes() -> bool:
    """Whether the target moves bytes across a 64-byte vector and bits within its bytes in one
    instruction each (AVX-512 VBMI's vpermt2b, GFNI's vgf2p8affineqb): the byte-level paths of
    the block dequantisers, which assemble 64 weights' integers at a time."""
    return all(target_has(f) for f in ("avx512bw", "avx512vbmi", "gfni"))


def gf2_matrix(moves: dict[int, int]) -> list[int]:
    """The 8 bytes of a GF(2) affine matrix (one qword of vgf2p8affineqb's) whose output bit t
    is input bit s for each t: s of `moves`, every other output bit 0: its byte 7 - t is the
    mask of the input bits whose parity is output bit t."""
    rows = [0] * 8
    for t, s in moves.items():
        rows[7 - t] = 1 << s
    return rows


def gf2_affine(
    builder: ir.IRBuilder, vec: ir.Value, moves: dict[int, int] | list[dict[int, int]], xor=0
) -> ir.Value:
    """<64 x i8>: each byte of vec (<64 x i8>) rearranged, bit t of the result its bit s for
    each t: s of `moves` (one dict for every byte, or 8, one per 8-byte qword), its other bits
    0, then XOR `xor`: one vgf2p8affineqb. Only for targets with byte_permutes()."""
    per_qword = moves if isinstance(moves, list) else [moves] * 8
    matrix = [row for m in per_qword for row in gf2_matrix(m)]
    fn = declare(builder, "llvm.x86.vgf2p8affineqb.512", V64B, [V64B, V64B, I8])
    return builder.call(fn, [vec, const_vec(I8, matrix), ir.Constant(I8, xor)])


def once_per_function(builder: ir.IRBuilder, key: object, make) -> ir.Value:
    """make(builder)'s value, emitted once in the entry block of the function `builder` is in
    and reused for the same `key`: a value that must not be recomputed in each loop iteration
    (LLVM does not hoist an asm call out of a loop)."""
    values = builder.function.__dict__.setdefault("_hybridmoe_once", {})
    if key not in values:
        with builder.goto_entry_block():
            values[key] = make(builder)
    return values[key]


def dword_bytes(builder: ir.IRBuilder, vec: ir.Value, first: int, at: int = 0) -> ir.Value:
    """<16 x i32>: lane i = byte `first` + i of vec (<64 x i8>) placed at byte `at` (0..3) of
    the lane, its other bytes 0 (so zero-extended for at = 0, times 2^(8 at) otherwise): one
    byte permute with zero-masking (vpermb {z}). Only for targets with byte_permutes()."""
    index = [first + i // 4 for i in range(64)]  # each lane's bytes all its byte
    moved = builder.shuffle_vector(vec, vec, const_vec(I32, index))
    keep = sum(1 << (4 * i + at) for i in range(16))

    def opaque_mask(b: ir.IRBuilder) -> ir.Value:
        # the mask through an empty asm: seeing it constant, LLVM would fold the select into
        # the shuffle and lower both as 128-bit extracts and zero-extensions (two instructions)
        opaque = ir.InlineAsm(ir.FunctionType(I64, [I64]), "", "=r,0")
        return b.bitcast(b.call(opaque, [i64(keep)]), ir.VectorType(ir.IntType(1), 64))

    mask = once_per_function(builder, ("dword_bytes mask", at), opaque_mask)
    return builder.bitcast(builder.select(mask, moved, ir.Constant(V64B, None)), V16I)


def exact_fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a * b + c, float vectors, for products a * b that are exact in fp32 (so the FMA's one
    rounding is fadd's): llvm.fma where the target has FMA, else fmul then fadd, the same bits."""
    if not target_has("fma"):
        return builder.fadd(builder.fmul(a, b), c)
    fn = declare(builder, f"llvm.fma.v{a.type.count}f32", a.type, [a.type] * 3)
    return builder.call(fn, [a, b, c])
