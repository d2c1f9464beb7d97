"""A decode step's attention block in one numba call (docs/proposals/0007): the stacked q/k/v
projection, the per-head q/k norms and rotary, the KV write and attention, the o projection.

Each part is the kernel the step runs without the block (numba_dense's `_dense`, numba_glue.
norm_rotary_rows, numba_attention's decode kernel), called with the arguments its Python
wrapper would make, in the same order, so the block's output has the same bits
(tests/layers/test_attention_block.py). What the block saves is the wrappers: ~10 Python
calls and their objects a layer, each 10-40 µs on a decode step's cold caches (proposal 0007's
measurements), for one call.

`block_kernel(qkv_fmt, o_fmt)` makes the entry for a pair of dense formats on first use (the
formats are compile-time constants, as numba_moe's entries), cached on disk under a hash of
the sources it calls. `head_kernel(fmt, q8)` makes the step's last call the same way: the
final RMSNorm with its residual add and the output head (kernels/head_block.py).
"""

from __future__ import annotations

import numpy as np
from numba.core.dispatcher import Dispatcher

from hybridmoe import env
from hybridmoe.kernels import (
    attention_ir,
    dense_ir,
    llvm_ir,
    numba_attention,
    numba_dense,
    numba_dense_q8,
    numba_glue,
    softmax_ir,
)
from hybridmoe.kernels.numba_attention import DECODE_ATTENTION, DECODE_ATTENTION_SERIAL
from hybridmoe.kernels.numba_cache import EntryCache, cached_njit
from hybridmoe.kernels.numba_dense import dense_parallel, dense_route, dense_serial
from hybridmoe.kernels.numba_dense_q8 import dense_q8_parallel, dense_q8_serial
from hybridmoe.kernels.numba_glue import norm_rotary_rows, norm_rows, widen_bf16
from hybridmoe.kernels.numba_moe import moe_parallel
from hybridmoe.kernels.numba_moe_q8 import kernel_sources, moe_q8_parallel
from hybridmoe.quant.formats import WEIGHT_FORMATS

# sizes: hidden, heads, kv_heads, head dim, slots, kv_len, softmax lanes, tokens, then the q/k/v
# weight's row bytes and work-item rows, the o weight's, the ring and window (0: none), the
# attention's summation order (attention_ir.ORDERS)
SIZES = 16
# flags: q/k/v parallel, o parallel, attention parallel, bfloat16 activations
FLAGS = 4
# what the block returns: done (with experts: computed), a router's tie (its logits left to
# torch, the experts not computed); an expert id out of the bank's range is returned itself
DONE = -1
TIE = -2

_SOURCES = (
    __file__,
    numba_dense.__file__,
    numba_dense_q8.__file__,
    dense_ir.__file__,
    numba_glue.__file__,
    numba_attention.__file__,
    attention_ir.__file__,
    softmax_ir.__file__,
    llvm_ir.__file__,
    *kernel_sources(),
)
_BLOCKS = EntryCache(str(env.kernel_cache_dir(*_SOURCES)))


def block_kernel(
    qkv_fmt: str,
    o_fmt: str,
    route_fmt: str | None = None,
    experts: tuple[str, str, bool] | None = None,
    q8: tuple[bool, bool] = (False, False),
    v: tuple[str, bool] | None = None,
) -> Dispatcher:
    """The attention block's entry for q/k/v weights in format `qkv_fmt` and o's in `o_fmt`
    (names), with `route_fmt` a router's gate in that format routed after the post-attention
    norm, and with `experts` = (gate/up format, down format, q8 activations) the routed
    experts of a bank of those computed after the routing; `q8`: whether q/k/v's and o's
    projections take q8 activations (numba_dense_q8's kernel); `v` = (format, q8) of v's
    projection where it is a weight apart from q and k's (q/k/v's weight then q and k's rows
    only); made on first use."""
    kernels = (WEIGHT_FORMATS[qkv_fmt].kernel, WEIGHT_FORMATS[o_fmt].kernel)
    route = None if route_fmt is None else WEIGHT_FORMATS[route_fmt].kernel
    pair = None
    if experts is not None:
        gate_up, down, experts_q8 = experts
        pair = (WEIGHT_FORMATS[gate_up].kernel, WEIGHT_FORMATS[down].kernel, experts_q8)
    v_kind = None if v is None else (WEIGHT_FORMATS[v[0]].kernel, v[1])
    key = (qkv_fmt, o_fmt, route_fmt, experts, q8, v)
    return _BLOCKS.get(key, lambda: _block_entry(*kernels, route, pair, q8, v_kind))


