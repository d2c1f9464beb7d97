"""KVCache.update's decode-step writes on the host (numba_attention.write_step: the attention
kernel's writes alone) against the indexed assignment they replace, bit for bit: float32 and
bfloat16, rows out of order and at different positions, k and v as the stacked projection's
split views (rows apart in memory) or contiguous; the write is taken (no index_put) where it
applies and the torch path elsewhere (prefill, ring layers, HYBRIDMOE_GLUE_KERNELS=0), with
the same caches."""

from __future__ import annotations

import pytest
import torch

import hybridmoe.models  # noqa: F401  (registers the families)
from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.models.registry import family_for
from op_counting import CountingOps

ROWS, MAX_LEN = 4, 24


def config(window: int | None = None):
    raw = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "moe_intermediate_size": 16,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "vocab_size": 10,
    }
    if window is not None:  # gpt-oss: a sliding layer (a ring) and a full one
        raw.update(architectures=["GptOssForCausalLM"], intermediate_size=16, sliding_window=window)
        raw.update(num_local_experts=2, layer_types=["sliding_attention", "full_attention"])
    return family_for(raw).config_from(raw)


def batch_of(cache: KVCache, positions: list[list[int]], rows: list[int]):
    from hybridmoe.layers.batch import ForwardBatch, build_attention_masks

    positions_t = torch.tensor(positions)
    kv_len = int(positions_t.max()) + 1
    starts = tuple(positions_t[:, 0].tolist())
    masks = build_attention_masks(positions_t, kv_len, {None}, cache.ring_windows, starts)
    empty = torch.zeros(*positions_t.shape, 0)
    decode = positions_t.shape[1] == 1
    return ForwardBatch(
        positions_t, rows, torch.tensor(rows), kv_len, masks, empty, empty, cache, decode, starts
    )


def step_kv(cfg, B: int, T: int, dtype: torch.dtype, split: bool, gen: torch.Generator):
    """k, v [B, T, kv_heads, D]: views of one stacked q/k/v row (rows apart) or contiguous."""
    kv = cfg.num_kv_heads * cfg.head_dim
    if split:
        stacked = torch.randn(B, T, cfg.num_heads * cfg.head_dim + 2 * kv, generator=gen)
        _, k, v = stacked.to(dtype).split([cfg.num_heads * cfg.head_dim, kv, kv], dim=-1)
    else:
        k, v = (torch.randn(B, T, kv, generator=gen).to(dtype) for _ in "kv")
    shape = (B, T, cfg.num_kv_heads, cfg.head_dim)
    return k.view(shape), v.view(shape)


def filled(cfg, dtype: torch.dtype, gen: torch.Generator, **kwargs) -> KVCache:
    cache = KVCache(cfg, ROWS, MAX_LEN, dtype, **kwargs)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=gen))  # an old occupant's keys
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("split", [True, False], ids=["split", "contiguous"])
def test_decode_writes_are_the_indexed_assignment(dtype: torch.dtype, split: bool) -> None:
    cfg, gen = config(), torch.Generator().manual_seed(1)
    cache = filled(cfg, dtype, gen)
    expected_k = [t.clone() for t in cache.k]
    expected_v = [t.clone() for t in cache.v]
    for positions, rows in (([[5], [0], [17]], [2, 0, 3]), ([[6]], [1]), ([[23], [1]], [3, 1])):
        batch = batch_of(cache, positions, rows)
        for layer in range(cfg.num_layers):
            k, v = step_kv(cfg, len(rows), 1, dtype, split, gen)
            row_col = batch.row_index[:, None]
            expected_k[layer][row_col, :, batch.positions] = k
            expected_v[layer][row_col, :, batch.positions] = v
            with CountingOps() as counted:
                k_all, v_all = cache.update(layer, batch, k, v)
            assert "aten.index_put_.default" not in counted.ops, counted.ops  # the kernel's
            assert torch.equal(cache.k[layer], expected_k[layer])
            assert torch.equal(cache.v[layer], expected_v[layer])
            kv_len = batch.kv_len
            assert torch.equal(k_all, expected_k[layer][rows][:, :, :kv_len])
            assert torch.equal(v_all, expected_v[layer][rows][:, :, :kv_len])


def test_prefill_and_ring_layers_keep_the_torch_path() -> None:
    cfg, gen = config(window=4), torch.Generator().manual_seed(2)
    cache = filled(cfg, torch.bfloat16, gen)
    assert list(cache.ring_sizes) == [0]  # the sliding layer
    reference = KVCache(cfg, ROWS, MAX_LEN, torch.bfloat16)
    for mine, theirs in zip(cache.k + cache.v, reference.k + reference.v, strict=True):
        theirs.copy_(mine)
    for positions, rows in (([[0, 1, 2]], [1]), ([[3]], [1])):  # a prefill, then decode steps
        batch = batch_of(cache, positions, rows)
        for layer in range(cfg.num_layers):
            B, T = len(rows), len(positions[0])
            k, v = step_kv(cfg, B, T, torch.bfloat16, True, gen)
            with CountingOps() as counted:
                cache.update(layer, batch, k, v)
            if layer not in cache.ring_sizes:  # the full layer: the plain assignment
                took_torch = "aten.index_put_.default" in counted.ops
                assert took_torch == (T > 1), (layer, T, counted.ops)
                row_col = batch.row_index[:, None]
                reference.k[layer][row_col, :, batch.positions] = k
                reference.v[layer][row_col, :, batch.positions] = v
                assert torch.equal(cache.k[layer], reference.k[layer])
                assert torch.equal(cache.v[layer], reference.v[layer])


def test_switched_off_with_the_glue_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridmoe import env

    cfg, gen = config(), torch.Generator().manual_seed(3)
    cache = filled(cfg, torch.bfloat16, gen)
    batch = batch_of(cache, [[4]], [0])
    k, v = step_kv(cfg, 1, 1, torch.bfloat16, True, gen)
    monkeypatch.setenv("HYBRIDMOE_GLUE_KERNELS", "0")
    env.reread_switches()
    try:
        with CountingOps() as counted:
            cache.update(0, batch, k, v)
    finally:
        monkeypatch.delenv("HYBRIDMOE_GLUE_KERNELS")
        env.reread_switches()
    assert "aten.index_put_.default" in counted.ops
    assert torch.equal(cache.k[0][0, :, 4], k[0, 0]) and torch.equal(cache.v[0][0, :, 4], v[0, 0])
