"""GroupedQueryAttention's decode step on the host in one numba call: the arguments of
kernels/numba_attention_block.py's entry, made from the layer's projections, norms and KV
cache; None where the step is not one the block computes (the caller then runs the parts one
by one, with the same bits)."""

from __future__ import annotations

import math
import operator

import numpy as np
import torch

from hybridmoe import env
from hybridmoe.kernels import glue, numba_moe
from hybridmoe.kernels.host_arrays import host_array, host_logits
from hybridmoe.kernels.numba_attention import cache_fits, kernel_order, step_threads
from hybridmoe.kernels.projection import DECODE_MAX_TOKENS, DenseProjection
from hybridmoe.kernels.threads import kernel_threads

_DTYPES = {torch.bfloat16: np.uint16, torch.float32: np.float32}
_NO_F32 = np.empty(0, np.float32)
_NO_BF16 = np.empty(0, np.uint16)
_NO_U8 = np.empty(0, np.uint8)
# the block's router arguments where it routes nothing (numba_attention_block's h ... route)
_NO_ROUTE = (
    _NO_F32,
    _NO_BF16,
    _NO_F32,
    _NO_BF16,
    _NO_U8,
    _NO_F32,
    (0, 0, 0, 0, 0, 0, False, False, False),
)
_NO_I64 = np.empty(0, np.int64)
# the block's v arguments where q, k and v are one weight (numba_attention_block's v_w ... v_meta)
_NO_V = (_NO_U8, _NO_F32, _NO_F32, _NO_BF16, (0, 0, False))
# the plans a layer keeps (_plan): each holds its step's arrays (~1.3 MB a Qwen3-30B-A3B layer
# at 16 rows), so a server whose batch size moves keeps a few, not one for every size
MAX_PLANS = 3
# the block's expert arguments where it computes no experts (numba_attention_block's moe_x ...
# moe_y)
_NO_EXPERTS = (
    _NO_F32,
    _NO_I64,
    _NO_F32,
    _NO_BF16,
    (_NO_U8, _NO_U8, 0, _NO_U8, 0, 0, 0),
    (0, (0, np.float32(0), np.float32(0)), _NO_F32, _NO_F32),
    _NO_F32,
)