def _block_entry(qkv_kernel, o_kernel, route_kernel=None, experts=None, q8=(False, False), v=None):
    """The block for these two KernelFormats (and a router's gate in `route_kernel`, None:
    none; and with `experts` = (gate/up KernelFormat, down KernelFormat, q8 activations) the
    routed experts, numba_moe.moe_parallel's or numba_moe_q8.moe_q8_parallel's call, after
    a route_kernel block's routing; `q8` (q/k/v's, o's): the projection by numba_dense_q8's
    kernel, the same arguments; `v` = (KernelFormat, q8) of v's own weight, apart from q and
    k's). Arguments:
    x, x_bf16: the normed input [tokens * hidden] (float32, or bfloat16 bits; the other empty),
    qkv, qkv_bf16: the q/k/v projection's output [tokens * (heads + 2 kv_heads) * D], written,
    att, att_bf16: the attention's output [tokens * heads * D], written,
    y, y_bf16: the o projection's output [tokens * hidden], written (the block's result),
    scratch: uint8 workspace of 3 * tokens * heads * D values (the normed, rotated q and k and
    the step's values when tokens > 1),
    qkv_w, qkv_bias, o_w, o_bias: the weights' bytes and float32 biases (empty: none),
    sizes (SIZES ints), flags (FLAGS bools), norms (q norm, k norm, cos, sin addresses; the
    norms 0: none), kc, vc: the layer's cache arrays, rows, pos: the step's cache rows and
    positions, eps, scale: the norm's epsilon and the attention's scale (float32);
    residual: the layer's residual adds and norms around the attention (numba_glue.norm_rows'
    addresses: the stream, the previous layer's MLP output, their sum, the input norm's scale,
    the sum after the attention, its norm, the post-attention norm's scale), residual_flags:
    norm_rows' flags of the input norm and of the post-attention one, whether each runs (else
    x holds the normed input and the block ends with the o projection);
    normed, normed_bf16, logits, logits_bf16: the post-attention norm's output [tokens *
    hidden] (the array at its address) and the router's logits [tokens * experts], written;
    route_w,
    route_bias: the gate's bytes and float32 bias (empty); route: (row bytes, experts,
    work-item rows, k, ids address, weights address, weights bfloat16, renormalise, parallel):
    what numba_dense.dense_route takes after the post-attention norm (a route_kernel block
    runs its norms; `parallel`: dense_route's);
    moe_x: float32 [tokens * hidden], the experts' input: the normed array itself for float32
    activations, else written (the normed bits widened); moe_ids: int64 [tokens * k], the
    array at the route's ids address; moe_w, moe_w_bf16: float32 [tokens * k], the route's
    weights (float32 weights: the array at their address, moe_w_bf16 empty; bfloat16 ones: at
    moe_w_bf16, widened into moe_w); bank: (gate, up, expert rows, down, hidden, inter,
    experts) and moe: (act_bf16, act, gate/up bias, down bias), numba_moe._fused_moe's
    arguments; moe_y: float32 [tokens * hidden], the experts' partial (zeroed, then written:
    the experts' kernel adds into it).
    v_w, v_bias, v_y, v_y_bf16, v_meta: with `v`, v's weight bytes and float32 bias (empty:
    none), its output [tokens * kv_heads * D] (float32, or bfloat16 bits; the other empty),
    (row bytes, work-item rows, parallel); q/k/v's weight is then q and k's rows alone, its
    output rows (heads + kv_heads) * D wide; without `v` empty and unread.
    Returns DONE, TIE (dense_route left the routing to torch: the experts not computed) or
    an expert id >= the bank's experts (its kernel's answer). A block computing the experts
    routes with `any_order` (numba_glue._topk_row): its kernels' sum does not depend on the
    routes' order, so where torch.topk's pick among ties is not reproduced only a tie at the
    k-th place is left to torch."""
    routes = route_kernel is not None
    gate_kernel = qkv_kernel if route_kernel is None else route_kernel  # compiled, not run
    computes_experts = experts is not None
    qkv_q8, o_q8 = q8
    has_v = v is not None
    v_kernel, v_q8 = (qkv_kernel, False) if v is None else v
    gate_up_kernel, down_kernel, q8 = (
        (qkv_kernel, qkv_kernel, False) if experts is None else experts
    )

    def attention_block(
        x, x_bf16, qkv, qkv_bf16, att, att_bf16, y, y_bf16, scratch, qkv_w, qkv_bias, o_w,
        o_bias, sizes, flags, norms, kc, vc, rows, pos, eps, scale, residual, residual_flags,
        normed, normed_bf16, logits, logits_bf16, route_w, route_bias, route, moe_x, moe_ids,
        moe_w, moe_w_bf16, bank, moe, moe_y, v_w, v_bias, v_y, v_y_bf16, v_meta,
    ):  # fmt: skip
        hidden, heads, kv_heads, dim, slots, kv_len, lanes, tokens = sizes[:8]
        qkv_row_bytes, qkv_items, o_row_bytes, o_items, ring, window, order = sizes[8:]
        qkv_par, o_par, attn_par, bf16 = flags
        width = (heads + 2 * kv_heads) * dim
        if has_v:  # q/k/v's output holds q and k, v's its own
            width = (heads + kv_heads) * dim
        stream, previous, summed, in_scale, after, post_normed, post_scale = residual
        in_flags, post_flags, pre, post = residual_flags
        if pre:  # the input norm (with the residual add before it) writes x
            h = np.int64(x_bf16.ctypes.data if bf16 else x.ctypes.data)
            norm_rows(stream, previous, in_scale, summed, h, tokens, hidden, eps, in_flags)
        if qkv_q8 and qkv_par:
            dense_q8_parallel(
                qkv_kernel, qkv_w, qkv_row_bytes, hidden, width, x, x_bf16, tokens, qkv_bias,
                qkv, qkv_bf16, qkv_items,
            )  # fmt: skip
        elif qkv_q8:
            dense_q8_serial(
                qkv_kernel, qkv_w, qkv_row_bytes, hidden, width, x, x_bf16, tokens, qkv_bias,
                qkv, qkv_bf16, qkv_items,
            )  # fmt: skip
        elif qkv_par:
            dense_parallel(
                qkv_kernel, qkv_w, qkv_row_bytes, hidden, width, x, x_bf16, tokens, qkv_bias,
                qkv, qkv_bf16, qkv_items,
            )  # fmt: skip
        else:
            dense_serial(
                qkv_kernel, qkv_w, qkv_row_bytes, hidden, width, x, x_bf16, tokens, qkv_bias,
                qkv, qkv_bf16, qkv_items,
            )  # fmt: skip
        if has_v:
            v_row_bytes, v_items, v_par = v_meta
            v_rows = kv_heads * dim
            if v_q8:
                if v_par:
                    dense_q8_parallel(
                        v_kernel, v_w, v_row_bytes, hidden, v_rows, x, x_bf16, tokens, v_bias,
                        v_y, v_y_bf16, v_items,
                    )  # fmt: skip
                else:
                    dense_q8_serial(
                        v_kernel, v_w, v_row_bytes, hidden, v_rows, x, x_bf16, tokens, v_bias,
                        v_y, v_y_bf16, v_items,
                    )  # fmt: skip
            elif v_par:
                dense_parallel(
                    v_kernel, v_w, v_row_bytes, hidden, v_rows, x, x_bf16, tokens, v_bias, v_y,
                    v_y_bf16, v_items,
                )  # fmt: skip
            else:
                dense_serial(
                    v_kernel, v_w, v_row_bytes, hidden, v_rows, x, x_bf16, tokens, v_bias, v_y,
                    v_y_bf16, v_items,
                )  # fmt: skip
        size = 2 if bf16 else 4
        base = np.int64(qkv_bf16.ctypes.data if bf16 else qkv.ctypes.data)
        q_rot = np.int64(scratch.ctypes.data)
        k_rot = q_rot + tokens * heads * dim * size
        norm_rotary_rows(
            base, base + heads * dim * size, width, width, heads, kv_heads, dim, norms[0],
            norms[1], norms[2], norms[3], q_rot, k_rot, tokens, eps, bf16,
        )  # fmt: skip
        v = base + (heads + kv_heads) * dim * size
        if has_v:  # its own output: contiguous rows already
            v = np.int64(v_y_bf16.ctypes.data if bf16 else v_y.ctypes.data)
        elif tokens > 1:  # the values contiguous, as the attention kernel reads k and v alike
            row = kv_heads * dim * size
            at = k_rot + tokens * heads * dim * size
            source = qkv_bf16.view(np.uint8) if bf16 else qkv.view(np.uint8)
            for t in range(tokens):
                first = (t * width + (heads + kv_heads) * dim) * size
                for i in range(row):
                    scratch[at - q_rot + t * row + i] = source[first + i]
            v = at
        out = np.int64(att_bf16.ctypes.data if bf16 else att.ctypes.data)
        step = (q_rot, k_rot, v, out)
        dims = (heads, kv_heads, dim, slots, heads * dim, kv_heads * dim, kv_len, lanes, order)
        if attn_par:
            DECODE_ATTENTION(step, kc, vc, dims, rows, pos, ring, window, scale)
        else:
            DECODE_ATTENTION_SERIAL(step, kc, vc, dims, rows, pos, ring, window, scale)
        if o_q8 and o_par:
            dense_q8_parallel(
                o_kernel, o_w, o_row_bytes, heads * dim, hidden, att, att_bf16, tokens, o_bias,
                y, y_bf16, o_items,
            )  # fmt: skip
        elif o_q8:
            dense_q8_serial(
                o_kernel, o_w, o_row_bytes, heads * dim, hidden, att, att_bf16, tokens, o_bias,
                y, y_bf16, o_items,
            )  # fmt: skip
        elif o_par:
            dense_parallel(
                o_kernel, o_w, o_row_bytes, heads * dim, hidden, att, att_bf16, tokens, o_bias,
                y, y_bf16, o_items,
            )  # fmt: skip
        else:
            dense_serial(
                o_kernel, o_w, o_row_bytes, heads * dim, hidden, att, att_bf16, tokens, o_bias,
                y, y_bf16, o_items,
            )  # fmt: skip
        if post:  # the residual add of the attention's output and the post-attention norm
            out = np.int64(y_bf16.ctypes.data if bf16 else y.ctypes.data)
            norm_rows(summed, out, post_scale, after, post_normed, tokens, hidden, eps, post_flags)
            if routes:
                routed = dense_route(
                    gate_kernel, route_w, route[0], hidden, route[1], normed, normed_bf16, tokens,
                    route_bias, logits, logits_bf16, route[2], route[4], route[5], route[6],
                    route[3], route[7], lanes, computes_experts, route[8],
                )  # fmt: skip
                if not routed:
                    return TIE
                if computes_experts:  # the MoE layer's experts, as cpu_experts.fused_cpu_moe
                    if bf16:  # calls them: float32 inputs, widened exactly
                        widen_bf16(post_normed, moe_x, tokens * hidden)
                    if moe_w_bf16.shape[0]:
                        widen_bf16(np.int64(moe_w_bf16.ctypes.data), moe_w, moe_w.shape[0])
                    gate, up, expert_rows, down, _, inter, num_experts = bank
                    act_bf16, act, gate_up_bias, down_bias = moe
                    moe_y[:] = 0.0  # here, not by the caller: ~7 µs of its cold-cache fill
                    if q8:
                        return moe_q8_parallel(
                            gate_up_kernel, down_kernel, moe_x, moe_ids, moe_w, gate, up,
                            expert_rows, down, hidden, inter, num_experts, route[3], act_bf16,
                            act, gate_up_bias, down_bias, moe_y,
                        )  # fmt: skip
                    return moe_parallel(
                        gate_up_kernel, down_kernel, moe_x, moe_ids, moe_w, gate, up, expert_rows,
                        down, hidden, inter, num_experts, route[3], act_bf16, act, gate_up_bias,
                        down_bias, moe_y,
                    )  # fmt: skip
        return DONE

    name = "attention_block_" + "_".join(
        ("q8_" if quant else "") + kernel.name
        for kernel, quant in zip((qkv_kernel, o_kernel), (qkv_q8, o_q8), strict=True)
    )
    if routes:
        name += f"_route_{route_kernel.name}"
    if has_v:
        name += f"_v_{'q8_' if v_q8 else ''}{v_kernel.name}"
    if computes_experts:
        name += f"_experts_{'q8_' if q8 else ''}{gate_up_kernel.name}_{down_kernel.name}"
    attention_block.__name__ = attention_block.__qualname__ = name  # own cache files
    # no fastmath: the block's own work is addresses and copies; its kernels keep their flags
    return cached_njit(nogil=True)(attention_block)


