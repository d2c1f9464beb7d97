"""DenseProjection: one dense weight (+ bias) stored in a weight format, x -> x W^T + b.

On the CPU a decode step's few tokens (at most DECODE_MAX_TOKENS) go through the numba kernel
(kernels/numba_dense.py), which reads each weight row once for all tokens; anything else (a
long prefill, an accelerator) through torch (kernels/torch_dense.py). Both follow one
contract (float32 sums of the exact weights, the bias in float32, one rounding), so which one
ran moves a value only where float32 summation order tips a rounding; and every decode target
of a CPU machine shares these projections. FusedProjection computes several projections of
one input (a layer's q, k and v) as one weight of concatenated rows: one call, one pass.
"""

from __future__ import annotations

import torch

from hybridmoe import env
from hybridmoe.kernels.torch_dense import dense_linear_torch
from hybridmoe.quant.formats import WeightFormat, dense_format

# tokens up to which the CPU kernel beats torch's GEMM (benchmarks/bench_dense.py)
DECODE_MAX_TOKENS = 16


class DenseProjection:
    """weight: the stored tensor in `fmt` ([out, in] for a dense format, [out, row bytes] of
    blocks for a block format); bias [out] in the activation dtype, or None."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        fmt: WeightFormat | None = None,
        in_features: int | None = None,
    ):
        self.weight, self.bias = weight, bias
        self.fmt = dense_format(weight.dtype) if fmt is None else fmt
        if in_features is None and self.fmt.is_quantized:
            raise ValueError(f"a {self.fmt.name} projection needs in_features")
        self.in_features = weight.shape[-1] if in_features is None else in_features
        self.out_features = weight.shape[0]
        self._host = None  # (weight bytes, float32 bias) for the CPU kernel, made on first use

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        tokens = x.numel() // max(1, x.shape[-1])
        on_cpu = x.device.type == "cpu" and self.weight.device.type == "cpu"
        if on_cpu and tokens <= DECODE_MAX_TOKENS and env.dense_kernel():
            return self._kernel(x)
        return dense_linear_torch(x, self.weight, self.fmt, self.bias)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        from hybridmoe.kernels import numba_dense  # numba loads on the first CPU decode

        if self._host is None:
            bias_f32 = None if self.bias is None else self.bias.float().contiguous().numpy()
            self._host = (numba_dense.weight_bytes(self.weight), bias_f32)
        w_bytes, bias_f32 = self._host
        return numba_dense.dense_linear(self.fmt, w_bytes, self.out_features, x, bias_f32)

    def quantize(self, fmt: WeightFormat) -> None:
        """Store the weight in `fmt` from now on (quantised by fmt.quantize from the stored
        values); the bias stays. ValueError (naming the shape) if a row is not whole blocks."""
        if self.fmt.is_quantized:
            raise ValueError(f"a {self.fmt.name} projection is quantised already")
        fmt.check_row_length(self.in_features, f"a {tuple(self.weight.shape)} projection")
        self.weight, self.fmt, self._host = fmt.quantize(self.weight), fmt, None

    def to(self, device: torch.device) -> None:
        self.weight = self.weight.to(device)
        self.bias = None if self.bias is None else self.bias.to(device)
        self._host = None

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]


class FusedProjection:
    """Projections of one input (a layer's q, k and v), one weight of their concatenated rows:
    a decode step makes one kernel call (one launch, one stream over the weights) instead of
    one each. On the CPU kernel each part's values are bit for bit its own DenseProjection's
    (a row's sum does not depend on the rows beside it); torch's GEMM (long prefills,
    accelerators) may sum a row in another order for the fused shape. The parts share a
    format, in_features and device, and all have a bias or none. The parts' weights (and
    biases) become views of the fused tensors, so nothing is held twice; build it after the
    parts are quantised and placed (a part quantised or moved later is no longer fused)."""

    def __init__(self, parts: list[DenseProjection]):
        first = parts[0]
        for part in parts:
            same = (part.fmt, part.in_features, part.weight.device)
            if same != (first.fmt, first.in_features, first.weight.device):
                raise ValueError(
                    f"fused projections need one format, in_features and device: "
                    f"{same} differs from {(first.fmt, first.in_features, first.weight.device)}"
                )
        if len({part.bias is None for part in parts}) > 1:
            raise ValueError("fused projections need a bias on every part or on none")
        weight = torch.cat([part.weight for part in parts])  # [sum out, ...] rows in order
        bias = None if first.bias is None else torch.cat([part.bias for part in parts])
        self.sizes = [part.out_features for part in parts]
        self.projection = DenseProjection(weight, bias, first.fmt, first.in_features)
        start = 0
        for part, size in zip(parts, self.sizes, strict=True):  # rows of the fused tensors
            part.weight = weight[start : start + size]
            part.bias = None if bias is None else bias[start : start + size]
            part._host, start = None, start + size

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., in] -> one [..., out_i] per part, views of one result, in x's dtype."""
        return self.projection(x).split(self.sizes, dim=-1)
