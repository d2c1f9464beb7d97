"""A decode step's end on the host in one numba call: the final RMSNorm with its residual add
(the stream plus the last layer's output) and the output head, float32 logits out
(numba_attention_block.head_kernel). MoeCausalLM.forward computes the same with
layers/norm.add_rms_norm, the head's DenseProjection and `.float()`: three calls, their
wrappers and ~7 aten ops, ~250 µs of a decode step's host time on its cold caches (the head's
kernel not counted; benchmarks/bench_decode_overhead.py), for one call here. The same kernels
in the same order with the same arguments: the same bits (tests/layers/test_attention_block.py
compares every decode step's logits with the parts')."""

from __future__ import annotations

import numpy as np
import torch

from hybridmoe import env
from hybridmoe.kernels import glue, numba_moe
from hybridmoe.kernels.projection import DenseProjection
from hybridmoe.kernels.threads import kernel_threads

_DTYPES = {torch.bfloat16: np.uint16, torch.float32: np.float32}
_NO_F32 = np.empty(0, np.float32)
_NO_BF16 = np.empty(0, np.uint16)
# the plans a model keeps (decode_head), one per batch size and dtype: a server's batch sizes
# come and go, as the attention block's plans do
MAX_PLANS = 3


def decode_head(
    x: torch.Tensor,
    delta: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    head: DenseProjection,
    plans: dict,
) -> torch.Tensor | None:
    """head(rms_norm(x + delta)).float(), float32 logits [B, V], for a decode step's stream x
    [B, 1, H] and its last layer's output delta (x's dtype, or float32: rounded to x's dtype
    first), the RMSNorm's `scale` and `eps`: what add_rms_norm, the head and `.float()` give,
    in one kernel call. None where those would not all take their kernels (then the caller
    runs them: the same bits), or where a switch of hybridmoe/env.py turns the blocks off.
    `plans`: the caller's dict, where a batch size's arrays are kept for its next steps."""
    if not (env.attention_block() and env.glue_kernels()):
        return None
    if x.dim() != 3 or x.shape[1] != 1 or delta.shape != x.shape:
        return None
    if not (x.is_cpu and x.is_contiguous() and delta.is_cpu and delta.is_contiguous()):
        return None
    key = (x.dtype, x.shape[0], delta.dtype, kernel_threads())
    plan = plans.get(key)
    if plan is None or not plan.holds(scale, head):
        if not _fits(x, delta, scale, head):
            return None
        if len(plans) >= MAX_PLANS:
            del plans[next(iter(plans))]
        plan = plans[key] = _HeadPlan(x, delta, scale, head)
    B, vocab = x.shape[0], head.out_features
    logits = np.empty((B, vocab), np.float32)  # the caller's own: a fresh array every step
    flat = logits.reshape(-1)
    y = flat if plan.y_bf16 is _NO_BF16 else _NO_F32  # float32: the head writes the logits
    norm = (x.data_ptr(), delta.data_ptr(), plan.scale_at, plan.summed_at, float(eps), plan.flags)
    numba_moe.launch(
        plan.kernel, plan.threads, norm, plan.x, plan.x_bf16, plan.call.weight, plan.call.bias,
        plan.sizes, plan.parallel, y, plan.y_bf16, flat,
    )  # fmt: skip
    return torch.from_numpy(logits)


def _fits(x: torch.Tensor, delta: torch.Tensor, scale: torch.Tensor, head: DenseProjection) -> bool:
    """Whether add_rms_norm(x, delta, scale) takes glue.norm's kernel and the head its CPU
    kernel for the normed rows."""
    if x.dtype not in _DTYPES or delta.dtype not in (x.dtype, torch.float32):
        return False
    if scale.dtype is not x.dtype or head.in_features != x.shape[-1]:
        return False
    return glue.norm_fits(x, scale, delta) and head.uses_kernel(x)


class _HeadPlan:
    """decode_head's arrays and arguments for one key (dtype, rows, delta's dtype, threads):
    the normed rows, the stream + delta sum norm_rows writes, bfloat16's head output; the
    head's kernel call (DenseCall) and scale it was made of (holds)."""

    __slots__ = (
        "call", "scale", "scale_at", "summed", "summed_at", "flags", "x", "x_bf16", "y_bf16",
        "sizes", "parallel", "threads", "kernel",
    )  # fmt: skip

    def __init__(
        self, x: torch.Tensor, delta: torch.Tensor, scale: torch.Tensor, head: DenseProjection
    ):
        from hybridmoe.kernels.numba_attention_block import head_kernel

        B, _, hidden = x.shape
        bf16, np_dtype = x.dtype is torch.bfloat16, _DTYPES[x.dtype]
        self.call, self.scale, self.scale_at = head.host_call(), scale, scale.data_ptr()
        self.summed = np.empty(B * hidden, np_dtype)  # the sum, not read after the step
        self.summed_at = self.summed.ctypes.data
        self.flags = glue.norm_flags(x.dtype, scale.dtype, bf16, delta.dtype)
        normed = np.empty(B * hidden, np_dtype)
        self.x, self.x_bf16 = (_NO_F32, normed) if bf16 else (normed, _NO_BF16)
        self.y_bf16 = np.empty(B * head.out_features, np.uint16) if bf16 else _NO_BF16
        self.threads = numba_moe.pool_threads()
        self.parallel = self.call.threads(self.threads) > 1
        self.sizes = (
            self.call.row_bytes,
            hidden,
            head.out_features,
            self.call.rows_per_item,
            B,
            bf16,
        )
        self.kernel = head_kernel(self.call.fmt.name, self.call.q8)

    def holds(self, scale: torch.Tensor, head: DenseProjection) -> bool:
        """Whether it was made of this scale and the head's kernel call as kept (a weight's
        change drops it: DenseProjection.prepared_call)."""
        return scale is self.scale and head.prepared_call is self.call
