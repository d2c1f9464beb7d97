"""KVCache: per-layer key/value tensors (and linear layers' recurrent state), one row per
sequence, preallocated for a run."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from hybridmoe import env
from hybridmoe.config.model import ModelConfig
from hybridmoe.engine.config import check_attention_kernel
from hybridmoe.kernels import numba_attention
from hybridmoe.layers.batch import RING, RING_AND_CHUNK, ForwardBatch, ring_layout
from hybridmoe.platform.base import to_device_no_sync


@dataclass(frozen=True)
class KVFootprint:
    """What one sequence's row of a KVCache takes."""

    bytes_per_token: int  # grows with the row's length: the layers keeping every position
    fixed_bytes: int  # per row whatever its length: rings of window positions, recurrent state

    def row_bytes(self, max_len: int) -> int:
        return max_len * self.bytes_per_token + self.fixed_bytes


def ring_window(cfg: ModelConfig, layer_idx: int, max_len: int) -> int | None:
    """The window layer `layer_idx` keeps as a ring in a cache of `max_len` positions: its
    sliding window when shorter than max_len; None: the layer keeps every position (or, a
    linear layer, none)."""
    window = None if cfg.is_linear(layer_idx) else cfg.layer_window(layer_idx)
    return window if window is not None and window < max_len else None


def kv_footprint(
    cfg: ModelConfig, max_len: int, dtype: torch.dtype, ring: bool = True
) -> KVFootprint:
    """A row's bytes in a cache of `max_len` positions, sliding layers as rings (`ring`) or
    keeping every position like the others."""
    position = 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize  # one layer's k and v
    per_token = fixed = 0
    for layer in range(cfg.num_layers):
        window = ring_window(cfg, layer, max_len) if ring else None
        if window is not None:
            fixed += window * position
        elif not cfg.is_linear(layer):
            per_token += position
    return KVFootprint(per_token, fixed + state_bytes(cfg, dtype))


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype, device=device); on the CPU as memory the kernel zeroes
    on first touch (numpy's zeroed allocation is calloc: a large block is a fresh anonymous
    mapping, untouched), not a memset while the engine is built. A cache of the context
    window's positions (Qwen3-30B-A3B: 48 layers x 40960 positions, 3.75 GiB of bf16) then
    costs no load time, and only the RSS its rows reach."""
    if torch.device(device).type != "cpu" or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    zeroed = np.zeros(math.prod(shape) * dtype.itemsize, np.uint8)  # calloc
    return torch.from_numpy(zeroed).view(dtype).reshape(shape)


@dataclass(frozen=True)
class PrefillKV:
    """One ring layer's keys and values of a prefill step, as the step computed them."""

    rows: list[int]
    starts: tuple[int, ...]  # each row's first position
    k: torch.Tensor  # [B, T, kv_heads, D]
    v: torch.Tensor


