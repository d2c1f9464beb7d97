"""RMSNorm, computed in float32 like the reference implementations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> [..., N] in x's dtype; normalisation in float32, scale in x's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)