def decode_block(
    qkv: DenseProjection,
    o: DenseProjection,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    x: torch.Tensor,
    batch,  # layers.batch.ForwardBatch (kernels sit below layers: not imported)
    layer_idx: int,
    window: int | None,
    shape: tuple[int, int, int],
    residual: tuple | None = None,
    route: tuple | None = None,
    experts: tuple | None = None,
    plans: dict | None = None,
    v: DenseProjection | None = None,
) -> torch.Tensor | tuple | None:
    """o(attention(norm_rotary(q, k), v)) for the normed input x [B, 1, H] of a decode step,
    with q/k/v = qkv(x) (heads, kv_heads, D = `shape`; the KV cache `batch.kv` written at the
    step's positions): what GroupedQueryAttention computes part by part for a layer with
    per-head q/k norms (`q_norm`, `k_norm` [D]) and full rotary, in one call; -> [B, 1, H] in
    x's dtype. None unless x is a contiguous host bfloat16 or float32 tensor of at most
    DECODE_MAX_TOKENS rows, the cache's decode kernel takes the step (KVCache.kernel_step) and
    the parts' kernels would (the glue, dense and block switches of hybridmoe/env.py on).
    With `residual` = (delta, input norm scale, post-attention norm scale), x is the residual
    stream instead: s = x + delta (delta None: s = x) and its input norm, the attention of
    that, then s + the attention's output and its post-attention norm, as layers/norm.
    add_rms_norm computes them (bfloat16 x: the norms' scale rounded; a float32 delta rounded
    first), come back as (stream, normed, routes, partial); None also where add_rms_norm
    would not take the kernel. routes: with `route` = (gate, k, renormalise, weights dtype)
    of a softmax router (its gate a DenseProjection) the block routes the normed output as
    gate.route does, and routes is gate.route's answer, (ids, weights) or the logits [B, E]
    where it leaves the routing to torch (a tie); None without `route` or where gate.route
    would not take the step (the caller then routes). partial: with `route` and `experts` =
    (formats, bank, moe, threads) of the MoE layer's bank (moe/cpu_experts.block_experts:
    numba_attention_block's arguments and the thread count its kernel computes on) the
    routed experts' float32 partial [B, 1, H] of those routes, as cpu_experts.fused_cpu_moe
    gives it; None without `experts` or where the block did not compute it (a tie, no
    routes, `threads` not the block's). `plans`: the caller's dict (one a layer) where the
    step's _Plan is kept for the next steps of its shape."""
    if not (env.attention_block() and env.glue_kernels() and env.dense_kernel()):
        return None
    if x.dim() != 3 or not (x.is_cpu and x.is_contiguous()):
        return None
    delta = None if residual is None else residual[0]
    if delta is not None and not (delta.is_cpu and delta.is_contiguous()):
        return None
    plan = _plan(plans, qkv, o, q_norm, k_norm, x, shape, residual, route, experts, v)
    if not plan.fits:
        return None
    heads, kv_heads, dim = shape
    B, dtype = x.shape[0], x.dtype
    cos, sin = batch.cos, batch.sin
    for t in (cos, sin):
        if t.dtype is not dtype or not t.is_cpu or not t.is_contiguous():
            return None
    if cos.shape != (B, 1, dim) or sin.shape != cos.shape:
        return None
    if delta is not None and delta.shape != x.shape:
        return None
    kernel_step = getattr(batch.kv, "kernel_step", None)
    if kernel_step is None:
        return None
    step = kernel_step(layer_idx, batch, dtype, heads, kv_heads, dim, 1, True, window)
    if step is None:
        return None
    caches, slots, rows, positions, ring, window = step
    if not cache_fits(caches, slots, rows, positions, batch.kv_len, ring, B, kv_heads, dim):
        return None  # the parts' path raises what does not fit
    return _run(
        qkv, o, q_norm, k_norm, eps, x, batch, step, shape, plan.lanes, residual, plan.route,
        plan.experts, plan=plan,
    )  # fmt: skip


