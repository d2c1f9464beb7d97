"""Plumbing shared by the GGUF block formats: argument checks, block views, chunked loops.

A block never crosses a row (a row of n weights holds n // 32 whole blocks, or n // 256
super-blocks for the k-quants), so a tensor [..., n] is handled as a flat list of blocks
[B, 32] (or [B, 256]) and its stored bytes as [B, block_bytes].
Work goes `CHUNK_BLOCKS` blocks at a time: the fp32 temporaries stay a few MiB whatever the
size of the tensor, and the peak memory of quantising is the input plus the output plus about
10 MiB (plus one copy of the input when it is not contiguous).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

BLOCK_SIZE = 32  # weights per block of q8_0, q4_0, q4_1, q5_0 and q5_1
SUPER_BLOCK_SIZE = 256  # weights per super-block of the k-quants (ggml's QK_K)
CHUNK_BLOCKS = 16384  # 512 Ki weights: 2 MiB per fp32 temporary, cache-friendly on 2 cores

# The fp16 scale is read and written through a native-order view of its two bytes; GGUF is
# little-endian, so on a big-endian host those views would silently swap them.
if sys.byteorder != "little":
    raise ImportError("hybridmoe.quant: GGUF block layouts need a little-endian host")

# x [b, 32] fp32 -> (scales [b, s] fp32, payload [b, block_bytes - 2 s] uint8): the block
# starts with its s fp16 scales (d, or d and m), then the payload
QuantizeChunk = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# blocks [b, block_bytes] uint8 -> weights [b, block_size] fp32
DequantizeChunk = Callable[[torch.Tensor], torch.Tensor]


def row_length_error(what: str, n: int, fmt: str, block_size: int) -> ValueError:
    return ValueError(
        f"{what}: row length {n} is not a multiple of the {fmt} block of {block_size} weights"
    )


def check_quantize_input(w: torch.Tensor, fmt: str) -> None:
    """TypeError unless w is a float tensor, ValueError unless its rows are whole blocks."""
    what = f"quantize_{fmt}"
    if not w.is_floating_point():
        raise TypeError(f"{what}: expects a float tensor, got {w.dtype}")
    n = w.shape[-1] if w.dim() else 0
    if w.dim() == 0 or n % BLOCK_SIZE:
        raise row_length_error(what, n, fmt, BLOCK_SIZE)


def quantize_blocks(
    w: torch.Tensor, fmt: str, block_bytes: int, quantize_chunk: QuantizeChunk
) -> torch.Tensor:
    """Quantises float w [..., n] to uint8 [..., n // 32 * block_bytes], chunk by chunk: the
    torch reference of a format's quantiser (any device)."""
    check_quantize_input(w, fmt)
    what, n = f"quantize_{fmt}", w.shape[-1]
    blocks = w.reshape(-1, BLOCK_SIZE)  # [B, 32], a view when w is contiguous
    out = torch.empty(blocks.shape[0], block_bytes, dtype=torch.uint8, device=w.device)
    for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
        x = blocks[start : start + CHUNK_BLOCKS].to(torch.float32)  # [b, 32]; never modified
        d, payload = quantize_chunk(x)  # [b, s], [b, block_bytes - 2 s]
        d16 = d.to(torch.float16)  # round to nearest even, as ggml's GGML_FP32_TO_FP16
        _check_scales(d, d16, start, n // BLOCK_SIZE, what)
        stop, scale_bytes = start + x.shape[0], 2 * d.shape[1]
        out[start:stop, :scale_bytes] = d16.view(torch.uint8)  # [b, 2 s], little-endian
        out[start:stop, scale_bytes:] = payload
    return out.reshape(*w.shape[:-1], n // BLOCK_SIZE * block_bytes)


def _check_scales(
    d: torch.Tensor, d16: torch.Tensor, start: int, blocks_per_row: int, what: str
) -> None:
    """Raises ValueError unless every scale d [b, s] is finite and so is its fp16 d16. A scale
    comes from max |x| (or the min) of its block, which is inf or nan when any weight of the
    block is."""
    for bad, reason in (
        (~d.isfinite(), "has a non-finite weight (inf or nan)"),
        (~d16.isfinite(), "has a block scale beyond the fp16 range (weights too large)"),
    ):
        if bad.any():
            block = start + int(bad.any(dim=1).nonzero()[0])
            raise ValueError(f"{what}: the input's row {block // blocks_per_row} {reason}")


def dequantize_blocks(
    q: torch.Tensor,
    fmt: str,
    block_bytes: int,
    dequantize_chunk: DequantizeChunk,
    dtype: torch.dtype,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """Dequantises uint8 q [..., nb * block_bytes] to dtype [..., nb * block_size], chunk by
    chunk (CHUNK_BLOCKS * 32 weights a chunk)."""
    what = f"dequantize_{fmt}"
    if q.dtype != torch.uint8:
        raise TypeError(f"{what}: expects uint8 blocks, got {q.dtype}")
    if not dtype.is_floating_point:
        raise TypeError(f"{what}: output dtype must be a float dtype, got {dtype}")
    row_bytes = q.shape[-1] if q.dim() else 0
    if q.dim() == 0 or row_bytes % block_bytes:
        raise ValueError(
            f"{what}: row of {row_bytes} bytes is not a whole number of "
            f"{fmt} blocks of {block_bytes} bytes"
        )
    blocks = q.reshape(-1, block_bytes)  # [B, block_bytes]
    out = torch.empty(blocks.shape[0], block_size, dtype=dtype, device=q.device)  # [B, size]
    # On an accelerator one chunk: its memory is plentiful and each chunk costs kernel launches.
    chunk = max(1, CHUNK_BLOCKS * BLOCK_SIZE // block_size)  # CHUNK_BLOCKS * 32 weights
    chunk = chunk if q.device.type == "cpu" else max(1, blocks.shape[0])
    for start in range(0, blocks.shape[0], chunk):
        out[start : start + chunk] = dequantize_chunk(blocks[start : start + chunk])
    return out.reshape(*q.shape[:-1], row_bytes // block_bytes * block_size)


def block_scales(blocks: torch.Tensor, offset: int = 0, count: int = 1) -> torch.Tensor:
    """The `count` fp16 values at byte `offset` of blocks [b, block_bytes] uint8 (the block
    scale, by default), as fp32 [b, count]."""
    raw = blocks[:, offset : offset + 2 * count].contiguous()  # [b, 2 count]
    return raw.view(torch.float16).to(torch.float32)


def signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """ggml's max of x [b, 32] (quantize_row_q4_0_ref, _q5_0_ref): the value of largest |x|
    with its sign, the first one when both +a and -a occur (ggml's strict `<`), +0.0 for a
    block of zeros -> [b, 1]. Built from amax and amin, which are several times faster than
    argmax; the rare tied blocks take argmax."""
    hi, lo = x.amax(dim=1, keepdim=True), x.amin(dim=1, keepdim=True)  # [b, 1] each
    m = torch.where(hi >= -lo, hi, lo)
    m = torch.where(m == 0, 0.0, m)  # ggml's max starts at +0.0: an all-zero block has d = -0.0
    tied = ((hi == -lo) & (hi > 0)).flatten().nonzero().flatten()  # [t] block indices
    if tied.numel():
        x_tied = x[tied]  # [t, 32]
        m[tied] = x_tied.gather(1, x_tied.abs().argmax(dim=1, keepdim=True))  # the first wins
    return m
