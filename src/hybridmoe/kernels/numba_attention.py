"""The CPU attention of a decode step: one numba call per layer that writes the step's key and
value of each sequence into its KV-cache row and computes softmax(q k^T * scale) v over the
row's cached keys, for one query per sequence, sequences at different positions, grouped-query
heads (num_kv_heads < num_heads), a sliding window and the sliding-window ring (engine/
kv_cache.py). Its reference is the torch path beside it: KVCache.update, then torch's SDPA
(layers/attention.sdpa) of each sequence alone: a row's bits do not depend on the rows
beside it (the batch's SDPA over keys padded to the longest row's length blocks them otherwise,
and until 2026-12-06 the kernel reproduced that: a prompt's bf16 tokens could change with the
batch it shared); tests/layers/test_decode_attention.py compares them.

Work items are (sequence, kv head) pairs: an item writes its head's new row, then computes the
heads of its group over it; the dot products and the weighted sums of values are LLVM vector
code over head_dim (kernels/attention_ir.py), a tile of heads sharing each key's loads. Keys a
query does not see (beyond its position, outside its window, slots of the ring not yet
written) are not computed: a masked key's weight is exactly 0 in torch's softmax too, and
where it would share a vector or a group of four with seen keys it is given as -inf or 0.

The numerics, torch's CPU flash attention's (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp,
what SDPA runs for host tensors), step for step: scores q . k in float32 (attention_ir's order, its
bfloat16 GEMM's), times `scale`; an online softmax over blocks of BLOCK keys counted from key 0 of
SDPA's key row for the sequence alone (its position + 1 keys, or the ring's written slots), so a
block's length, and with it which keys fall in its vector part and which in its tail, is that of
SDPA over the sequence's own keys (softmax_ir: the block's max; its exps by torch's vector exp and
libm's expf, their sum in torch's lanes and tree); the running sum fused as torch's compiled `sum +
carry * old` (an FMA), the running output times the carry exp(old max - new max) (libm's expf); in
bfloat16 the exps rounded to bfloat16 before they weight v; the weighted sum of v (attention_ir's
order); then out = acc * (1 / sum), rounded once to the output dtype. In bfloat16 that is SDPA's
bits where MKL's bfloat16 GEMM sums in one of attention_ir's orders (QUADS on an AMD EPYC, PAIRS on
an Intel Xeon with AVX512-BF16, measured; kernel_order picks the machine's) and torch's build is
one whose softmax glue.softmax_lanes knows: gives_sdpa_bits checks it on the machine, and the
engine takes the kernel by default only there (EngineConfig.attention_kernel "auto").
Elsewhere, and in float32 (SDPA's float32 GEMM is MKL's sgemm, whose bits even vary with the
operands' alignment), the contract is a tolerance, SDPA's own float32 accumulation error: float32
outputs within 1e-5 (absolute and relative), bfloat16 outputs within one unit in the last place of
the output plus 2^-8 max |v| (a weight whose float32 bits differ may round one bfloat16 step the
other way).

A step whose keys and values are under MIN_PARALLEL_BYTES runs on the calling thread, without
a parallel region; a larger one on numba's pool (numba_moe.launch), an item per work unit. The
result does not depend on the thread count (each item's arithmetic is its own).
"""

from __future__ import annotations

import ctypes
import functools
import math

import numba
import numpy as np
import torch
import torch.nn.functional as F
from numba import prange, types
from numba.extending import overload

from hybridmoe import env
from hybridmoe.kernels import activation_ir, attention_ir, glue, llvm_ir, numba_glue, softmax_ir
from hybridmoe.kernels.attention_ir import ORDERS, QUADS, TILES, pv_tile, qk_tile
from hybridmoe.kernels.llvm_ir import address_pointer
from hybridmoe.kernels.numba_cache import cached_njit
from hybridmoe.kernels.numba_glue import _fma
from hybridmoe.kernels.numba_moe import chunk_size, launch, pool_threads, set_chunk_size
from hybridmoe.kernels.softmax_ir import block_max, exp_block