class _Plan:
    """What a decode step of the block is for one layer, the step's dtype and rows, the
    residual's delta dtype and the kernels' thread count: the checks that depend on nothing
    else (`fits`), the router's and experts' offers the block takes (`route`, `experts`) and
    _run's arguments made from the layer's parts alone, and (`outputs`, `args`: made on its
    first step) the launch's arguments over arrays of its own. decode_block keeps it in the
    caller's `plans` and makes it again where a part is no longer the one it was made of
    (to(), quantize: other tensors or another kernel call); each step then checks and sets
    only what the step brings (the batch's rotary rows, cache rows and positions, the stream
    and delta addresses). On the 1 GB q4_k_m GGUF the glue of a decode step went 0.96 → 0.74
    ms a token with it, aten ops 54 → 18 (benchmarks/bench_decode_overhead.py)."""

    __slots__ = (
        "parts", "fits", "lanes", "route", "experts", "threads", "qkv_call", "o_call",
        "qkv_par", "o_par", "kernel", "sizes", "qk_norms", "norm_flags", "scales", "routing",
        "outputs", "args", "v_call", "v_par", "tie",
    )  # fmt: skip

    def __init__(
        self, qkv, o, q_norm, k_norm, x, shape, residual, route, experts, checked=False, v=None
    ):
        self.parts = _parts(qkv, o, q_norm, k_norm, residual, route, experts, v)
        self.outputs = self.args = None  # _launch_args', made on the plan's first step
        self.lanes = glue.softmax_lanes()
        self.threads = numba_moe.pool_threads()
        if checked:  # _run's caller checked the step: its route and experts as given
            self.fits, self.route, self.experts = True, route, experts
        else:
            self.fits = self.lanes is not None and _fits(
                qkv, o, q_norm, k_norm, x, shape, residual, v
            )
            self.route = self.experts = None
            if self.fits and route is not None and residual is not None:
                gate, top_k, _, weights_dtype = route  # gate.route of the post-attention
                if gate.routes(x, top_k, weights_dtype):  # norm's output: x's dtype, shape
                    self.route = route
            if self.route is not None and experts is not None and experts[3] == self.threads:
                self.experts = experts  # one launch: one thread count
        if self.fits:
            self._arguments(qkv, o, q_norm, k_norm, x, shape, residual, v)

    def _arguments(self, qkv, o, q_norm, k_norm, x, shape, residual, v) -> None:
        from hybridmoe.kernels.numba_attention_block import TIE, block_kernel

        heads, kv_heads, dim = shape
        dtype, bf16, hidden = x.dtype, x.dtype is torch.bfloat16, x.shape[-1]
        self.qkv_call, self.o_call = qkv.host_call(), o.host_call()
        self.qkv_par = self.qkv_call.threads(self.threads) > 1
        self.o_par = self.o_call.threads(self.threads) > 1
        self.v_call = None if v is None else v.host_call()  # v apart from q and k
        self.v_par = v is not None and self.v_call.threads(self.threads) > 1
        self.sizes = (hidden, heads, kv_heads, dim), (
            self.qkv_call.row_bytes, self.qkv_call.rows_per_item, self.o_call.row_bytes,
            self.o_call.rows_per_item,
        )  # fmt: skip
        self.qk_norms = q_norm.data_ptr(), k_norm.data_ptr()
        if residual is None:
            self.norm_flags, self.scales = (0, 0, False, False), (0, 0)
        else:
            delta, in_scale, post_scale = residual
            in_flags = glue.norm_flags(dtype, dtype, bf16, None if delta is None else delta.dtype)
            self.norm_flags = (in_flags, glue.norm_flags(dtype, dtype, bf16, dtype), True, True)
            self.scales = in_scale.data_ptr(), post_scale.data_ptr()
        gate_fmt, formats, self.routing = None, None, None
        if self.route is not None:  # the router's step, as numba_dense.DenseCall.route makes it
            gate, top_k, renorm, weights_dtype = self.route
            gate_call = gate.host_call()
            gate_fmt = gate_call.fmt.name
            self.routing = gate_call.weight, gate_call.bias, (
                gate_call.row_bytes, gate.out_features, gate_call.rows_per_item, top_k,
            ), (
                weights_dtype is torch.bfloat16, bool(renorm), gate_call.threads(self.threads) > 1
            )  # fmt: skip
        if self.experts is not None:
            formats = self.experts[0]
        q8 = (self.qkv_call.q8, self.o_call.q8)
        v_kind = None if v is None else (self.v_call.fmt.name, self.v_call.q8)
        self.tie = TIE  # the kernel's status for a router's tie (_run compares it)
        self.kernel = block_kernel(
            self.qkv_call.fmt.name, self.o_call.fmt.name, gate_fmt, formats, q8, v_kind
        )

    def holds(self, qkv, o, q_norm, k_norm, residual, route, experts, v=None) -> bool:
        """Whether it was made of these parts (the same objects and kernel calls: a weight's
        change drops its projection's call, DenseProjection.prepared_call)."""
        parts = _parts(qkv, o, q_norm, k_norm, residual, route, experts, v, _prepared_call)
        return all(map(operator.is_, parts, self.parts))  # the same length: _parts


def _host_call(projection: DenseProjection | None):
    """The projection's kernel call, made where its weight is on the host; else None."""
    if projection is None or not projection.weight.is_cpu:
        return None
    return projection.host_call()


def _prepared_call(projection: DenseProjection | None):
    """The projection's kernel call as made and kept (None: none, or dropped since)."""
    return None if projection is None else projection.prepared_call


