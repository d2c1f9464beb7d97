"""Plumbing shared by ggml's k-quants (q2_k ... q6_k): super-blocks of 256 weights (QK_K) that
hold 8 or 16 sub-blocks, each with its own scale (and for q2_k, q4_k, q5_k its own minimum)
packed in a few bits and multiplied by the super-block's fp16 d (and dmin).

They have no quantiser here (ggml's searches scales iteratively; gguf's numpy package does not
port it): a k-quant bank comes from a GGUF file's bytes, and any bytes whose fp16 d and dmin
are finite are valid weights. The torch dequantisers follow gguf.quants (and so ggml's
`dequantize_row_q*_K`) operation by operation, so they are bit-exact even for non-finite scales;
the kernel reads each super-block as 8 pieces of 32 weights (KernelFormat.pieces).
"""

from __future__ import annotations

from functools import cache, partial

import torch

from hybridmoe.quant._blocks import SUPER_BLOCK_SIZE, DequantizeChunk, dequantize_blocks
from hybridmoe.quant.formats import (
    KERNEL_BLOCK,
    DequantizeSuperBlockIR,
    KernelFormat,
    WeightFormat,
    register_format,
)

PIECES = SUPER_BLOCK_SIZE // KERNEL_BLOCK  # 8 pieces of 32 weights a super-block


def _dequantize(
    q: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    name: str,
    block_bytes: int,
    chunk: DequantizeChunk,
) -> torch.Tensor:
    return dequantize_blocks(q, name, block_bytes, chunk, dtype, SUPER_BLOCK_SIZE)


def register_k_quant(
    name: str,
    block_bytes: int,
    chunk: DequantizeChunk,
    superblock_ir: DequantizeSuperBlockIR,
    scale_offsets: tuple[int, ...],
) -> WeightFormat:
    """Registers the k-quant `name`: blocks [b, block_bytes] uint8 -> chunk -> weights
    [b, 256] fp32; `superblock_ir` is its kernel's DequantizeSuperBlockIR; its fp16 d (and
    dmin) at `scale_offsets`."""
    dequantize = partial(_dequantize, name=name, block_bytes=block_bytes, chunk=chunk)
    kernel = KernelFormat(name, block_bytes, superblock_ir, pieces=PIECES)
    stored = (SUPER_BLOCK_SIZE, block_bytes, torch.uint8)
    fmt = WeightFormat(name, *stored, None, dequantize, kernel, scale_offsets)
    return register_format(fmt)


def fp16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of blocks [b, block_bytes] uint8, as fp32 [b, 1, 1]."""
    raw = blocks[:, offset : offset + 2].contiguous()
    return raw.view(torch.float16).to(torch.float32)[:, :, None]


def shifted(packed: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """(packed [b, g, n] >> s) & mask for each s of shifts -> [b, g, len(shifts), n] uint8."""
    by = _shift_amounts(tuple(shifts), packed.device)  # [1, 1, len(shifts), 1]
    return (packed[:, :, None, :] >> by) & mask


@cache
def _shift_amounts(shifts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The shifts as a uint8 tensor on `device`, made once: a decode step on an accelerator
    copies nothing from the host for them (and a captured graph sees no new tensor)."""
    return torch.tensor(shifts, dtype=torch.uint8, device=device)[None, None, :, None]