BLOCK = 512  # key indices per softmax block: torch's kvSplitSize
# the keys _weigh takes from a softmax block's first on: a whole group of either order's (four
# for QUADS, eight for PAIRS), so a run's groups are the block's
GROUP = 8
# Steps reading fewer key/value bytes run on one thread: waking the pool's other threads
# costs more than they save (numba_dense.MIN_PARALLEL_BYTES measured the same for weights)
MIN_PARALLEL_BYTES = 1 << 20
# no fastmath: every rounding is torch's (no reassociation, no contraction but the explicit
# FMAs); numpy's error model: no zero-division checks
_FLAGS = dict(nogil=True, error_model="numpy", fastmath=False)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
assert TILES == (8, 4, 2, 1)  # _scores and _weigh walk them in this order

# the kernels are cached in a directory named by a hash of every source they compile from
_previous_cache_dir = numba.config.CACHE_DIR
numba.config.CACHE_DIR = str(
    env.kernel_cache_dir(
        __file__,
        attention_ir.__file__,
        softmax_ir.__file__,
        llvm_ir.__file__,
        numba_glue.__file__,
        activation_ir.__file__,  # numba_glue's
    )
)


@cached_njit(inline="always", **_FLAGS)
def _scores(qf, group, kc, off, n, s, s_off, scale, dim, order):
    """s[g * BLOCK + s_off + j] = (qf's head g . key j of the run at kc[off:]) * scale, j < n,
    g < group, in attention_ir's order `order`."""
    g = 0
    while g + 8 <= group:
        qk_tile(8, order, qf, g, kc, off, n, s, BLOCK, s_off, scale, dim)
        g += 8
    if g + 4 <= group:
        qk_tile(4, order, qf, g, kc, off, n, s, BLOCK, s_off, scale, dim)
        g += 4
    if g + 2 <= group:
        qk_tile(2, order, qf, g, kc, off, n, s, BLOCK, s_off, scale, dim)
        g += 2
    if g < group:
        qk_tile(1, order, qf, g, kc, off, n, s, BLOCK, s_off, scale, dim)


@cached_njit(inline="always", **_FLAGS)
def _weigh(acc, group, p, vc, off, n, dim, order):
    """acc's head g += the run's values at vc[off:] weighted by p[g * BLOCK:][:n], g < group,
    in attention_ir's order `order` (groups of keys from the run's first)."""
    g = 0
    while g + 8 <= group:
        pv_tile(8, order, acc, g, p, BLOCK, vc, off, n, dim)
        g += 8
    if g + 4 <= group:
        pv_tile(4, order, acc, g, p, BLOCK, vc, off, n, dim)
        g += 4
    if g + 2 <= group:
        pv_tile(2, order, acc, g, p, BLOCK, vc, off, n, dim)
        g += 2
    if g < group:
        pv_tile(1, order, acc, g, p, BLOCK, vc, off, n, dim)


def _widen(src, first, dst, n):
    """dst[:n] = src[first:][:n] as float32; src float32, or uint16 holding bfloat16 bits."""


@overload(_widen, jit_options=_FLAGS, inline="always")
def _widen_overload(src, first, dst, n):
    if src.dtype == types.uint16:

        def widen_bf16(src, first, dst, n):
            bits = dst.view(np.uint32)
            for i in range(n):
                bits[i] = np.uint32(src[first + i]) << 16

        return widen_bf16

    def widen_f32(src, first, dst, n):
        for i in range(n):
            dst[i] = src[first + i]

    return widen_f32


def _narrow(src, n, dst, at):
    """dst[at:][:n] = src[:n] (float32) in dst's dtype: float32, or uint16 holding bfloat16
    bits, rounded to nearest, ties to even, as torch's cast (inf and nan kept)."""


@overload(_narrow, jit_options=_FLAGS, inline="always")
def _narrow_overload(src, n, dst, at):
    if dst.dtype == types.uint16:

        def narrow_bf16(src, n, dst, at):
            bits = src.view(np.uint32)
            for i in range(n):
                b = np.int64(bits[i])
                if (b & 0x7F800000) != 0x7F800000:
                    b = b + 0x7FFF + ((b >> 16) & 1)
                dst[at + i] = np.uint16((b >> 16) & 0xFFFF)

        return narrow_bf16

    def narrow_f32(src, n, dst, at):
        for i in range(n):
            dst[at + i] = src[i]

    return narrow_f32


@cached_njit(inline="always", **_FLAGS)
def _exps(s, base, start, stop, nb, top, lanes, bf16):
    """exp_block with the literal of torch's `lanes` and the dtype."""
    if lanes == 16:
        return (
            exp_block(s, base, start, stop, nb, top, 17)
            if bf16
            else exp_block(s, base, start, stop, nb, top, 16)
        )
    if bf16:
        return exp_block(s, base, start, stop, nb, top, 9)
    return exp_block(s, base, start, stop, nb, top, 8)


