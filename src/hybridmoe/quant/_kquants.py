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

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

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


@dataclass(frozen=True)
class SuperBlockInts:
    """A k-quant's super-blocks as integers, the view the q8 contract computes with
    (quant/activation_q8.py): weight i of sub-block j is d sc_j (u_i - offset) - dmin m_j,
    exactly (d sc_j and dmin m_j are exact in float32, as the dequantisers' products)."""

    u: torch.Tensor  # uint8 [..., nsb, 256]: the unsigned integer of each weight
    scales: torch.Tensor  # int32 [..., nsb, subs]: sc_j of each sub-block of 256 / subs
    mins: torch.Tensor | None  # int32 [..., nsb, subs]: m_j (formats with a minimum)
    d: torch.Tensor  # float32 [..., nsb]
    dmin: torch.Tensor | None  # float32 [..., nsb] (formats with a minimum)
    offset: int  # subtracted from every u


def superblock_ints(
    q: torch.Tensor,
    u: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    d: torch.Tensor,
    dmin: torch.Tensor | None,
    offset: int = 0,
) -> SuperBlockInts:
    """SuperBlockInts of the stored q [..., nsb * block_bytes] from its blocks' flat parts
    (u [b, 256], scales and mins [b, subs], d and dmin [b, 1, 1] as fp16_at gives them)."""
    lead = (*q.shape[:-1], -1)
    ints = (
        None if t is None else t.to(torch.int32).reshape(*lead, t.shape[-1]) for t in (scales, mins)
    )
    floats = (None if t is None else t.reshape(lead) for t in (d, dmin))
    return SuperBlockInts(u.reshape(*lead, SUPER_BLOCK_SIZE), *ints, *floats, offset)


@dataclass(frozen=True)
class SuperBlockIntsIR:
    """LLVM IR values of one super-block for the integer-dot tile (kernels/numba_simd_q8.py),
    made by a format's superblock_ints_ir(builder, block): with q the q8 activations of the
    super-block and B_k = Σ q over its 16-weight group k, its integer S = Σ_p Σ_l
    pair_scales(p)_l (u_2l q_2l + u_2l+1 q_2l+1) (u of piece p), L = Σ_k lows_k B_k, and its
    product fl(S) fl(d d_x) - fl(L) fl(dmin d_x); without a minimum (dmin None) S - L is the
    integer and fl(S - L) fl(d d_x) the product (the contract's, quant/activation_q8.py)."""

    piece: Callable[[int], Any]  # p -> <32 x i8>: u of the super-block's weights 32p .. 32p + 31
    pair_scales: Callable[[int], Any]  # p -> <16 x i16>: the scale of each pair of piece p
    lows: Any  # <16 x i16>: per 16-weight group, its minimum (or offset * scale) coefficient
    d: Any  # float
    dmin: Any | None  # float, or None: L is taken from S


def sixteen_weight_pair_scales(builder, scales) -> Callable[[int], Any]:
    """SuperBlockIntsIR.pair_scales of a format with 16 sub-blocks of 16 weights (q2_k, q3_k,
    q6_k), from their scales <16 x i16>: piece p's pairs 0..7 take sub-block 2p's scale, its
    pairs 8..15 sub-block 2p + 1's."""
    from hybridmoe.kernels import llvm_ir as ll

    return lambda p: ll.lanes(builder, scales, [2 * p] * 8 + [2 * p + 1] * 8)


def register_k_quant(
    name: str,
    block_bytes: int,
    chunk: DequantizeChunk,
    superblock_ir: DequantizeSuperBlockIR,
    scale_offsets: tuple[int, ...],
    ints: tuple[Callable[[torch.Tensor], SuperBlockInts], Callable[[Any, Any], SuperBlockIntsIR]]
    | None = None,
    short_row_rows: int = 1,
) -> WeightFormat:
    """Registers the k-quant `name`: blocks [b, block_bytes] uint8 -> chunk -> weights
    [b, 256] fp32; `superblock_ir` is its kernel's DequantizeSuperBlockIR; its fp16 d (and
    dmin) at `scale_offsets`; `ints` its integer view, (WeightFormat.superblock_ints_fn,
    KernelFormat.superblock_ints_ir), where it has one."""
    dequantize = partial(_dequantize, name=name, block_bytes=block_bytes, chunk=chunk)
    ints_fn, ints_ir = ints if ints is not None else (None, None)
    # one token's q8 tiles a row at a time: one ascending stream of the row's super-blocks.
    # Measured (the Intel Xeon, 2026-12-07, the Qwen3-30B-A3B layer at T = 1 on 2 threads,
    # flushed, both kernels in one process over the same bytes, 3 runs): the time against
    # 4-row tiles q4_k 0.95-0.98x, q5_k 0.92-0.96x, q6_k 0.97-0.99x (q4_0's nibble pairs want
    # 2 rows at least: 1.04-1.06x, it keeps 4). On short rows (a Qwen3-30B-A3B down row is 3
    # super-blocks) a row's own reduction and store weigh more: `short_row_rows` (4 for q2_k,
    # q3_k and q4_k, whose tiles gain there; q5_k's and q6_k's do not: their modules' notes)
    kernel = KernelFormat(
        name,
        block_bytes,
        superblock_ir,
        pieces=PIECES,
        superblock_ints_ir=ints_ir,
        one_token_rows=1,
        short_row_rows=short_row_rows,
    )
    stored = (SUPER_BLOCK_SIZE, block_bytes, torch.uint8)
    fmt = WeightFormat(
        name, *stored, None, dequantize, kernel, scale_offsets, superblock_ints_fn=ints_fn
    )
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