def head_kernel(fmt: str, q8: bool) -> Dispatcher:
    """The head block's entry for an output head in format `fmt` (a name; `q8`: numba_dense_q8's
    kernel, q8 activations), made on first use."""
    kernel = WEIGHT_FORMATS[fmt].kernel
    return _BLOCKS.get(("head", fmt, q8), lambda: _head_entry(kernel, q8))


def _head_entry(kernel, q8: bool):
    """A decode step's end for a head weight in KernelFormat `kernel`: numba_glue.norm_rows of
    the stream plus the last layer's output (layers/norm.add_rms_norm's kernel), then the head
    over the normed rows (numba_dense's or, with `q8`, numba_dense_q8's kernel, as DenseCall
    calls it), then bfloat16 logits widened to float32 (`.float()`). Arguments:
    norm: (stream, delta, scale, sum addresses, eps, norm_rows' flags),
    x, x_bf16: the normed rows [tokens * hidden] (float32, or bfloat16 bits; the other empty),
    w, bias: the head's bytes and float32 bias (empty: none),
    sizes: (row bytes, hidden, vocabulary, work-item rows, tokens, bfloat16), parallel: the
    head's parallel kernel (else the calling thread's),
    y, y_bf16: the head's output [tokens * vocabulary] (float32: the logits; bfloat16 bits,
    the other empty), logits: float32 [tokens * vocabulary], written (y itself in float32)."""

    def head_block(norm, x, x_bf16, w, bias, sizes, parallel, y, y_bf16, logits):
        stream, delta, scale, summed, eps, flags = norm
        row_bytes, hidden, vocab, items, tokens, bf16 = sizes
        normed = np.int64(x_bf16.ctypes.data if bf16 else x.ctypes.data)
        norm_rows(stream, delta, scale, summed, normed, tokens, hidden, eps, flags)
        if q8 and parallel:
            dense_q8_parallel(
                kernel, w, row_bytes, hidden, vocab, x, x_bf16, tokens, bias, y, y_bf16, items
            )
        elif q8:
            dense_q8_serial(
                kernel, w, row_bytes, hidden, vocab, x, x_bf16, tokens, bias, y, y_bf16, items
            )
        elif parallel:
            dense_parallel(
                kernel, w, row_bytes, hidden, vocab, x, x_bf16, tokens, bias, y, y_bf16, items
            )
        else:
            dense_serial(
                kernel, w, row_bytes, hidden, vocab, x, x_bf16, tokens, bias, y, y_bf16, items
            )
        if bf16:
            widen_bf16(np.int64(y_bf16.ctypes.data), logits, tokens * vocab)
        return DONE

    name = f"head_block_{'q8_' if q8 else ''}{kernel.name}"
    head_block.__name__ = head_block.__qualname__ = name  # own cache files
    return cached_njit(nogil=True)(head_block)
