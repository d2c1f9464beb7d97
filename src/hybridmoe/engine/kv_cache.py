"""KVCache: per-layer key/value tensors, one row per sequence, preallocated for a run."""

from __future__ import annotations

import torch

from hybridmoe.config.model import ModelConfig
from hybridmoe.layers.batch import ForwardBatch
from hybridmoe.platform.base import to_device_no_sync


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


class KVBlockPool:
    """Per-layer key/value blocks of `block_tokens` positions each, beside a KVCache: what the
    prefix cache keeps. Blocks are copied between the pool and a cache row; a row never points
    into the pool, so decode reads the same contiguous rows with or without it."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (num_blocks, cfg.num_kv_heads, block_tokens, cfg.head_dim)
        self.num_blocks, self.block_tokens = num_blocks, block_tokens
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    @staticmethod
    def nbytes(cfg: ModelConfig, num_blocks: int, block_tokens: int, dtype: torch.dtype) -> int:
        """Bytes a pool of `num_blocks` blocks takes (for memory planning)."""
        return KVCache.nbytes(cfg, num_blocks, block_tokens, dtype)

    def load_row(self, cache: KVCache, row: int, blocks: list[int]) -> None:
        """Copy `blocks` into `row` of `cache` as its positions [0, len(blocks) * block_tokens)."""
        end = len(blocks) * self.block_tokens
        index = to_device_no_sync(torch.tensor(blocks), self.k[0].device)  # [n]
        for pool, rows in ((self.k, cache.k), (self.v, cache.v)):
            for layer, blocks_kv in enumerate(pool):
                picked = blocks_kv[index].transpose(0, 1)  # [kv_heads, n, block_tokens, D]
                rows[layer][row, :, :end] = picked.flatten(1, 2)  # [kv_heads, end, D]

    def store_row(self, cache: KVCache, row: int, first_block: int, blocks: list[int]) -> None:
        """Copy positions [first_block, first_block + len(blocks)) * block_tokens of `row` of
        `cache` into `blocks`."""
        start, n = first_block * self.block_tokens, len(blocks)
        end = start + n * self.block_tokens
        index = to_device_no_sync(torch.tensor(blocks), self.k[0].device)  # [n]
        for pool, rows in ((self.k, cache.k), (self.v, cache.v)):
            for layer, blocks_kv in enumerate(pool):
                span = rows[layer][row, :, start:end]  # [kv_heads, n * block_tokens, D]
                heads, _, dim = span.shape
                blocks_kv[index] = span.view(heads, n, self.block_tokens, dim).transpose(0, 1)
