"""ForwardBatch: the per-step facts every layer of one forward pass shares."""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from hybridmoe.kernels.host_arrays import host_array
from hybridmoe.layers.rotary import signed_tables


class KVStore(Protocol):
    # windows whose layers keep only their last `window` positions per row: a ring, position p
    # at slot p % window (engine/kv_cache.KVCache); their keys come in ring_layout's order
    ring_windows: frozenset[int]

    def update(
        self, layer_idx: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, T, kv_heads, D] at batch.positions of batch.rows; return every key and
        value those rows can see: [B, kv_heads, batch.kv_len, D] each, or on a layer whose
        window is a ring, [B, kv_heads, S, D] as ring_layout says."""
        ...

    def fused_attention(
        self,
        layer_idx: int,
        batch: ForwardBatch,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor | None:
        """update(), then softmax attention of q [B, T, heads, D] (scale D^-0.5) over what
        it returns within `window` positions, in one kernel -> [B, T, heads, D], within the
        kernel's tolerance of update() + layers/attention.sdpa; None where the store has no
        kernel for this step (then the caller calls update and its SDPA)."""
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
    starts: tuple[int, ...] = ()  # each row's first position this step (positions[:, 0], host)
    _signed: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _host_index: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def rotary_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """rotary.signed_tables(cos, sin), made once per step (every layer rotates by them)."""
        if self._signed is None:
            self._signed = signed_tables(self.cos, self.sin)
        return self._signed

    def host_index(self) -> tuple[np.ndarray, np.ndarray]:
        """(row_index [B], positions [B * T] row by row) as int64 numpy arrays over the same
        host memory, made once per step (every layer's CPU attention kernel reads them)."""
        if self._host_index is None:
            rows, positions = self.row_index, self.positions
            if rows.dtype != torch.int64 or positions.dtype != torch.int64:
                raise TypeError("ForwardBatch: row_index and positions must be int64")
            self._host_index = tuple(
                host_array(t, np.int64) if t.is_contiguous() else t.reshape(-1).numpy()
                for t in (rows, positions)
            )
        return self._host_index

    def mask(self, window: int | None) -> tuple[torch.Tensor | None, bool]:
        """(mask, is_causal) of a layer attending within `window` (None: every key)."""
        return self.masks[window]


def build_attention_masks(
    positions: torch.Tensor,
    kv_len: int,
    windows: Set[int | None],
    rings: frozenset[int] = frozenset(),
    starts: Sequence[int] = (),
) -> dict[int | None, tuple[torch.Tensor | None, bool]]:
    """For each window in `windows`: build_ring_mask where the KV store keeps that window as a
    ring (`rings`; rows starting at `starts`), else build_attention_mask."""
    return {
        window: build_ring_mask(positions, kv_len, window, starts)
        if window in rings
        else build_attention_mask(positions, kv_len, window)
        for window in windows
    }


RING = "ring"
CHUNK = "chunk"
RING_AND_CHUNK = "ring_and_chunk"


def ring_layout(tokens: int, starts: Sequence[int]) -> str:
    """The keys a layer keeping a ring of `window` positions per row (position p at slot
    p % window) attends to, in a step of `tokens` tokens per row whose rows start at `starts`:
    RING: one token per row, written first; the keys are the ring's first min(kv_len, window)
      slots (slot s holds the row's latest position congruent to s, written by the row's
      occupant when s <= its position).
    CHUNK: every row starts at position 0: the step's own `tokens` keys, as without a cache.
    RING_AND_CHUNK: a row resumes after earlier positions (a prefix-cache hit): the ring's
      `window` slots as they were before the step (positions start - window .. start - 1),
      then the step's own keys."""
    if tokens == 1:
        return RING
    return RING_AND_CHUNK if any(starts) else CHUNK


def build_ring_mask(
    positions: torch.Tensor, kv_len: int, window: int, starts: Sequence[int]
) -> tuple[torch.Tensor | None, bool]:
    """(mask [B, 1, T, S] or None, is_causal) for queries at `positions` [B, T] over the keys
    ring_layout orders (S: min(kv_len, window), kv_len or window + T)."""
    layout = ring_layout(positions.shape[1], starts)
    if layout == RING:  # the ring holds the last `window` positions: no window to apply
        return build_attention_mask(positions, min(kv_len, window), None)
    if layout == CHUNK:
        return build_attention_mask(positions, kv_len, window)
    query_pos = positions[:, None, :, None]  # [B, 1, T, 1]
    last = positions[:, :1] - 1  # [B, 1]: each row's last position before the step
    slots = torch.arange(window, device=positions.device)  # [W]
    held = (last - (last - slots) % window)[:, None, None, :]  # [B, 1, 1, W]: each slot's position
    ring = (held >= 0) & (held > query_pos - window)  # [B, 1, T, W]
    key_pos = positions[:, None, None, :]  # [B, 1, 1, T]
    chunk = (key_pos <= query_pos) & (key_pos > query_pos - window)  # [B, 1, T, T]
    return torch.cat([ring, chunk], dim=-1), False


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
