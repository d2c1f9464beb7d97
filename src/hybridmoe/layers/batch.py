"""ForwardBatch: the per-step facts every layer of one forward pass shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class KVStore(Protocol):
    def update(
        self, layer_idx: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, T, kv_heads, D] at batch.positions of batch.rows; return every key and
        value those rows can see: [B, kv_heads, batch.kv_len, D] each."""
        ...


class RecurrentStore(Protocol):
    def recurrent_state(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear-attention layer `layer_idx`'s state, one row per KV-cache row: the conv's
        last inputs [rows, conv_dim, conv_kernel - 1] in the model's dtype and the delta-rule
        matrices [rows, value_heads, key_head_dim, value_head_dim] in float32. The layer reads
        and writes its batch's rows in place."""
        ...


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [B, T] int64 on the model's device, each token's position
    rows: list[int]  # KV-cache row of each sequence
    row_index: torch.Tensor  # [B] int64 on the model's device, the same rows
    kv_len: int  # keys visible to this step: max position + 1 (read from the host positions)
    # sliding window (None: full attention) -> (mask [B, 1, T, kv_len] bool or None when plain
    # causal suffices, is_causal: only with mask None, the step is one sequence from position
    # 0), for every window some layer of the model attends with (build_attention_masks)
    masks: dict[int | None, tuple[torch.Tensor | None, bool]]
    cos: torch.Tensor  # [B, T, D]
    sin: torch.Tensor  # [B, T, D]
    # None: no cache, keys are this step's own. A model with linear-attention layers needs a
    # store that is a RecurrentStore too (engine/kv_cache.KVCache is both).
    kv: KVStore | None
    is_decode: bool = False  # one new token per sequence: MoE layers use their decode target

    def mask(self, window: int | None) -> tuple[torch.Tensor | None, bool]:
        """(mask, is_causal) of a layer attending within `window` (None: every key)."""
        return self.masks[window]


def build_attention_masks(
    positions: torch.Tensor, kv_len: int, windows: set[int | None]
) -> dict[int | None, tuple[torch.Tensor | None, bool]]:
    """build_attention_mask for each window in `windows`."""
    return {window: build_attention_mask(positions, kv_len, window) for window in windows}


def build_attention_mask(
    positions: torch.Tensor, kv_len: int, sliding_window: int | None
) -> tuple[torch.Tensor | None, bool]:
    """(mask [B, 1, T, kv_len] or None, is_causal) for queries at `positions` [B, T]."""
    batch, tokens = positions.shape
    fits_window = sliding_window is None or kv_len <= sliding_window
    if batch == 1 and fits_window:
        if tokens == 1:
            return None, False  # one query sees every key stored so far
        if tokens == kv_len:  # the positions are 0..T-1: one sequence from its start
            return None, True
    key_pos = torch.arange(kv_len, device=positions.device)  # [S]
    query_pos = positions[:, None, :, None]  # [B, 1, T, 1]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask, False