@cached_njit(inline="always", **_FLAGS)
def _softmax_block(s, g, first, end, nb, lanes, m, sums, acc, dim, bf16):
    """Head g's scores s[g * BLOCK + first : g * BLOCK + end] of a block of torch's whose keys
    are block indices 0 .. nb - 1 (the others masked) into its running max m[g], sum sums[g]
    and output acc[g * dim:][:dim]: the scores become the weights exp(s - max) (rounded to
    bfloat16 values where `bf16`), as torch computes the block's (softmax_ir: its vector part
    and tail, by its `lanes`). Returns the run (pa, pz) of block indices _weigh reads: whole
    groups of GROUP keys (either order's) from pa, the weights of its masked keys 0."""
    base, whole = g * BLOCK, nb - nb % lanes
    top = block_max(s, base + first, end - first, m[g])
    start = first - first % lanes if first < whole else first  # whole vector chunks
    stop = end + (-end) % lanes if end < whole else end
    for i in range(start, first):
        s[base + i] = -np.inf  # masked: an exp of 0
    for i in range(end, stop):
        s[base + i] = -np.inf
    total = _exps(s, base, start, stop, nb, top, lanes, bf16)
    carry = np.exp(m[g] - top)  # libm's expf, torch's std::exp; 0 on the first block
    sums[g] = _fma(carry, sums[g], total)  # torch's `tmp_sum + exp_tmp * sum`, contracted
    m[g] = top
    for d in range(dim):
        acc[g * dim + d] *= carry
    pa, pz = first - first % GROUP, min(end + (-end) % GROUP, nb)
    for i in range(pa, start):
        s[base + i] = 0
    for i in range(stop, pz):
        s[base + i] = 0
    return pa, pz


def _view(address, n, like):
    """The n elements at `address` as a flat array of like's dtype (uint16 or float32)."""


@overload(_view, jit_options=_FLAGS, inline="always")
def _view_overload(address, n, like):
    if like.dtype == types.uint16:
        return lambda address, n, like: numba.carray(address_pointer(address), n, np.uint16)
    return lambda address, n, like: numba.carray(address_pointer(address), n, np.float32)


@cached_njit(inline="always", **_FLAGS)
def _write(b, kvh, step, kc, vc, dims, rows, pos, ring) -> int:
    """Sequence b's key and value of kv head kvh into its cache row (position p at index p, on
    a ring at slot p % ring); returns the element index of the row's first key of head kvh."""
    kv_heads, dim, slots, kv_stride = dims[1], dims[2], dims[3], dims[5]
    p = pos[b]
    base = (rows[b] * kv_heads + kvh) * slots * dim
    at = base + (p % ring if ring > 0 else p) * dim
    src = (b * kv_stride + kvh * dim) * kc.itemsize
    k, v = _view(step[1] + src, dim, kc), _view(step[2] + src, dim, kc)
    for d in range(dim):
        kc[at + d] = k[d]
        vc[at + d] = v[d]
    return base