def _parts(qkv, o, q_norm, k_norm, residual, route, experts, v=None, call=_host_call) -> tuple:
    """What a _Plan is made of: the objects, and the projections' kernel calls by `call`
    (which a weight's change replaces): made by host_call where the weight is on the host
    (a new plan), or as kept (_Plan.holds: no host_call, no device check, on every step)."""
    scales = (None, None) if residual is None else residual[1:]
    gate = None if route is None else route[0]
    calls = (call(qkv), call(o), call(gate), call(v))
    return (qkv, o, q_norm, k_norm, *scales, route, experts, v, *calls)


def _plan(plans, qkv, o, q_norm, k_norm, x, shape, residual, route, experts, v=None) -> _Plan:
    """The step's _Plan from `plans` (None: made for this step alone); made again where its
    parts changed, and then the layer's other plans go too (made of the old parts)."""
    delta = None if residual is None else residual[0]
    key = (
        x.dtype, x.shape, residual is None, None if delta is None else delta.dtype,
        kernel_threads(),
    )  # fmt: skip
    plan = None if plans is None else plans.get(key)
    if plan is not None:
        if plan.holds(qkv, o, q_norm, k_norm, residual, route, experts, v):
            return plan
        plans.clear()
    plan = _Plan(qkv, o, q_norm, k_norm, x, shape, residual, route, experts, v=v)
    if plans is not None:
        if len(plans) >= MAX_PLANS:  # the oldest goes: a server's batch sizes come and go
            del plans[next(iter(plans))]
        plans[key] = plan
    return plan


def _fits(qkv, o, q_norm, k_norm, x, shape, residual, v=None) -> bool:
    """decode_block's checks of the layer's parts against the step's x (its dtype and shape);
    `v`: v's projection apart from q and k's (`qkv` then q and k's rows only)."""
    heads, kv_heads, dim = shape
    B, T, hidden = x.shape
    if x.dtype not in _DTYPES or T != 1 or B > DECODE_MAX_TOKENS or q_norm is None:
        return False
    if k_norm is None or not (qkv.uses_kernel(x) and o.weight.is_cpu):
        return False
    for t in (q_norm, k_norm):
        if t.dtype is not x.dtype or not t.is_cpu or not t.is_contiguous():
            return False
    if q_norm.shape != (dim,) or k_norm.shape != (dim,):
        return False
    width = (heads + (2 if v is None else 1) * kv_heads) * dim
    if qkv.out_features != width or qkv.in_features != hidden:
        return False
    if v is not None:
        if v.out_features != kv_heads * dim or v.in_features != hidden or not v.uses_kernel(x):
            return False
    if o.in_features != heads * dim or o.out_features != hidden:
        return False
    return residual is None or _residual_fits(x, *residual)


def _expert_args(experts: tuple, h: np.ndarray, routes: tuple, bf16: bool) -> tuple:
    """numba_attention_block's moe_x ... moe_y for `experts` (formats, bank, moe, threads),
    the post-attention norm's output h (its array: bfloat16 bits where `bf16`) and the block's
    routes (ids, weights) tensors: the experts' inputs as fused_cpu_moe hands them to its
    kernel (float32: bfloat16 ones widened by the block), the partial (the block zeroes it
    before its experts add into it)."""
    _, bank, moe, _ = experts
    ids, weights = routes
    partial = np.empty(h.shape[0], np.float32)
    moe_x = np.empty(h.shape[0], np.float32) if bf16 else h
    ids_arr = host_array(ids, np.int64)
    if weights.dtype is torch.bfloat16:
        weights_arr, weights_bf16 = (
            np.empty(ids.numel(), np.float32),
            host_array(weights, np.uint16),
        )
    else:
        weights_arr, weights_bf16 = host_array(weights, np.float32), _NO_BF16
    return moe_x, ids_arr, weights_arr, weights_bf16, bank, moe, partial


