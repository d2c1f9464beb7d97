"""KVCache: per-layer key/value tensors (and linear layers' recurrent state), one row per
sequence, preallocated for a run."""

from __future__ import annotations

import math

import torch

from hybridmoe.config.model import ModelConfig
from hybridmoe.layers.batch import ForwardBatch
from hybridmoe.platform.base import to_device_no_sync


class KVCache:
    """Keys and values of every full-attention layer and, for a model with linear-attention
    layers, their recurrent state (RecurrentStore): the same rows, one per sequence. A row's
    state needs no reset: a prefill from position 0 starts from zeros and overwrites it."""

    def __init__(
        self,
        cfg: ModelConfig,
        rows: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.max_len = max_len
        self.k, self.v = [], []
        self.conv_state: dict[int, torch.Tensor] = {}  # layer -> [rows, conv_dim, kernel - 1]
        self.delta_state: dict[int, torch.Tensor] = {}  # layer -> [rows, Hv, dk, dv] float32
        for layer in range(cfg.num_layers):
            positions = 0 if cfg.is_linear(layer) else max_len  # linear layers keep no KV
            shape = (rows, cfg.num_kv_heads, positions, cfg.head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device=device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=device))
            if cfg.is_linear(layer):
                conv_shape, delta_shape = recurrent_state_shapes(cfg, rows)
                self.conv_state[layer] = torch.zeros(conv_shape, dtype=dtype, device=device)
                self.delta_state[layer] = torch.zeros(delta_shape, device=device)

    @staticmethod
    def nbytes(cfg: ModelConfig, rows: int, max_len: int, dtype: torch.dtype) -> int:
        """Bytes a cache of `rows` x `max_len` positions takes (for memory planning)."""
        return rows * (max_len * kv_bytes_per_position(cfg, dtype) + state_bytes(cfg, dtype))

    def recurrent_state(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RecurrentStore: the conv and delta-rule state of linear layer `layer_idx`."""
        return self.conv_state[layer_idx], self.delta_state[layer_idx]

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


def kv_bytes_per_position(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Key and value bytes of one position over the full-attention layers."""
    attention_layers = sum(not cfg.is_linear(i) for i in range(cfg.num_layers))
    return 2 * attention_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def recurrent_state_shapes(cfg: ModelConfig, rows: int) -> tuple[tuple[int, ...], ...]:
    """(conv state, delta-rule state) shapes of one linear layer for `rows` sequences."""
    s = cfg.linear_attention
    conv = (rows, s.conv_dim, s.conv_kernel - 1)
    return conv, (rows, s.num_value_heads, s.key_head_dim, s.value_head_dim)


def state_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Recurrent-state bytes of one sequence over the linear layers (conv state in `dtype`,
    delta-rule state in float32); 0 without linear layers."""
    if not cfg.has_recurrent_state:
        return 0
    conv, delta = recurrent_state_shapes(cfg, 1)
    per_layer = math.prod(conv) * dtype.itemsize + math.prod(delta) * 4
    return sum(cfg.linear_layers) * per_layer


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
        return num_blocks * block_tokens * kv_bytes_per_position(cfg, dtype)

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