@cached_njit(inline="always", **_FLAGS)
def _item(item, step, kc, vc, dims, rows, pos, ring, window, scale, scratch):
    """Work item `item` = b * kv_heads + kvh: write sequence b's key and value of kv head kvh
    into its cache row, then attend with the heads of kvh's group (scratch[item]: its
    float32 scratch, group * (2 D + BLOCK + 2)). dims: heads, kv_heads, D, slots, q's row
    stride, k's and v's, the step's kv_len (not read here: each row's keys are its own),
    torch's softmax lanes, the GEMMs' summation order (attention_ir.ORDERS)."""
    heads, kv_heads, dim, lanes, order = dims[0], dims[1], dims[2], dims[7], dims[8]
    group, size = heads // kv_heads, kc.itemsize
    b, kvh = item // kv_heads, item % kv_heads
    base = _write(b, kvh, step, kc, vc, dims, rows, pos, ring)
    p = pos[b]
    if ring > 0:  # slot i holds the row's latest position = i (mod ring), written if i <= p
        lo, hi = 0, min(p + 1, ring)
    else:
        lo, hi = (max(0, p - window + 1) if window > 0 else 0), p + 1
    mine, width = scratch[item], group * dim
    qf, acc, s = mine[:width], mine[width : 2 * width], mine[2 * width : 2 * width + group * BLOCK]
    m, sums = mine[2 * width + group * BLOCK :][:group], mine[mine.shape[0] - group :]
    acc[:] = 0
    m[:] = -np.inf
    sums[:] = 0
    first_head = kvh * group
    _widen(_view(step[0] + (b * dims[4] + first_head * dim) * size, width, kc), 0, qf, width)
    for start in range(lo - lo % BLOCK, hi, BLOCK):
        # the block's length in SDPA's key row for this sequence alone (its `hi` keys, not the
        # batch's kv_len): each key's place in the block's vector part or tail, so a sequence's
        # bits do not depend on the rows beside it
        nb = min(BLOCK, hi - start)
        first, end = max(lo, start) - start, min(hi, start + BLOCK) - start
        _scores(
            qf, group, kc, base + (start + first) * dim, end - first, s, first, scale, dim, order
        )
        pa, pz = 0, 0
        for g in range(group):
            pa, pz = _softmax_block(s, g, first, end, nb, lanes, m, sums, acc, dim, size == 2)
        _weigh(acc, group, s[pa:], vc, base + (start + pa) * dim, pz - pa, dim, order)
    for g in range(group):
        inverse = np.float32(1.0) / sums[g]
        for d in range(dim):
            acc[g * dim + d] *= inverse
    _narrow(acc, width, _view(step[3] + (b * heads + first_head) * dim * size, width, kc), 0)


def _entry(parallel: bool):
    """decode_attention's kernel: over every (sequence, kv head) item, parallel or serial.
    step: the addresses of q, k, v [B, 1, ...] and the output [B, 1, heads, D]."""

    def decode_attention(step, kc, vc, dims, rows, pos, ring, window, scale):
        items = rows.shape[0] * dims[1]
        group = dims[0] // dims[1]
        scratch = np.empty((items, group * (2 * dims[2] + BLOCK + 2)), np.float32)
        previous = set_chunk_size(chunk_size(items))
        for item in prange(items):
            _item(item, step, kc, vc, dims, rows, pos, ring, window, scale, scratch)
        set_chunk_size(previous)

    kind = "parallel" if parallel else "serial"
    decode_attention.__name__ = decode_attention.__qualname__ = f"decode_attention_{kind}"
    return cached_njit(parallel=parallel, **_FLAGS)(decode_attention)


DECODE_ATTENTION = _entry(parallel=True)
DECODE_ATTENTION_SERIAL = _entry(parallel=False)


@cached_njit(**_FLAGS)
def _write_step(step, kc, vc, dims, rows, pos) -> None:
    """Every sequence's key and value of every kv head into its cache row (decode_attention's
    writes, without the attention)."""
    for b in range(rows.shape[0]):
        for kvh in range(dims[1]):
            _write(b, kvh, step, kc, vc, dims, rows, pos, 0)


numba.config.CACHE_DIR = _previous_cache_dir  # every cached function above is decorated


def softmax_lanes() -> int:
    """The lanes of torch's Vectorized<float> (its softmax's vector part: 16 on its AVX512
    build, 8 on AVX2), or the target's where torch's build is another (glue.softmax_lanes
    None: the kernel then keeps its tolerance only)."""
    return glue.softmax_lanes() or attention_ir.lanes()


@functools.cache
def kernel_order() -> int:
    """The GEMMs' summation order (attention_ir.ORDERS) the kernel computes in this process:
    the one in which it gives this machine's SDPA bits (MKL's order is MKL's choice for the
    CPU: QUADS on an AMD EPYC, PAIRS on an Intel Xeon with AVX512-BF16), told by steps whose
    sums cancel (_tells_order: random rows do not tell them apart, their bfloat16 outputs hide
    most of a sum's last bits), then checked on random rows; QUADS where neither gives them
    (the kernel keeps its tolerance)."""
    if glue.softmax_lanes() is not None:
        for order in ORDERS:
            if _tells_order(order) and _gives_sdpa_bits(8, 2, 64, order):
                return order
    return QUADS