def _residual_fits(x, delta, in_scale, post_scale) -> bool:
    """Whether layers/norm.add_rms_norm (rms_norm without delta) takes glue.norm's kernel for
    the input norm, and add_rms_norm for the post-attention one (its y: the attention's output,
    of x's dtype and shape)."""
    if in_scale.dtype is not x.dtype or post_scale.dtype is not x.dtype:
        return False
    if delta is not None and delta.dtype not in (x.dtype, torch.float32):
        return False
    return glue.norm_fits(x, in_scale, delta) and glue.norm_fits(x, post_scale)


# where _run's per-step values go in a plan's launch arguments (numba_attention_block's order)
_X, _SIZES, _FLAGS, _NORMS, _CACHES, _ROWS, _EPS, _ADDRESSES = 0, 13, 14, 15, 16, 18, 20, 22
_LOGITS = 26  # the router's logits (float32; bfloat16 bits one on)


def _run(
    qkv, o, q_norm, k_norm, eps, x, batch, step, shape, lanes, residual=None, route=None,
    experts=None, plan=None,
):  # fmt: skip
    """The block's call for a step decode_block checked (`plan`: its _Plan, whose route and
    experts these are; None: made here of them). The plan's outputs are its own arrays,
    written again by the next step of its shape: a caller uses them within the step (a
    decoder layer's stream and delta go to the next layer; a model's steps run one at a
    time)."""
    if plan is None:
        plan = _Plan(qkv, o, q_norm, k_norm, x, shape, residual, route, experts, checked=True)
    if plan.args is None:
        plan.outputs, plan.args = _launch_args(plan, x, shape, residual)
    heads, kv_heads, dim = shape
    caches, slots, rows, positions, ring, window = step
    B, bf16, args = x.shape[0], x.dtype is torch.bfloat16, plan.args
    attention_threads = block_attention_threads(
        step_threads(B, batch.kv_len, ring, window, kv_heads, dim, x.element_size()),
        plan.qkv_par,
        B * kv_heads,
        plan.threads,
    )
    head, tail = plan.sizes
    order = kernel_order()
    args[_SIZES] = (*head, slots, batch.kv_len, lanes, B, *tail, ring or 0, window or 0, order)
    args[_FLAGS] = (plan.qkv_par, plan.o_par, attention_threads > 1, bf16)
    args[_NORMS] = (*plan.qk_norms, batch.cos.data_ptr(), batch.sin.data_ptr())
    args[_CACHES], args[_CACHES + 1], args[_ROWS], args[_ROWS + 1] = *caches, rows, positions
    args[_EPS] = float(eps)
    out, after, post_normed, routes, partial, summed = plan.outputs
    if residual is None:  # x is the normed input
        args[_X + bf16] = host_array(x, _DTYPES[x.dtype])
    else:  # x is the stream: the input norm writes the x array, the block ends with the norm
        delta, stream, (in_scale, post_scale) = residual[0], x.data_ptr(), plan.scales
        args[_ADDRESSES] = (
            stream, stream if delta is None else delta.data_ptr(),
            stream if delta is None else summed.data_ptr(), in_scale, after.data_ptr(),
            post_normed.data_ptr(), post_scale,
        )  # fmt: skip
    status = numba_moe.launch(plan.kernel, plan.threads, *args)
    if residual is None:
        return out
    if status == plan.tie:  # the logits, for torch to route (gate.route's); no experts computed
        logits = args[_LOGITS + bf16]
        return after, post_normed, host_logits(logits, B, plan.routing[2][1]), None
    if status >= 0:  # fused_cpu_moe's error
        bank = experts[1]
        raise IndexError(f"expert id {status} out of range: the bank has {bank[6]} experts")
    return after, post_normed, routes, partial


