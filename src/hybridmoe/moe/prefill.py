"""ExpertPrefill: where a prefill's routed experts run when they do not live on the accelerator.

Prefill routes many tokens through most of a layer's experts, so the decode cache is the wrong
tool. Two exact ways, chosen per forward by OffloadConfig.prefill:

- `stream`: the layer's whole bank is copied to the accelerator and computed there. Two
  layer buffers alternate: while layer L computes from one, layer L + 1's bank is copied into
  the other on the platform's copy stream (the last layer prefetches the first, for the next
  prompt), so the copies overlap the compute;
- `cpu`: the routes are computed by the CPU expert kernel from the host bank and the partial
  copied to the accelerator; for short prompts, where moving a whole layer costs more than
  computing a few tokens.

`auto` takes `cpu` for at most `prefill_cpu_tokens` tokens, else `stream`. On the cpu device
there is nothing to move: `InPlacePrefill` computes from the host banks where they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridmoe.moe.cpu_experts import CpuExpertFn, bank_moe
from hybridmoe.platform.base import Platform
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.slot_banks import SlotBanks


class LayerStreamer:
    """Two accelerator buffers, each one layer's bank, filled layer by layer on the copy stream;
    each sized for the largest layer's formats, read in the formats of the layer it holds."""

    def __init__(self, banks: Sequence[ExpertBank], platform: Platform):
        self.banks, self.platform = list(banks), platform
        num_experts = self.banks[0].num_experts
        self.buffers = [SlotBanks(self.banks, num_experts, platform.device) for _ in range(2)]
        self._layer_in = [-1, -1]  # the layer each buffer holds (or is being filled with)
        self._copies = [None, None]  # CopyHandle of each buffer's last fill
        self.layers_copied = 0

    @staticmethod
    def nbytes(banks: Sequence[ExpertBank]) -> int:
        """Accelerator bytes a streamer over `banks` takes."""
        return 2 * banks[0].num_experts * SlotBanks.slot_nbytes(banks)

    def bank_for(self, layer_idx: int) -> ExpertBank:
        """Layer `layer_idx`'s bank on the accelerator, safe for work issued next; starts the
        copy of the layer after it into the other buffer."""
        buffer = layer_idx % 2
        if self._layer_in[buffer] != layer_idx:  # not prefetched: the first layer, or a skip
            self._start(layer_idx)
        self.platform.finish_copies(self._copies[buffer])
        following = (layer_idx + 1) % len(self.banks)  # the last layer prefetches the first,
        # unless that would refill the buffer this layer is about to read (an odd layer count)
        if following % 2 != buffer and self._layer_in[following % 2] != following:
            self._start(following)
        return self.buffers[buffer].bank_for(self.banks[layer_idx])

    def _start(self, layer_idx: int) -> None:
        buffer, bank = layer_idx % 2, self.banks[layer_idx]
        target = self.buffers[buffer].bank_for(bank)
        self._copies[buffer] = self.platform.start_copies(bank.copies_into(target))
        self._layer_in[buffer] = layer_idx
        self.layers_copied += 1


class InPlacePrefill:
    """Prefill on the cpu device: the layer's host bank computed in place by `expert_fn` (the
    CPU expert kernel the decode steps use: the fused numba kernel reads each weight row once
    for a short prompt's tokens and hands a long prompt to the grouped reference; default the
    grouped reference itself)."""

    def __init__(self, banks: Sequence[ExpertBank], expert_fn: CpuExpertFn = bank_moe):
        self.banks, self.expert_fn = list(banks), expert_fn

    def __call__(
        self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.expert_fn(x, topk_ids, topk_weights, self.banks[layer_idx])


class ExpertPrefill:
    """Runs a prefill forward's routed experts per `mode` (auto, stream, cpu); see the module."""

    def __init__(
        self,
        banks: Sequence[ExpertBank],
        platform: Platform,
        cpu_expert_fn: CpuExpertFn,
        mode: str,
        cpu_tokens: int,
    ):
        self.banks, self.platform, self.cpu_expert_fn = list(banks), platform, cpu_expert_fn
        self.mode, self.cpu_tokens = mode, cpu_tokens
        self.streamer = LayerStreamer(banks, platform) if self.streams(mode) else None

    @staticmethod
    def streams(mode: str) -> bool:
        """Whether `mode` may stream layers (and so holds a LayerStreamer's buffers)."""
        return mode != "cpu"

    def uses_cpu(self, tokens: int) -> bool:
        return self.mode == "cpu" or (self.mode == "auto" and tokens <= self.cpu_tokens)

    def __call__(
        self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """x [N, H], topk_ids [N, K], topk_weights [N, K] on the accelerator -> the float32
        partial [N, H] there."""
        if self.uses_cpu(x.shape[0]):
            host = [t.cpu() for t in (x, topk_ids, topk_weights)]
            return self.cpu_expert_fn(*host, self.banks[layer_idx]).to(x.device)
        return bank_moe(x, topk_ids, topk_weights, self.streamer.bank_for(layer_idx))
