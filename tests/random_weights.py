"""Expert banks in any registered format from seeded random bytes (hybridmoe.quant.random_blocks,
shared with the benchmarks, which write k-quant GGUF files from them)."""

from __future__ import annotations

import torch

from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.formats import weight_format
from hybridmoe.quant.random_blocks import random_stored

__all__ = ["random_bank", "random_stored", "whole_blocks"]


def random_bank(name: str, experts: int, hidden: int, inter: int, seed: int = 0) -> ExpertBank:
    """A bank of `experts` experts (gate_up [E, 2I, H], down [E, H, I]) in format `name`."""
    fmt, gen = weight_format(name), torch.Generator().manual_seed(seed)
    gate_up = random_stored(fmt, (experts, 2 * inter, hidden), gen)
    return ExpertBank(gate_up, random_stored(fmt, (experts, hidden, inter), gen), fmt)


def whole_blocks(n: int, name: str) -> int:
    """n rounded up to a whole number of `name`'s blocks (256 for the k-quants)."""
    size = weight_format(name).block_size
    return -(-n // size) * size