def block_attention_threads(standalone: int, qkv_parallel: bool, items: int, threads: int) -> int:
    """The threads of the block's attention over `items` (sequence, kv head) pairs: those of a
    standalone launch (`standalone`: step_threads'), or all `threads` where the block's q/k/v
    projection runs on the pool and there are at least 2 items a thread. The pool is awake
    there (the projection has just run on it): a parallel region costs µs, not the ms of
    waking it that step_threads' byte threshold guards a standalone launch from. On the AMD
    EPYC's Qwen3-30B-A3B-shaped q4_k_m layer: attention 147 -> 82 µs a layer at batch 4, 47
    -> 35 at batch 1. Either path computes each item the same way: the same bits."""
    if qkv_parallel and items >= 2 * threads:
        return threads
    return standalone


def _launch_args(plan, x, shape, residual) -> tuple[tuple, list]:
    """A plan's outputs (out, after, post_normed, routes, the partial, the stream + delta sum;
    None where the step has none) and its launch arguments (a list: _run sets the step's
    values), over arrays of its own."""
    heads, kv_heads, dim = shape
    dtype, (B, _, hidden) = x.dtype, x.shape
    np_dtype, bf16 = _DTYPES[dtype], dtype is torch.bfloat16
    width = (heads + 2 * kv_heads) * dim
    out = torch.empty((B, 1, hidden), dtype=dtype)
    y = host_array(out, np_dtype)
    qkv_out, att = np.empty(B * width, np_dtype), np.empty(B * heads * dim, np_dtype)
    scratch = np.empty(3 * B * heads * dim * x.element_size(), np.uint8)
    x_arr = np.empty(B * hidden, np_dtype)  # the input norm's output (with a residual)
    after = post_normed = summed = routes = partial = None
    if residual is not None:
        after, post_normed = (torch.empty(x.shape, dtype=dtype) for _ in "ap")
        summed = None if residual[0] is None else torch.empty(x.shape, dtype=dtype)
    if bf16:
        arrays = (_NO_F32, x_arr, _NO_F32, qkv_out, _NO_F32, att, _NO_F32, y)
    else:
        arrays = (x_arr, _NO_BF16, qkv_out, _NO_BF16, att, _NO_BF16, y, _NO_BF16)
    routing, computing = _NO_ROUTE, _NO_EXPERTS
    if plan.route is not None:  # the router's step, as numba_dense.DenseCall.route makes it
        _, top_k, _, weights_dtype = plan.route
        gate_w, gate_bias, (row_bytes, gate_rows, items, _), bits = plan.routing
        routes = (
            torch.empty((B, top_k), dtype=torch.int64),
            torch.empty((B, top_k), dtype=weights_dtype),
        )
        h = host_array(post_normed, np_dtype)
        logits = np.empty(B * gate_rows, np_dtype)  # [B, E] gate.route's, for a tie
        routing = (
            *((_NO_F32, h, _NO_F32, logits) if bf16 else (h, _NO_BF16, logits, _NO_BF16)),
            gate_w, gate_bias,
            (row_bytes, gate_rows, items, top_k, routes[0].data_ptr(), routes[1].data_ptr(), *bits),
        )  # fmt: skip
        if plan.experts is not None:
            computing = _expert_args(plan.experts, h, routes, bf16)
            partial = torch.from_numpy(computing[-1]).view(B, 1, hidden)
    apart = _NO_V  # v's projection apart from q and k's (numba_attention_block's v_w ... v_meta)
    if plan.v_call is not None:
        v_call, v_out = plan.v_call, np.empty(B * kv_heads * dim, np_dtype)
        outputs = (_NO_F32, v_out) if bf16 else (v_out, _NO_BF16)
        meta = (v_call.row_bytes, v_call.rows_per_item, plan.v_par)
        apart = (v_call.weight, v_call.bias, *outputs, meta)
    args = [
        *arrays, scratch, plan.qkv_call.weight, plan.qkv_call.bias, plan.o_call.weight,
        plan.o_call.bias, None, None, None, None, None, None, None, None,
        np.float32(1.0 / math.sqrt(dim)), (0,) * 7, plan.norm_flags, *routing, *computing, *apart,
    ]  # fmt: skip
    return (out, after, post_normed, routes, partial, summed), args