def _tells_order(order: int) -> bool:
    """The kernel in `order` gives SDPA's bits on two steps whose float32 sums are 1 in one
    order and 0 in the other (a term of 1 lost beside 2^25 - 2^25 or not): a score with
    products +2^25, -2^25 and 1 in dims 0, 4 and 1 (QUADS: 1, PAIRS: 0), and weighted values
    (every weight 1) of +2^25, -2^25 and 1 in keys 0, 2 and 1 (QUADS: 1, PAIRS: 0)."""
    big, D = 2.0**25, 64
    scores_k = torch.zeros(1, 1, 2, D)
    scores_k[0, 0, 0, [0, 4, 1]] = torch.tensor([big, -big, 1.0])
    scores_v = torch.zeros(1, 1, 2, D)
    scores_v[0, 0, 0] = 1.0
    weights_v = torch.zeros(1, 1, 12, D)
    weights_v[0, 0, [0, 2, 1]] = torch.tensor([big, -big, 1.0])[:, None]
    steps = (
        (torch.ones(1, 1, 1, D), scores_k, scores_v),  # q . k decides the weights
        (torch.zeros(1, 1, 1, D), torch.zeros(1, 1, 12, D), weights_v),  # every weight 1
    )
    for q, k_cache, v_cache in steps:
        q, caches = q.bfloat16(), [k_cache.bfloat16(), v_cache.bfloat16()]
        last = caches[0].shape[2] - 1
        k, v = (c[:, :, last : last + 1].transpose(1, 2).contiguous() for c in caches)
        if not _step_matches_sdpa(q, k, v, caches, [last], order):  # k, v where they are
            return False
    return True


@functools.cache
def gives_sdpa_bits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel's bfloat16 decode attention (in kernel_order) is torch's SDPA's bit
    for bit on this machine for this shape. SDPA's bits come from torch's build (its vector
    exp and lanes, softmax_lanes) and from MKL's bfloat16 GEMM, whose summation order is MKL's
    choice for the CPU (attention_ir states the ones the kernel computes); so it is checked,
    once per process and shape. False where torch's softmax is not reproduced at all
    (glue.softmax_lanes)."""
    if glue.softmax_lanes() is None:
        return False
    return _gives_sdpa_bits(heads, kv_heads, head_dim, kernel_order())


def _gives_sdpa_bits(heads: int, kv_heads: int, head_dim: int, order: int) -> bool:
    """The kernel's bfloat16 steps in `order` equal SDPA's on random rows: a batch of rows of
    different lengths over more than one softmax block, and a row whose last block is
    short."""
    gen = torch.Generator().manual_seed(0)
    # two steps: a batch whose rows end in another block, mid-group (559 keys: a block of
    # 512, then 47), and one row of 531 keys (a last block of 19: a lone vector chunk)
    return all(
        _matches_sdpa(positions, heads, kv_heads, head_dim, gen, order)
        for positions in ([BLOCK + 46, 129, 37], [BLOCK + 18])
    )


def _matches_sdpa(positions, heads, kv_heads, head_dim, gen, order) -> bool:
    """The kernel's bfloat16 step of random rows at `positions` equals sdpa_alone's bits."""
    B, kv_len = len(positions), max(positions) + 1
    slots = kv_len + 5

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 2).bfloat16()

    caches = [randn(B, kv_heads, slots, head_dim) for _ in "kv"]
    q, k, v = randn(B, 1, heads, head_dim), *(randn(B, 1, kv_heads, head_dim) for _ in "kv")
    return _step_matches_sdpa(q, k, v, caches, positions, order)


def _step_matches_sdpa(q, k, v, caches, positions, order) -> bool:
    """The kernel's one-thread step in `order` (q, k, v of B rows; k and v written into the
    caches [B, kv_heads, slots, D] at `positions`, row b in cache row b) equals sdpa_alone's
    bits over the caches it wrote."""
    host = tuple(cache_array(c) for c in caches)
    rows, at, kv_len = np.arange(len(positions)), np.array(positions), max(positions) + 1
    slots = caches[0].shape[2]
    out = _attend(q, k, v, host, slots, rows, at, kv_len, None, None, threads=1, order=order)
    return torch.equal(out, sdpa_alone(q, caches, positions))


def sdpa_alone(q: torch.Tensor, caches: list[torch.Tensor], positions: list[int]) -> torch.Tensor:
    """The kernel's reference: SDPA of each row's query q [B, 1, heads, D] over its own keys
    and values alone (caches [B, kv_heads, slots, D], row b's first positions[b] + 1 slots),
    as the sequence decodes alone -> [B, 1, heads, D]."""
    gqa = q.shape[2] != caches[0].shape[1]
    rows = [
        F.scaled_dot_product_attention(
            q[b : b + 1].transpose(1, 2),
            *(c[b : b + 1, :, : p + 1] for c in caches),
            enable_gqa=gqa,
        )
        for b, p in enumerate(positions)
    ]
    return torch.cat(rows).transpose(1, 2)


def _np_dtype(dtype: torch.dtype) -> type[np.generic]:
    return np.uint16 if dtype == torch.bfloat16 else np.float32


def cache_array(t: torch.Tensor) -> np.ndarray:
    """A contiguous host cache tensor [rows, kv_heads, S, D] of KERNEL_DTYPES as the flat array
    the kernel reads and writes, over the same memory (bfloat16 as its uint16 bits)."""
    if not (t.is_cpu and t.is_contiguous() and t.dtype in KERNEL_DTYPES):
        raise ValueError(f"attention kernel: the cache must be contiguous host {KERNEL_DTYPES}")
    return step_array(t, t.numel())


def step_array(t: torch.Tensor, span: int) -> np.ndarray:
    """The `span` elements of host tensor `t`'s memory from its first, flat, no aten op."""
    nbytes = span * t.element_size()
    buffer = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    return np.frombuffer(buffer, _np_dtype(t.dtype))


def row_stride(t: torch.Tensor) -> int | None:
    """The row stride (elements) of a step's q, k or v [B, 1, heads, D] whose [heads, D] are
    contiguous (the rows may be apart: a split of the stacked projection); None otherwise."""
    B, _, heads, D = t.shape
    strides = t.stride()
    if (D > 1 and strides[3] != 1) or (heads > 1 and strides[2] != D):
        return None
    return strides[0] if B > 1 else heads * D


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    caches: tuple[np.ndarray, np.ndarray],
    slots: int,
    rows: np.ndarray,
    positions: np.ndarray,
    kv_len: int,
    ring: int | None,
    window: int | None,
    threads: int | None = None,
    order: int | None = None,
) -> torch.Tensor:
    """Host q [B, 1, heads, D], k/v [B, 1, kv_heads, D] of one of KERNEL_DTYPES -> a new
    [B, 1, heads, D] in q's dtype, by the contract above, with k/v written first into `caches`
    (cache_array of the cache's [rows, kv_heads, slots, D] keys and values, the same dtype) at
    `positions` [B] (each < slots unless `ring`; max + 1 = `kv_len`) of the cache rows `rows`
    [B] (distinct, each a row of the cache; int64 arrays). `ring`: the layer keeps a ring of
    that many slots (its keys are the ring's written slots), else `window` (None: every
    position) limits each query's keys. `threads` None: torch's intra-op count (the user's
    --threads), the calling thread alone under MIN_PARALLEL_BYTES. `order` None:
    kernel_order()."""
    return _attend(q, k, v, caches, slots, rows, positions, kv_len, ring, window, threads, order)