class KVCache:
    """Keys and values of every attention layer and, for a model with linear-attention
    layers, their recurrent state (RecurrentStore): the same rows, one per sequence. A row's
    state needs no reset: a prefill from position 0 starts from zeros and overwrites it.

    A sliding-window layer whose window is shorter than `max_len` keeps (unless `ring` is
    False) only its last `window` positions per row: a ring, position p at slot p % window,
    whose step keys layers/batch.ring_layout orders. No query reads a slot its row's occupant
    has not written. With `keep_prefill_kv`, ring layers also keep the last prefill step's own
    keys and values (until release_prefill_kv or the next prefill) for the prefix cache, whose
    blocks hold every position (read_span). `attention_kernel` (EngineConfig's, one of
    ATTENTION_KERNELS) says when a decode step on host tensors attends through
    fused_attention's CPU kernel (kernels/numba_attention.py) instead of update() + SDPA:
    "auto" where the kernel gives SDPA's bits (bfloat16, on a machine where
    numba_attention.gives_sdpa_bits holds for the model's heads), "on" for every such step
    (float32 too: within SDPA's tolerance, not its bits), "off" never."""

    def __init__(
        self,
        cfg: ModelConfig,
        rows: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ring: bool = True,
        keep_prefill_kv: bool = False,
        attention_kernel: str = "auto",
    ):
        check_attention_kernel(attention_kernel)
        self.max_len, self.keep_prefill_kv = max_len, keep_prefill_kv
        self.attention_kernel = attention_kernel
        # layer -> (its k, v tensors, the kernel's flat views of them)
        self._host: dict[int, tuple[torch.Tensor, torch.Tensor, tuple[np.ndarray, ...]]] = {}
        # (layer, b) -> (k cache, v cache, their first b rows): _rows' views, made once
        self._first_rows: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.k, self.v = [], []
        self.ring_sizes: dict[int, int] = {}  # ring layer -> its window
        self.prefill_kv: dict[int, PrefillKV] = {}  # ring layer -> the last prefill's k, v
        self.conv_state: dict[int, torch.Tensor] = {}  # layer -> [rows, conv_dim, kernel - 1]
        self.delta_state: dict[int, torch.Tensor] = {}  # layer -> [rows, Hv, dk, dv] float32
        for layer in range(cfg.num_layers):
            window = ring_window(cfg, layer, max_len) if ring else None
            positions = 0 if cfg.is_linear(layer) else max_len  # linear layers keep no KV
            if window is not None:
                positions = self.ring_sizes[layer] = window
            shape = (rows, cfg.num_kv_heads, positions, cfg.head_dim)
            self.k.append(lazy_zeros(shape, dtype, device))
            self.v.append(lazy_zeros(shape, dtype, device))
            if cfg.is_linear(layer):
                conv_shape, delta_shape = recurrent_state_shapes(cfg, rows)
                self.conv_state[layer] = torch.zeros(conv_shape, dtype=dtype, device=device)
                self.delta_state[layer] = torch.zeros(delta_shape, device=device)
        self.ring_windows = frozenset(self.ring_sizes.values())  # KVStore

    @staticmethod
    def nbytes(
        cfg: ModelConfig, rows: int, max_len: int, dtype: torch.dtype, ring: bool = True
    ) -> int:
        """Bytes a cache of `rows` x `max_len` positions takes (for memory planning)."""
        return rows * kv_footprint(cfg, max_len, dtype, ring).row_bytes(max_len)

    def recurrent_state(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RecurrentStore: the conv and delta-rule state of linear layer `layer_idx`."""
        return self.conv_state[layer_idx], self.delta_state[layer_idx]

    def update(
        self, layer_idx: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, T, kv_heads, D]; return [B, kv_heads, kv_len, D] views or gathers
        (a ring layer: [B, kv_heads, S, D] as ring_layout says)."""
        if layer_idx in self.ring_sizes:
            return self._update_ring(layer_idx, batch, k, v)
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
        if not self._write_host(layer_idx, batch, k, v):
            row_col = batch.row_index[:, None]  # [B, 1], broadcasts against positions [B, T]
            k_cache[row_col, :, batch.positions] = k  # values [B, T, kv_heads, D]
            v_cache[row_col, :, batch.positions] = v
        return self._rows(layer_idx, batch, batch.kv_len)

    def _write_host(self, layer_idx: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor):
        """update()'s indexed assignment by the attention kernel's writes (the same bits, no
        aten op) for a decode step on a host cache of KERNEL_DTYPES, unless the glue kernels
        are switched off (env.glue_kernels); False: not taken (write_step checks the step's
        shapes and dtypes against the cache's)."""
        k_cache = self.k[layer_idx]
        if not (
            batch.is_decode
            and k_cache.is_cpu
            and k_cache.dtype in numba_attention.KERNEL_DTYPES
            and env.glue_kernels()
        ):
            return False
        rows, positions = batch.host_index()
        caches, slots = self._host_caches(layer_idx), k_cache.shape[2]
        return numba_attention.write_step(k, v, caches, slots, rows, positions, batch.kv_len)

    def _host_caches(self, layer_idx: int) -> tuple[np.ndarray, np.ndarray]:
        """The kernel's flat views of layer `layer_idx`'s k and v caches, made once."""
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
        held = self._host.get(layer_idx)
        if held is None or held[0] is not k_cache or held[1] is not v_cache:
            host = numba_attention.cache_array
            held = self._host[layer_idx] = (k_cache, v_cache, (host(k_cache), host(v_cache)))
        return held[2]

    def fused_attention(
        self,
        layer_idx: int,
        batch: ForwardBatch,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor | None:
        """KVStore: update() and the attention over what it returns in one call of kernels/
        numba_attention, as `attention_kernel` says, for a decode step (one query per row) on
        host tensors of the cache's dtype, one of KERNEL_DTYPES; None for any other step. A
        prefill, however short, stays on SDPA: a prompt's tokens then have the same bits
        whether a prefix-cache hit left few of them to prefill or none (tests/engine/
        test_prefix_cache.py). Which steps take the kernel depends on nothing else (not the
        batch, nor the row's length); its bits are SDPA's for the same batch, whose key rows
        are the batch's kv_len long (a row's last keys masked), as SDPA's are."""
        if k.dtype is not q.dtype or v.dtype is not q.dtype or not (k.is_cpu and v.is_cpu):
            return None
        B, T, heads, D = q.shape
        step = self.kernel_step(
            layer_idx, batch, q.dtype, heads, k.shape[2], D, T, q.is_cpu, window
        )
        if step is None:
            return None
        caches, slots, rows, positions, ring, window = step
        return numba_attention.decode_attention(
            q, k, v, caches, slots, rows, positions, batch.kv_len, ring, window
        )

    def kernel_step(
        self,
        layer_idx: int,
        batch: ForwardBatch,
        dtype: torch.dtype,
        heads: int,
        kv_heads: int,
        head_dim: int,
        queries: int = 1,
        host: bool = True,
        window: int | None = None,
    ) -> tuple | None:
        """Whether fused_attention takes a step of `queries` queries a row of this dtype and
        head shape (on the host when `host`), as it decides: (the cache arrays, slots, the
        step's cache rows and positions, the ring size or None, the window or None); None
        where the step stays on SDPA."""
        k_cache = self.k[layer_idx]
        if (
            self.attention_kernel == "off"
            or not batch.is_decode
            or queries != 1
            or not host
            or not k_cache.is_cpu
            or dtype is not k_cache.dtype
            or dtype not in numba_attention.KERNEL_DTYPES
        ):
            return None
        if self.attention_kernel == "auto" and not (
            dtype is torch.bfloat16 and numba_attention.gives_sdpa_bits(heads, kv_heads, head_dim)
        ):
            return None
        ring = self.ring_sizes.get(layer_idx)
        rows, positions = batch.host_index()
        window = None if ring is not None else window
        return self._host_caches(layer_idx), k_cache.shape[2], rows, positions, ring, window

    def _rows(
        self, layer_idx: int, batch: ForwardBatch, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions (or slots) of the batch's rows: [B, kv_heads, length,
        D] each, views when the rows are 0 .. B - 1."""
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
        if batch.rows == list(range(len(batch.rows))):
            b = len(batch.rows)
            if b < k_cache.shape[0]:  # the first b rows, as views made once
                held = self._first_rows.get((layer_idx, b))
                if held is None or held[0] is not k_cache or held[1] is not v_cache:
                    held = (k_cache, v_cache, k_cache[:b], v_cache[:b])
                    self._first_rows[layer_idx, b] = held
                k_cache, v_cache = held[2], held[3]
            return k_cache.narrow(2, 0, length), v_cache.narrow(2, 0, length)  # 1 aten op each
        rows = batch.row_index
        return k_cache[rows, :, :length], v_cache[rows, :, :length]

    def _update_ring(
        self, layer_idx: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """update() of a ring layer: the step's last `window` positions go to their slots."""
        k_ring, v_ring = self.k[layer_idx], self.v[layer_idx]  # [rows, kv_heads, W, D]
        window, tokens = self.ring_sizes[layer_idx], k.shape[1]
        if len(batch.starts) != len(batch.rows):
            raise ValueError(
                f"a ring layer needs each row's first position: batch.starts has "
                f"{len(batch.starts)} for {len(batch.rows)} rows (MoeCausalLM.make_batch sets it)"
            )
        layout = ring_layout(tokens, batch.starts)
        if self.keep_prefill_kv and not batch.is_decode:
            self.prefill_kv[layer_idx] = PrefillKV(batch.rows, batch.starts, k, v)
        before = None
        if layout == RING_AND_CHUNK:  # read before this step's writes: gathered copies
            before = k_ring[batch.row_index], v_ring[batch.row_index]  # [B, kv_heads, W, D]
        tail = min(tokens, window)  # positions beyond the step's last `window` are not kept
        slots = batch.positions[:, tokens - tail :] % window  # [B, tail], distinct per row
        row_col = batch.row_index[:, None]
        k_ring[row_col, :, slots] = k[:, tokens - tail :]
        v_ring[row_col, :, slots] = v[:, tokens - tail :]
        if layout == RING:
            return self._rows(layer_idx, batch, min(batch.kv_len, window))
        k_new, v_new = k.transpose(1, 2), v.transpose(1, 2)  # [B, kv_heads, T, D]
        if before is None:
            return k_new, v_new
        return torch.cat([before[0], k_new], dim=2), torch.cat([before[1], v_new], dim=2)

    def write_span(
        self, layer_idx: int, row: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k, v [kv_heads, n, D] as positions start .. start + n - 1 of `row` (a ring
        layer keeps the last `window` of them)."""
        n = k.shape[1]
        window = self.ring_sizes.get(layer_idx)
        if window is None:
            self.k[layer_idx][row, :, start : start + n] = k
            self.v[layer_idx][row, :, start : start + n] = v
            return
        tail = min(n, window)
        slots = torch.arange(start + n - tail, start + n, device=k.device) % window  # [tail]
        self.k[layer_idx][row, :, slots] = k[:, n - tail :]
        self.v[layer_idx][row, :, slots] = v[:, n - tail :]

    def read_span(
        self, layer_idx: int, row: int, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions start .. end - 1 of `row`: [kv_heads, end - start, D] each; a ring layer's
        from the last prefill step's own keys (keep_prefill_kv). RuntimeError when that step
        did not compute them all."""
        if layer_idx not in self.ring_sizes:
            return self.k[layer_idx][row, :, start:end], self.v[layer_idx][row, :, start:end]
        kept = self.prefill_kv.get(layer_idx)
        b = kept.rows.index(row) if kept is not None and row in kept.rows else None
        first = None if b is None else kept.starts[b]
        if first is None or not first <= start <= end <= first + kept.k.shape[1]:
            raise RuntimeError(
                f"layer {layer_idx} keeps a ring of {self.ring_sizes[layer_idx]} positions: "
                f"positions {start}..{end - 1} of row {row} are only in its last prefill's "
                "keys, which the cache did not keep (keep_prefill_kv) or which do not cover them"
            )
        span = slice(start - first, end - first)
        return kept.k[b, span].transpose(0, 1), kept.v[b, span].transpose(0, 1)

    def release_prefill_kv(self) -> None:
        """Drop what keep_prefill_kv kept of the last prefill."""
        self.prefill_kv.clear()


def kv_bytes_per_position(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Key and value bytes of one position over every attention layer (ring layers too, as
    the prefix cache's blocks keep them; linear layers keep none)."""
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
        """Copy `blocks` into `row` of `cache` as its positions [0, len(blocks) * block_tokens)
        (a ring layer takes only the blocks its last `window` positions are in)."""
        end = len(blocks) * self.block_tokens
        device, index = self.k[0].device, {}  # first block -> their indices [n - first]
        for layer, (k_blocks, v_blocks) in enumerate(zip(self.k, self.v, strict=True)):
            window = cache.ring_sizes.get(layer)
            first = 0 if window is None else max(0, end - window) // self.block_tokens
            if first not in index:
                index[first] = to_device_no_sync(torch.tensor(blocks[first:]), device)
            k, v = (  # [kv_heads, (n - first) * block_tokens, D]
                b[index[first]].transpose(0, 1).flatten(1, 2) for b in (k_blocks, v_blocks)
            )
            cache.write_span(layer, row, first * self.block_tokens, k, v)

    def store_row(self, cache: KVCache, row: int, first_block: int, blocks: list[int]) -> None:
        """Copy positions [first_block, first_block + len(blocks)) * block_tokens of `row` of
        `cache` into `blocks` (a ring layer's from its last prefill: KVCache.read_span)."""
        start, n = first_block * self.block_tokens, len(blocks)
        end = start + n * self.block_tokens
        index = to_device_no_sync(torch.tensor(blocks), self.k[0].device)  # [n]
        for layer in range(len(self.k)):
            spans = cache.read_span(layer, row, start, end)  # [kv_heads, n * block_tokens, D]
            for pool, span in zip((self.k[layer], self.v[layer]), spans, strict=True):
                heads, _, dim = span.shape
                pool[index] = span.reshape(heads, n, self.block_tokens, dim).transpose(0, 1)
