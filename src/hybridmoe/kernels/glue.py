"""The torch side of the numba glue kernels (kernels/numba_glue.py): a decode step's small host
ops (RMSNorm and the residual add before it, the per-head q/k norms with rotary, the router's
softmax and top-k) in one call each, the same bits as their torch references (layers/norm.py,
layers/attention.py, moe/routing.py, which call these first and fall back to torch on None).

Each function returns None, computing nothing, unless every tensor is contiguous host memory
in bfloat16 or float32 and x is decode-sized (at most MAX_NUMEL values, rows of at most
MAX_ROW), and the kernels are not switched off (HYBRIDMOE_GLUE_KERNELS=0). numba loads on the
first call that computes. `norm_rotary` takes a larger q and k too, a prefill's: its tokens
split over numba's threads (tokens are independent, so the same bits), where torch's joint
path runs ~8 ops over the whole [B, T, heads, D] (384 tokens of 36 heads of 128, 2 threads, the
AMD EPYC: 1.7-2.4 ms against torch's 2.4-11.6). A prefill's norms stay with torch, which ran
them as fast (0.34 ms for [384, 2048] with the residual add, a parallel norm_rows 0.37).
"""

from __future__ import annotations

import functools
import platform

import numpy as np
import torch

from hybridmoe import env

MAX_NUMEL = 1 << 16  # larger tensors (prefill) stay with torch's threaded kernels, but:
# norm_rotary's larger q and k, their tokens split into this many runs a thread (a thread the
# OS preempts delays the call by one run, not by half of it)
PIECES_PER_THREAD = 4
MAX_ROW = 16384  # a row of over 32768 values torch's threads may split (numba_glue.MAX_SUM_N)
_BF16, _F32 = torch.bfloat16, torch.float32
_DTYPES = (_BF16, _F32)
_kernels = None  # kernels/numba_glue once imported
_templates: dict[tuple[torch.Size | tuple[int, ...], torch.dtype], torch.Tensor] = {}
MAX_TEMPLATES = 256  # decode shapes: a few per model and batch size


def _host(t: torch.Tensor) -> bool:
    return t.is_cpu and t.dtype in _DTYPES and t.is_contiguous()


def _decode_sized(x: torch.Tensor) -> bool:
    """Host memory the kernels read, of at most MAX_NUMEL values in rows of at most MAX_ROW."""
    ok = x.is_cpu and x.dtype in _DTYPES and x.is_contiguous()
    return ok and 0 < x.numel() <= MAX_NUMEL and x.shape[-1] <= MAX_ROW


def empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype), as empty_like of a kept tensor of that shape and dtype
    (torch parses a dtype keyword slower than a small op runs). Past MAX_TEMPLATES shapes the
    kept ones are dropped and the shapes in use kept again: a process that met many shapes
    (a server's batch sizes over a day, a test session) still gets one op a call."""
    template = _templates.get((shape, dtype))
    if template is None:
        template = torch.empty(shape, dtype=dtype)
        if len(_templates) >= MAX_TEMPLATES:
            _templates.clear()
        _templates[(shape, dtype)] = template
    return torch.empty_like(template)


def _numba_glue():
    global _kernels
    if _kernels is None:
        from hybridmoe.kernels import numba_glue

        _kernels = numba_glue
    return _kernels


def float32_array(t: torch.Tensor) -> np.ndarray | None:
    """A new flat float32 numpy array of a contiguous host bfloat16 tensor's values (widened
    exactly: torch's `.float()`), in one numba call and no aten op; None for any other tensor,
    one of over MAX_NUMEL values (torch's threaded copy) or with the kernels switched off."""
    n = t.numel()
    if not (t.dtype is _BF16 and t.is_cpu and t.is_contiguous() and n <= MAX_NUMEL):
        return None
    if not env.glue_kernels():
        return None
    out = np.empty(n, np.float32)
    if n:
        _numba_glue().widen_bf16(t.data_ptr(), out, n)
    return out


def norm(
    x: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    scale_rounded: bool,
    y: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(s, norm(s)) for s = x (+ y): x [..., N], y of x's shape and dtype (or float32: rounded
    to x's dtype first), scale [N]; both results in x's dtype (numba_glue.norm_rows;
    `scale_rounded`: x * rsqrt is rounded to bfloat16 before scale multiplies). None: see
    the module's docstring."""
    if not norm_fits(x, scale, y):
        return None
    n, k = x.shape[-1], _numba_glue()
    flags = norm_flags(x.dtype, scale.dtype, scale_rounded, None if y is None else y.dtype)
    out, x_at = torch.empty_like(x), x.data_ptr()
    if y is None:
        total, y_at = x, x_at
    else:
        total, y_at = torch.empty_like(x), y.data_ptr()
    rows = x.numel() // n
    k.norm_rows(x_at, y_at, scale.data_ptr(), total.data_ptr(), out.data_ptr(), rows, n, eps, flags)
    return total, out


def norm_fits(x: torch.Tensor, scale: torch.Tensor, y: torch.Tensor | None = None) -> bool:
    """Whether norm(x, scale, ..., y) computes (else it returns None)."""
    if not (_decode_sized(x) and _host(scale) and scale.shape == x.shape[-1:]):
        return False
    if y is not None and not (_host(y) and y.shape == x.shape):
        return False
    return env.glue_kernels()


def norm_flags(
    x_dtype: torch.dtype,
    scale_dtype: torch.dtype,
    scale_rounded: bool,
    y_dtype: torch.dtype | None = None,
) -> int:
    """numba_glue.norm_rows' flags for x, scale and (with the residual add) y of these
    dtypes, as norm() calls it."""
    k = _numba_glue()
    flags = (x_dtype is _BF16) * k.X_BF16 + (scale_dtype is _BF16) * k.SCALE_BF16
    flags += scale_rounded * k.SCALE_ROUNDED
    if y_dtype is not None:
        flags += k.ADD + (y_dtype is _BF16) * k.Y_BF16
    return flags


def _token_stride(shape: torch.Size, strides: tuple[int, ...]) -> int | None:
    """The stride in values between consecutive tokens of a [B, T, heads, D] tensor of these
    strides viewed as [B * T, heads * D] rows (heads * D contiguous per token), or None."""
    B, T, heads, D = shape
    if strides[3] != 1 or (heads > 1 and strides[2] != D):
        return None
    if B > 1 and T > 1 and strides[0] != T * strides[1]:
        return None
    return strides[1] if T > 1 else strides[0]


def _qk_strides(q, k, scales, cos, sin) -> tuple[int, int] | None:
    """(q's token stride, k's) when norm_rotary's kernel takes these tensors, else None."""
    dtype, q_shape, k_shape = q.dtype, q.shape, k.shape
    if len(q_shape) != 4 or len(k_shape) != 4:
        return None
    B, T, heads, D = q_shape
    if D % 2 or k_shape[3] != D:
        return None
    if k_shape[0] != B or k_shape[1] != T or cos.shape != (B, T, D) or sin.shape != cos.shape:
        return None
    for t in (q, k, cos, sin, *scales):  # a loop, not all(...): no generator calls
        if t.dtype is not dtype or not t.is_cpu:
            return None
    for t in (cos, sin, *scales):
        if not t.is_contiguous():
            return None
    for t in scales:
        if t.shape != (D,):
            return None
    q_stride, k_stride = _token_stride(q_shape, q.stride()), _token_stride(k_shape, k.stride())
    return None if q_stride is None or k_stride is None else (q_stride, k_stride)


def norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_scale: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q, k) per-head RMSNorm'd (q_scale, k_scale [D]) then rotated by cos/sin [B, T, D]
    (every dim rotating), as layers/qkv.norm_rotary_qk_reference computes them, for q [B, T,
    heads, D] and k [B, T, kv_heads, D]; scales None: rotated only, as rotary.apply_rotary
    does. Views of a projection's output will do (each token's heads contiguous); the
    results are contiguous (numba_glue.norm_rotary_rows). None: see the module's docstring;
    also for float16 or a partial rotary."""
    dtype = q.dtype
    if (dtype is not _BF16 and dtype is not _F32) or not env.glue_kernels():
        return None
    scales = () if q_scale is None else (q_scale, k_scale)
    strides = _qk_strides(q, k, scales, cos, sin)
    if strides is None:
        return None
    (B, T, heads, D), kv_heads = q.shape, k.shape[2]
    q_out, k_out = empty(q.shape, dtype), empty(k.shape, dtype)
    args = (
        q.data_ptr(), k.data_ptr(), *strides, heads, kv_heads, D,
        *((q_scale.data_ptr(), k_scale.data_ptr()) if scales else (0, 0)),
        cos.data_ptr(), sin.data_ptr(),
        q_out.data_ptr(), k_out.data_ptr(), B * T, eps, dtype is _BF16,
    )  # fmt: skip
    if B * T * (heads + kv_heads) * D <= MAX_NUMEL:
        _numba_glue().norm_rotary_rows(*args)
        return q_out, k_out
    from hybridmoe.kernels import numba_moe

    threads = numba_moe.pool_threads()
    pieces = min(B * T, threads * PIECES_PER_THREAD)
    numba_moe.launch(_numba_glue().norm_rotary_rows_parallel, threads, *args, pieces)
    return q_out, k_out


@functools.cache
def softmax_lanes() -> int | None:
    """The float32 lanes of torch's vectorised softmax on this machine (its CPU capability:
    AVX512 16, AVX2 8), which numba_glue.softmax_topk_route reproduces; None for any other
    build (the default or an ARM one: torch's softmax then stays)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability())


def softmax_route(
    logits: torch.Tensor, top_k: int, renorm: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """route_topk(F.softmax(logits, -1, dtype=float32), ...)'s (ids, weights) for router
    logits [T, E] (bfloat16 or float32) in one call, torch's softmax reproduced for this
    machine's build (softmax_lanes). None where route_topk would give None (a tie torch.topk
    breaks otherwise: numba_glue._reproduced), where a logit is not finite, on a build whose
    softmax is not reproduced, or see the module's docstring: the caller's torch path decides
    (the probabilities are not kept, saving every call an allocation)."""
    lanes = softmax_lanes()
    if lanes is None or not (_decode_sized(logits) and logits.dim() == 2):
        return None
    T, E = logits.shape
    if not (0 < top_k <= E and (dtype is _BF16 or dtype is _F32) and env.glue_kernels()):
        return None
    ids, weights = empty((T, top_k), torch.int64), empty((T, top_k), dtype)
    ok = _numba_glue().softmax_topk_route(
        logits.data_ptr(),
        logits.dtype is _BF16,
        ids.data_ptr(),
        weights.data_ptr(),
        dtype is _BF16,
        T,
        E,
        top_k,
        renorm,
        lanes,
    )
    return (ids, weights) if ok else None


def route_topk(
    probs: torch.Tensor, top_k: int, renorm: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids [T, K] int64, weights [T, K] in dtype) of float32 probs [T, E]: the top-k, divided
    by their sum where `renorm`, then rounded to dtype (bfloat16 or float32), as
    moe/routing.route_torch computes them, torch.topk's pick among equal values included. None
    where a row has NaNs, or ties among its k + 1 largest that torch.topk breaks otherwise
    (numba_glue._reproduced false: k * 64 <= E, k > 17, or off Linux), or see the module's
    docstring: torch then decides."""
    if not (_decode_sized(probs) and probs.dtype is _F32 and probs.dim() == 2):
        return None
    T, E = probs.shape
    if not (0 < top_k <= E and (dtype is _BF16 or dtype is _F32) and env.glue_kernels()):
        return None
    ids, weights = empty((T, top_k), torch.int64), empty((T, top_k), dtype)
    bf16 = dtype is _BF16
    ok = _numba_glue().topk_route(
        probs.data_ptr(), ids.data_ptr(), weights.data_ptr(), bf16, T, E, top_k, renorm
    )
    return (ids, weights) if ok else None
