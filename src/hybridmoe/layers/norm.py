"""RMSNorm, computed in float32 like the reference implementations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> [..., N] in x's dtype; normalisation in float32, scale in x's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def offset_weight(weight: torch.Tensor) -> torch.Tensor:
    """The float32 scale 1 + w of a zero-centred RMSNorm weight (Qwen3-Next, Qwen3.5)."""
    return 1.0 + weight.float()


def offset_rms_norm(x: torch.Tensor, scale_fp32: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm with `scale_fp32` = offset_weight(w): x [..., N] -> [..., N] in x's
    dtype; normalisation and scale in float32, one rounding at the end (as transformers'
    Qwen3NextRMSNorm: `(norm(x.float()) * (1 + w.float())).type_as(x)`)."""
    return F.rms_norm(x.float(), (x.shape[-1],), scale_fp32, eps).to(x.dtype)


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
    """How a family's RMSNorm weights are kept (`prepare`, once at load) and applied."""

    prepare: Callable[[torch.Tensor], torch.Tensor]
    apply: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, kept, eps)


# kind -> NormKind; a family names its kind (models/registry.ModelFamily.norm)
NORMS: dict[str, NormKind] = {
    "rms": NormKind(lambda weight: weight, rms_norm),
    "offset_rms": NormKind(offset_weight, offset_rms_norm),  # zero-centred: scale 1 + w
}
