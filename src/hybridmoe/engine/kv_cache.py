"""KVCache: per-layer key/value tensors, one row per sequence, preallocated for a run."""

from __future__ import annotations

import torch

from hybridmoe.config.model import ModelConfig
from hybridmoe.layers.batch import ForwardBatch


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        rows: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (rows, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.max_len = max_len
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    @staticmethod
    def nbytes(cfg: ModelConfig, rows: int, max_len: int, dtype: torch.dtype) -> int:
        """Bytes a cache of `rows` x `max_len` positions takes (for memory planning)."""
        per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        return rows * max_len * per_position

    def update(
        self, layer_idx: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, T, kv_heads, D]; return [B, kv_heads, kv_len, D] views or gathers."""
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
        row_col = batch.row_index[:, None]  # [B, 1], broadcasts against positions [B, T]
        k_cache[row_col, :, batch.positions] = k  # values [B, T, kv_heads, D]
        v_cache[row_col, :, batch.positions] = v
        if batch.rows == list(range(len(batch.rows))):
            b = len(batch.rows)
            return k_cache[:b, :, : batch.kv_len], v_cache[:b, :, : batch.kv_len]
        rows = batch.row_index
        return k_cache[rows, :, : batch.kv_len], v_cache[rows, :, : batch.kv_len]
