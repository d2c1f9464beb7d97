"""Weights in any registered format from seeded random bytes, for tests and benchmarks: for the
formats without a quantiser (the k-quants) the only way to make their weights without a GGUF
file from elsewhere, and for the others every bit pattern of the payload rather than what a
quantiser writes. Any bytes with finite scales are valid weights; the scales are set so the
weights stay small."""

from __future__ import annotations

import torch

from hybridmoe.quant.formats import WeightFormat


def random_stored(
    fmt: WeightFormat, shape: tuple[int, ...], gen: torch.Generator, max_abs: float = 0.3
) -> torch.Tensor:
    """A weight of `shape` [..., n] stored in `fmt`: dense formats hold randn * max_abs / 3;
    block formats random payload bytes, their scales (fmt.scale_offsets) drawn so that the
    largest |weight| is about max_abs, each with a random sign (where the scale has one) and
    size in [0.5, 1] (mxfp4's power-of-two exponents round that up: up to 2 max_abs).
    k-quants at max_abs 0.08: std about 0.02, a random checkpoint's init."""
    if not fmt.is_quantized:
        return (torch.randn(shape, generator=gen) * (max_abs / 3)).to(fmt.storage_dtype)
    stored = torch.randint(0, 256, fmt.stored_shape(shape), dtype=torch.uint8, generator=gen)
    blocks = stored.view(-1, fmt.block_bytes)  # [B, block_bytes]
    width = fmt.scale_dtype.itemsize  # fp16 scales, or mxfp4's E8M0 exponent byte
    scale_bytes = [slice(at, at + width) for at in fmt.scale_offsets]
    for where in scale_bytes:  # unit scales first, to measure the payload's largest weight
        blocks[:, where] = torch.tensor([1.0]).to(fmt.scale_dtype).view(torch.uint8)
    unit_max = float(fmt.dequantize(blocks).abs().max())
    for where in scale_bytes:
        sign = torch.randint(0, 2, (blocks.shape[0], 1), generator=gen) * 2 - 1
        size = torch.rand(blocks.shape[0], 1, generator=gen) * 0.5 + 0.5
        scale = size * max_abs / unit_max * (sign if fmt.scale_dtype.is_signed else 1)
        blocks[:, where] = scale.to(fmt.scale_dtype).view(torch.uint8)
    return stored
