"""The torch dense projection: the reference of kernels/numba_dense.py (and, with q8
activations, of kernels/numba_dense_q8.py), and what computes a dense projection off the CPU or
for long prefills on float activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe.quant.formats import WeightFormat

# weight rows and tokens per q8_linear call of dense_linear_torch's q8 path: its integer views
# and products are float32 tensors of rows x tokens x sub-blocks (~32 MB a chunk here)
Q8_CHUNK_ROWS, Q8_CHUNK_TOKENS = 4096, 16


def dense_linear_torch(
    x: torch.Tensor,
    stored: torch.Tensor,
    fmt: WeightFormat,
    bias: torch.Tensor | None = None,
    activation_quant: str = "none",
) -> torch.Tensor:
    """x [..., n] -> [..., out] in x's dtype: F.linear on the weight's exact values. A weight
    stored in x's dtype is used as stored (torch accumulates in float32 and rounds once, the
    bias added before); any other format is expanded to float32, computed in float32 (bias
    included) and rounded once to x's dtype: the values every device computes with.
    `activation_quant` "q8": each dot product by the q8 contract instead
    (activation_q8.q8_linear, in chunks of rows and tokens), then the bias, one rounding."""
    if activation_quant == "q8":
        return _q8_linear(x, stored, fmt, bias)
    if not fmt.is_quantized and fmt.storage_dtype == x.dtype:
        return F.linear(x, stored, bias)
    if stored.is_cpu:  # the kernels' dequantisers: the same values, in parallel
        from hybridmoe.kernels.numba_dequantize import float32_weights  # loads numba

        w_f32 = float32_weights(fmt, stored)  # [out, n], exact
    else:
        w_f32 = fmt.dequantize(stored, torch.float32)
    bias_f32 = None if bias is None else bias.to(torch.float32)
    return F.linear(x.to(torch.float32), w_f32, bias_f32).to(x.dtype)


def _q8_linear(
    x: torch.Tensor, stored: torch.Tensor, fmt: WeightFormat, bias: torch.Tensor | None
) -> torch.Tensor:
    from hybridmoe.quant.activation_q8 import q8_linear

    n, rows = x.shape[-1], stored.shape[0]
    flat = x.reshape(-1, n).to(torch.float32)
    y = torch.empty(flat.shape[0], rows, dtype=torch.float32, device=x.device)
    for r in range(0, rows, Q8_CHUNK_ROWS):
        part = stored[r : r + Q8_CHUNK_ROWS]
        for t in range(0, flat.shape[0], Q8_CHUNK_TOKENS):
            y[t : t + Q8_CHUNK_TOKENS, r : r + Q8_CHUNK_ROWS] = q8_linear(
                flat[t : t + Q8_CHUNK_TOKENS], part, fmt
            )
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).view(*x.shape[:-1], rows)