def _attend(q, k, v, caches, slots, rows, positions, kv_len, ring, window, threads, order=None):
    """decode_attention's work (gives_sdpa_bits calls it by this name: a test counting the
    public function's calls does not see the check's)."""
    B, T, heads, D = q.shape
    kv_heads = k.shape[2]
    if not _fits(q, k, v, caches, slots, rows, positions, kv_len, ring):
        _check(q, k, v, caches, slots, rows, positions, kv_len, ring)  # raises the reason
    q_stride, k_stride, v_stride = map(row_stride, (q, k, v))
    if q_stride is None:
        q = q.contiguous()
        q_stride = heads * D
    if k_stride is None or k_stride != v_stride:
        k, v = k.contiguous(), v.contiguous()
        k_stride = kv_heads * D
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [B, 1, heads, D]
    scale = np.float32(1.0 / math.sqrt(D))  # torch's default SDPA scale
    step = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
    order = kernel_order() if order is None else order
    dims = (heads, kv_heads, D, slots, q_stride, k_stride, kv_len, softmax_lanes(), order)
    args = (step, *caches, dims, rows, positions, ring or 0, window or 0, scale)
    if threads is None:
        threads = step_threads(B, kv_len, ring, window, kv_heads, D, q.element_size())
    if threads == 1:
        DECODE_ATTENTION_SERIAL(*args)
    else:
        launch(DECODE_ATTENTION, threads, *args)
    return out


