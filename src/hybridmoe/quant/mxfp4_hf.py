"""An mxfp4 ExpertBank from the Hugging Face MXFP4 layout (gpt-oss's
`mlp.experts.{gate_up,down}_proj_{blocks,scales}`, `quantization_config.quant_method` "mxfp4").

That layout stores a weight [E, rows, n] as `blocks` uint8 [E, rows, n / 32, 16], byte j of a
block holding weight 2j in its low nibble and 2j + 1 in its high one, and `scales` uint8
[E, rows, n / 32], the blocks' E8M0 exponents (transformers' convert_moe_packed_tensors:
value = E2M1(code) * 2^(scale - 127)). gate_up's rows interleave the projections: row 2i is
gate's row i, row 2i + 1 up's (transformers' GptOssExperts: gate_up[..., ::2], [..., 1::2]).

The bank holds GGUF's MXFP4 blocks (quant/mxfp4.py: exponent first, weights j and j + 16 in
one byte), gate's rows then up's, so the codes are rearranged, never dequantised: one copy of
the experts in RAM (17 bytes a 32-weight block, what the file holds), built one expert at a
time; the file's pages can be released once it is made.
"""

from __future__ import annotations

import torch

from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.mxfp4 import BLOCK_BYTES, MXFP4

__all__ = ["bank_from_hf_mxfp4", "hf_blocks_to_mxfp4"]

_BLOCK_PAIRS = BLOCK_BYTES - 1  # bytes of codes a block: 32 weights, two a byte


def bank_from_hf_mxfp4(
    gate_up_blocks: torch.Tensor,
    gate_up_scales: torch.Tensor,
    down_blocks: torch.Tensor,
    down_scales: torch.Tensor,
) -> ExpertBank:
    """The stacked mxfp4 bank of one layer's experts in the HF layout: gate_up_blocks uint8
    [E, 2I, H / 32, 16], gate_up_scales uint8 [E, 2I, H / 32] (rows interleaved: gate, up),
    down_blocks [E, H, I / 32, 16], down_scales [E, H, I / 32]. The bank's gate_up is
    [E, 2I, 17 H / 32] with gate's I rows first, then up's: a per-row quantity of gate_up (its
    bias) is reordered the same way, [..., 0::2] then [..., 1::2]. ValueError naming the
    tensors when their shapes do not pair."""
    num, rows, groups = _check_pair("gate_up_proj", gate_up_blocks, gate_up_scales)
    down_num, hidden, down_groups = _check_pair("down_proj", down_blocks, down_scales)
    inter = down_groups * 32
    if (down_num, hidden, rows) != (num, groups * 32, 2 * inter):
        raise ValueError(
            f"mxfp4 experts: gate_up_proj_blocks {tuple(gate_up_blocks.shape)} [E, 2I, H/32, 16] "
            f"and down_proj_blocks {tuple(down_blocks.shape)} [E, H, I/32, 16] do not pair"
        )
    # gate's rows (even), then up's (odd): [2I] row indices into the file's interleaved rows
    order = torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])
    gate_up = ExpertBank.empty_like_tensor(MXFP4, (num, rows, hidden), "cpu")
    down = ExpertBank.empty_like_tensor(MXFP4, (num, hidden, inter), "cpu")
    for e in range(num):
        gate_up[e] = hf_blocks_to_mxfp4(gate_up_blocks[e, order], gate_up_scales[e, order])
        down[e] = hf_blocks_to_mxfp4(down_blocks[e], down_scales[e])
    return ExpertBank(gate_up, down, MXFP4)


def hf_blocks_to_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF blocks uint8 [..., G, 16] and scales [..., G] -> the same weights as GGUF MXFP4
    blocks, uint8 [..., 17 G]: the exponent byte, then byte j = code of weight j | code of
    weight j + 16 << 4 (HF's byte j holds weights 2j and 2j + 1)."""
    low, high = blocks & 0x0F, blocks >> 4  # [..., G, 16] each: weights 2j, 2j + 1
    codes = torch.stack([low, high], dim=-1).flatten(-2)  # [..., G, 32], weight order
    packed = codes[..., :_BLOCK_PAIRS] | (codes[..., _BLOCK_PAIRS:] << 4)  # [..., G, 16]
    out = torch.cat([scales[..., None], packed], dim=-1)  # [..., G, 17]
    return out.flatten(-2)


def _check_pair(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, int]:
    """(E, rows, G) of `name`'s blocks [E, rows, G, 16] and scales [E, rows, G], both uint8;
    ValueError naming them otherwise."""
    for what, tensor in ((f"{name}_blocks", blocks), (f"{name}_scales", scales)):
        if tensor.dtype != torch.uint8:
            raise ValueError(f"mxfp4 experts: {what} is {tensor.dtype}, expected uint8")
    if blocks.dim() != 4 or blocks.shape[3] != _BLOCK_PAIRS or blocks.shape[:3] != scales.shape:
        raise ValueError(
            f"mxfp4 experts: {name}_blocks {tuple(blocks.shape)} and {name}_scales "
            f"{tuple(scales.shape)} are not [E, rows, n/32, 16] and [E, rows, n/32]"
        )
    return tuple(scales.shape)
