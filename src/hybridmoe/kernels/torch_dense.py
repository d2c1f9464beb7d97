"""The torch dense projection: the reference of kernels/numba_dense.py, and what computes a
dense projection off the CPU or for long prefills."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe.quant.formats import WeightFormat


def dense_linear_torch(
    x: torch.Tensor, stored: torch.Tensor, fmt: WeightFormat, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., n] -> [..., out] in x's dtype: F.linear on the weight's exact values. A weight
    stored in x's dtype is used as stored (torch accumulates in float32 and rounds once, the
    bias added before); any other format is expanded to float32, computed in float32 (bias
    included) and rounded once to x's dtype: the values every device computes with."""
    if not fmt.is_quantized and fmt.storage_dtype == x.dtype:
        return F.linear(x, stored, bias)
    if stored.is_cpu:  # the kernels' dequantisers: the same values, in parallel
        from hybridmoe.kernels.numba_dequantize import float32_weights  # loads numba

        w_f32 = float32_weights(fmt, stored)  # [out, n], exact
    else:
        w_f32 = fmt.dequantize(stored, torch.float32)
    bias_f32 = None if bias is None else bias.to(torch.float32)
    return F.linear(x.to(torch.float32), w_f32, bias_f32).to(x.dtype)