def step_threads(
    B: int, kv_len: int, ring: int | None, window: int | None, kv_heads: int, D: int, size: int
) -> int:
    """The threads a step of B rows attending to kv_len positions (within `ring` or `window`)
    runs on by default: torch's intra-op count, the calling thread alone where the keys and
    values it reads (`size` bytes a value) are under MIN_PARALLEL_BYTES."""
    keys = min(kv_len, ring or window or kv_len)
    small = B * keys * kv_heads * D * 2 * size < MIN_PARALLEL_BYTES
    return 1 if small else pool_threads()


def cache_fits(caches, slots, rows, positions, kv_len, ring, B, kv_heads, D) -> bool:
    """decode_attention's checks of the caches (cache_array's, one dtype) and the step's B
    cache rows and positions, for kv_heads heads of D values."""
    return (
        caches[0].dtype is caches[1].dtype
        and caches[0].shape[0] == caches[1].shape[0]
        and caches[0].shape[0] % (kv_heads * slots * D) == 0
        and positions.shape[0] == B
        and rows.shape[0] == B
        and (ring is not None or kv_len <= slots)
    )


def write_step(
    k: torch.Tensor,
    v: torch.Tensor,
    caches: tuple[np.ndarray, np.ndarray],
    slots: int,
    rows: np.ndarray,
    positions: np.ndarray,
    kv_len: int,
) -> bool:
    """decode_attention's cache writes alone (no ring): host k/v [B, 1, kv_heads, D] into
    `caches` at `positions` of the cache rows `rows`, as decode_attention takes them, the bits
    copied; the indexed assignment's result in one numba call and no aten op. False (nothing
    written) where decode_attention would not take these arguments."""
    if not _fits(k, k, v, caches, slots, rows, positions, kv_len, None):
        return False
    k_stride = row_stride(k)
    if k_stride is None or k_stride != row_stride(v):
        return False
    B, _, kv_heads, D = k.shape
    dims = (kv_heads, kv_heads, D, slots, k_stride, k_stride)
    _write_step((0, k.data_ptr(), v.data_ptr(), 0), *caches, dims, rows, positions)
    return True


def _fits(q, k, v, caches, slots, rows, positions, kv_len, ring) -> bool:
    """decode_attention's arguments fit together (the cheap test; _check says what does not)."""
    B, T, heads, D = q.shape
    dtype, kv_shape = q.dtype, k.shape
    return (
        T == 1
        and (dtype is torch.bfloat16 or dtype is torch.float32)
        and k.dtype is dtype
        and v.dtype is dtype
        and v.shape == kv_shape
        and kv_shape[0] == B
        and kv_shape[1] == 1
        and kv_shape[3] == D
        and heads % kv_shape[2] == 0
        and caches[0].dtype is _NP_DTYPES[dtype]
        and cache_fits(caches, slots, rows, positions, kv_len, ring, B, kv_shape[2], D)
        and q.is_cpu
        and k.is_cpu
        and v.is_cpu
    )


_NP_DTYPES = {torch.bfloat16: np.dtype(np.uint16), torch.float32: np.dtype(np.float32)}


def _check(q, k, v, caches, slots, rows, positions, kv_len, ring) -> None:
    """Raise the TypeError or ValueError naming what of decode_attention's arguments does not
    fit (_fits is False)."""
    B, T, heads, D = q.shape
    kv_heads = k.shape[2]
    if q.dtype not in KERNEL_DTYPES or not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"attention kernel: q, k, v must share a dtype of {KERNEL_DTYPES}")
    if caches[0].dtype != _np_dtype(q.dtype) or caches[1].dtype != caches[0].dtype:
        raise TypeError(f"attention kernel: the caches must hold q's dtype {q.dtype}")
    if not (q.is_cpu and k.is_cpu and v.is_cpu):
        raise ValueError("attention kernel: q, k, v must be host tensors")
    if T != 1 or k.shape != v.shape or k.shape[:2] != (B, 1) or k.shape[3] != D:
        raise ValueError(
            f"attention kernel: one query per sequence, q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if (
        heads % kv_heads
        or caches[0].shape != caches[1].shape
        or (caches[0].shape[0] % (kv_heads * slots * D))
    ):
        raise ValueError(
            f"attention kernel: q {tuple(q.shape)}, k {tuple(k.shape)} do not fit a cache of "
            f"{caches[0].shape[0]} elements with {slots} slots"
        )
    if positions.shape != (B,) or rows.shape != (B,):
        raise ValueError(f"attention kernel: {B} rows need {B} positions and cache rows")
    raise ValueError(f"attention kernel: kv_len {kv_len} beyond the cache's {slots} slots")
