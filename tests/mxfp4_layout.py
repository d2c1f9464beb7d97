"""The Hugging Face MXFP4 layout (gpt-oss's `*_blocks` [..., n / 32, 16] and `*_scales`
[..., n / 32], byte j of a block holding weights 2j and 2j + 1) made in tests: from GGUF
MXFP4 blocks (the inverse of quant/mxfp4_hf.hf_blocks_to_mxfp4), from float weights, or
random, to write tiny MXFP4 checkpoints and to check the loader against transformers."""

from __future__ import annotations

import torch

from hybridmoe.quant.formats import weight_format

MXFP4 = weight_format("mxfp4")


def hf_layout(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF MXFP4 bytes uint8 [..., 17 G] -> (blocks [..., G, 16], scales [..., G])."""
    groups = stored.view(*stored.shape[:-1], -1, 17)  # [..., G, 17]
    qs = groups[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [..., G, 32], weight order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., G, 16]
    return blocks.contiguous(), groups[..., 0].contiguous()


def quantize_hf(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float w [..., n] -> the HF (blocks, scales) of mxfp4's quantisation of it."""
    return hf_layout(MXFP4.quantize(w))


def random_hf_experts(
    experts: int, hidden: int, inter: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate_up_blocks [E, 2I, H/32, 16], gate_up_scales [E, 2I, H/32], down_blocks
    [E, H, I/32, 16], down_scales [E, H, I/32]): random codes, exponents 118..126 (scales
    2^-9 .. 2^-1, so |weight| <= 3)."""
    gen = torch.Generator().manual_seed(seed)

    def pair(rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(
            0, 256, (experts, rows, n // 32, 16), dtype=torch.uint8, generator=gen
        )
        scales = torch.randint(118, 127, (experts, rows, n // 32), dtype=torch.uint8, generator=gen)
        return blocks, scales

    return (*pair(2 * inter, hidden), *pair(hidden, inter))
