"""RMSNorm, computed in float32 like the reference implementations.

Each norm has its torch reference (`*_torch`, kept for accelerator tensors and as the oracle)
and, for small contiguous host tensors (a decode step's), one numba call that computes the
same bits (kernels/numba_glue.py: torch's float32 sum order, its roundings). `add_*` fuse the
residual add before a norm: `s = x + y; norm(s)` in one call, returning both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridmoe.kernels import glue


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> [..., N] in x's dtype; normalisation in float32, scale in x's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_torch's values; one numba call for a small host x whose weight has its dtype."""
    fast = glue.norm(x, weight, eps, x.dtype == torch.bfloat16) if weight.dtype == x.dtype else None
    return rms_norm_torch(x, weight, eps) if fast is None else fast[1]


def add_rms_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) for s = x + y, the residual add fused with the norm; y of x's dtype,
    or float32, rounded to x's dtype first (an MoE layer's partial: OffloadMoELayer)."""
    if weight.dtype == x.dtype and y.dtype in (x.dtype, torch.float32):
        fast = glue.norm(x, weight, eps, x.dtype == torch.bfloat16, y)
        if fast is not None:
            return fast
    s = x + y.to(x.dtype)
    return s, rms_norm_torch(s, weight, eps)


def offset_weight(weight: torch.Tensor) -> torch.Tensor:
    """The float32 scale 1 + w of a zero-centred RMSNorm weight (Qwen3-Next, Qwen3.5)."""
    return 1.0 + weight.float()


def offset_rms_norm_torch(x: torch.Tensor, scale_fp32: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm with `scale_fp32` = offset_weight(w): x [..., N] -> [..., N] in x's
    dtype; normalisation and scale in float32, one rounding at the end (as transformers'
    Qwen3NextRMSNorm: `(norm(x.float()) * (1 + w.float())).type_as(x)`)."""
    return F.rms_norm(x.float(), (x.shape[-1],), scale_fp32, eps).to(x.dtype)


def offset_rms_norm(x: torch.Tensor, scale_fp32: torch.Tensor, eps: float) -> torch.Tensor:
    """offset_rms_norm_torch's values; one numba call for a small host x."""
    fast = glue.norm(x, scale_fp32, eps, False) if scale_fp32.dtype == torch.float32 else None
    return offset_rms_norm_torch(x, scale_fp32, eps) if fast is None else fast[1]


def add_offset_rms_norm(
    x: torch.Tensor, y: torch.Tensor, scale_fp32: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, offset_rms_norm(s)) for s = x + y, fused; y of x's dtype or float32 (rounded to
    x's dtype first, as add_rms_norm)."""
    if y.dtype in (x.dtype, torch.float32) and scale_fp32.dtype == torch.float32:
        fast = glue.norm(x, scale_fp32, eps, False, y)
        if fast is not None:
            return fast
    s = x + y.to(x.dtype)
    return s, offset_rms_norm_torch(s, scale_fp32, eps)


def gated_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float
) -> torch.Tensor:
    """Gated DeltaNet's output norm: weight * norm(x) * silu(gate), x, gate [..., N] -> [..., N]
    in x's dtype. The normalised x is rounded to x's dtype before the weight (transformers'
    Qwen3NextRMSNormGated), the gate multiplies in float32."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return ((weight * normed) * F.silu(gate.float())).to(x.dtype)


@dataclass(frozen=True)
class NormKind:
    """How a family's RMSNorm weights are kept (`prepare`, once at load) and applied; `add_apply`
    is `s = x + y; (s, apply(s, kept, eps))` in one step."""

    prepare: Callable[[torch.Tensor], torch.Tensor]
    apply: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, kept, eps)
    add_apply: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]  # (x, y, kept, eps) -> (x + y, normed)


# kind -> NormKind; a family names its kind (models/registry.ModelFamily.norm)
NORMS: dict[str, NormKind] = {
    "rms": NormKind(lambda weight: weight, rms_norm, add_rms_norm),
    # zero-centred: scale 1 + w
    "offset_rms": NormKind(offset_weight, offset_rms_norm, add_offset_rms_norm),
}
