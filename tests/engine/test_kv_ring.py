"""Sliding-window layers as rings of `window` positions per KV-cache row (engine/kv_cache.py,
layers/batch.py: ring_layout, build_ring_mask) against the cache that keeps every position,
their reference: the same attention output for every step kind (a prefill longer and shorter
than the window, a prefill resuming after copied positions, decode steps of rows at different
positions, rows out of order), rows reused after other occupants; the bytes it allocates and
plans, and gpt-oss-120b's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hybridmoe.models  # noqa: F401  (registers the families)
from hybridmoe.engine.kv_cache import KVCache, KVFootprint, kv_footprint
from hybridmoe.layers.batch import ForwardBatch, build_attention_masks
from hybridmoe.models.registry import family_for

ROOT = Path(__file__).resolve().parents[2]
WINDOW, MAX_LEN, ROWS = 4, 40, 3
RAW = {
    "architectures": ["GptOssForCausalLM"],
    "hidden_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 16,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
    "vocab_size": 10,
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
}
CFG = family_for(RAW).config_from(RAW)


def make_batch(cache: KVCache, positions: torch.Tensor, rows: list[int]) -> ForwardBatch:
    """What MoeCausalLM.make_batch computes, without the rotary."""
    kv_len = int(positions.max()) + 1
    starts = tuple(positions[:, 0].tolist())
    windows = {CFG.layer_window(i) for i in range(CFG.num_layers)}
    masks = build_attention_masks(positions, kv_len, windows, cache.ring_windows, starts)
    empty = torch.zeros(*positions.shape, 0)
    decode = positions.shape[1] == 1
    return ForwardBatch(
        positions, rows, torch.tensor(rows), kv_len, masks, empty, empty, cache, decode, starts
    )


def attend(cache: KVCache, layer: int, positions: torch.Tensor, rows: list[int], qkv):
    """SDPA of q [B, heads, T, D] over what `cache` returns for k, v [B, T, kv_heads, D]."""
    q, k, v = qkv
    batch = make_batch(cache, positions, rows)
    k_all, v_all = cache.update(layer, batch, k, v)
    mask, is_causal = batch.mask(CFG.layer_window(layer))
    return F.scaled_dot_product_attention(
        q, k_all, v_all, attn_mask=mask, is_causal=is_causal, enable_gqa=True
    )


class Pair:
    """A ring cache and the reference beside it, fed the same steps; every row starts out
    holding another occupant's (large, random) keys and values."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ring = KVCache(CFG, ROWS, MAX_LEN, torch.float32, keep_prefill_kv=True)
        self.full = KVCache(CFG, ROWS, MAX_LEN, torch.float32, ring=False)
        for cache in (self.ring, self.full):
            for t in cache.k + cache.v:
                t.copy_(torch.randn(t.shape, generator=gen) * 100)
        self.gen = gen

    def step(self, positions: list[list[int]], rows: list[int]) -> None:
        positions_t = torch.tensor(positions)
        B, T = positions_t.shape
        for layer in range(CFG.num_layers):
            shapes = [(B, CFG.num_heads, T, 8), (B, T, 2, 8), (B, T, 2, 8)]
            qkv = [torch.randn(s, generator=self.gen) for s in shapes]
            got = attend(self.ring, layer, positions_t, rows, qkv)
            expected = attend(self.full, layer, positions_t, rows, qkv)
            if CFG.layer_window(layer) is None:  # full layers are as before, bit for bit
                assert torch.equal(got, expected)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    def copy_positions(self, row: int, end: int) -> None:
        """Positions 0 .. end - 1 of `row` written as the prefix cache loads them."""
        for layer in range(CFG.num_layers):
            k, v = (torch.randn(2, end, 8, generator=self.gen) for _ in "kv")
            for cache in (self.ring, self.full):
                cache.write_span(layer, row, 0, k, v)


def test_ring_steps_match_the_cache_of_every_position() -> None:
    pair = Pair()
    pair.step([list(range(10))], [2])  # a prefill longer than the window
    pair.step([list(range(2))], [0])  # shorter: slots 2.. still hold the old occupant's
    pair.copy_positions(1, 9)  # a prefix-cache hit of 9 positions, then its suffix
    pair.step([list(range(9, 14))], [1])
    positions = [2, 14, 10]
    for _ in range(3 * WINDOW + 2):  # rows at different positions, each past 3 windows
        pair.step([[p] for p in positions], [0, 1, 2])
        positions = [p + 1 for p in positions]
    pair.step([[positions[2]], [positions[0]]], [2, 0])  # rows out of order: gathered
    pair.copy_positions(0, 7)  # a whole cached prompt: only its last token is prefilled
    pair.step([[6]], [0])
    pair.step([[7]], [0])


@pytest.mark.parametrize("cached", [2, 6])
def test_a_resumed_chunk_longer_than_the_window(cached: int) -> None:
    # 2: fewer positions than the window before the chunk, the other slots the old occupant's
    pair = Pair()
    pair.copy_positions(0, cached)
    pair.step([list(range(cached, cached + 3 * WINDOW))], [0])
    pair.step([[cached + 3 * WINDOW]], [0])


def test_read_span_gives_the_prefills_own_keys_or_refuses() -> None:
    pair = Pair()
    pair.step([list(range(12))], [1])
    for layer in range(CFG.num_layers):
        got = pair.ring.read_span(layer, 1, 4, 12)
        expected = pair.full.read_span(layer, 1, 4, 12)
        assert all(map(torch.equal, got, expected))
    with pytest.raises(RuntimeError, match="ring of 4 positions"):
        pair.ring.read_span(0, 0, 0, 4)  # row 0 was not in the prefill
    pair.ring.release_prefill_kv()
    with pytest.raises(RuntimeError, match="keep_prefill_kv"):
        pair.ring.read_span(0, 1, 4, 12)
    plain = KVCache(CFG, 1, MAX_LEN, torch.float32)
    with pytest.raises(RuntimeError, match="did not keep"):
        plain.read_span(2, 0, 0, 1)


@pytest.mark.parametrize("ring", [True, False])
@pytest.mark.parametrize("max_len", [3, WINDOW, WINDOW + 1, MAX_LEN])
def test_nbytes_is_what_it_allocates(ring: bool, max_len: int) -> None:
    cache = KVCache(CFG, ROWS, max_len, torch.bfloat16, ring=ring)
    allocated = sum(t.nbytes for t in cache.k + cache.v)
    assert KVCache.nbytes(CFG, ROWS, max_len, torch.bfloat16, ring) == allocated
    assert bool(cache.ring_windows) == (ring and WINDOW < max_len)  # no ring where nothing saved


def test_gpt_oss_120b_kv_bytes() -> None:
    path = ROOT / "benchmarks/configs/gpt-oss-120b.json"
    raw = json.loads(path.read_text())
    cfg = family_for(raw).config_from(raw)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window) == (36, 8, 64, 128)
    every = kv_footprint(cfg, 4096, torch.bfloat16, ring=False)
    ring = kv_footprint(cfg, 4096, torch.bfloat16)
    assert every == KVFootprint(bytes_per_token=73_728, fixed_bytes=0)
    # 18 full layers grow per token; 18 sliding layers hold 128 positions each: 4.5 MiB
    assert ring == KVFootprint(bytes_per_token=36_864, fixed_bytes=18 * 128 * 2 * 8 * 64 * 2)
    assert ring.fixed_bytes == 4.5 * 2**20
    assert KVCache.nbytes(cfg, 16, 4096, torch.bfloat16) == 16 * (4096 * 36_864 + 4.5 * 2**20)
