"""gpt-oss's sliding layers as rings of `sliding_window` positions per row (engine/kv_cache.py)
against `transformers` on its tiny random checkpoints (windows of 5 and 8): decoding past
three windows, a row reused after another sequence, continuous batching of requests at
different positions, and the prefix cache with cached prefixes longer than the window. The
logits of decode steps against those over a cache of every position, their reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_checkpoints import (
    ORACLE_CASES,
    PROMPT_IDS,
    SHORT_PROMPT_IDS,
    hf_greedy,
    write_hf_checkpoint,
)
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.engine.placement import plan_device_memory
from hybridmoe.models.loading import load_hf_model
from hybridmoe.platform.cpu import CpuPlatform

CASES = [case for case in ORACLE_CASES if case[0] == "gpt_oss"]
LONG = 36  # decode steps: past 3 windows of 8 (and 7 of 5) after a 12-token prompt


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def checkpoint(request, tmp_path_factory) -> Path:
    return write_hf_checkpoint(*request.param, tmp_path_factory.mktemp("gpt-oss-ring"))


def window(engine: Engine) -> int:
    return engine.model.cfg.sliding_window


def test_decoding_past_three_windows_gives_transformers_tokens(checkpoint) -> None:
    config = EngineConfig(dtype="float32", max_seq_len=64)
    with Engine.from_pretrained(checkpoint, config) as engine:
        assert engine.scheduler.cache.ring_windows == {window(engine)}
        assert LONG + len(PROMPT_IDS) > 3 * window(engine)
        got = engine.generate_ids([PROMPT_IDS], greedy(LONG))
    assert got == [hf_greedy(checkpoint, PROMPT_IDS, LONG)]


def decode_logits(model, prompt: list[int], tokens: list[int], ring: bool) -> torch.Tensor:
    """[len(tokens), V] logits of decode steps feeding `tokens` after the prompt, in row 1
    of a cache whose rows first held another sequence."""
    cache = KVCache(model.cfg, 2, 64, model.dtype, ring=ring)
    for row, ids in ((1, [7] * 30), (1, prompt)):  # the second prefill reuses the row
        batch = model.make_batch(torch.arange(len(ids))[None], [row], cache)
        model.forward(torch.tensor([ids]), batch)
    rows = []
    for i, token in enumerate(tokens):
        batch = model.make_batch(torch.tensor([[len(prompt) + i]]), [1], cache, is_decode=True)
        rows.append(model.forward(torch.tensor([[token]]), batch)[0])
    return torch.stack(rows)


def test_ring_logits_are_those_of_every_position(checkpoint) -> None:
    with Engine.from_pretrained(checkpoint, EngineConfig(dtype="float32")) as engine:
        tokens = list(range(3, 3 + LONG))
        ring = decode_logits(engine.model, SHORT_PROMPT_IDS, tokens, ring=True)
        every = decode_logits(engine.model, SHORT_PROMPT_IDS, tokens, ring=False)
    torch.testing.assert_close(ring, every, atol=1e-5, rtol=1e-5)


def test_a_reused_row_gives_the_tokens_of_a_fresh_one(checkpoint) -> None:
    # one row: the short prompt (shorter than the window) follows a sequence that filled
    # the whole ring, whose keys must not be seen
    config = EngineConfig(dtype="float32", max_batch=1, max_seq_len=64)
    with Engine.from_pretrained(checkpoint, config) as engine:
        first = engine.generate_ids([PROMPT_IDS], greedy(LONG))
        short = SHORT_PROMPT_IDS[:3]
        assert len(short) < window(engine)
        second = engine.generate_ids([short], greedy(20))
    assert first == [hf_greedy(checkpoint, PROMPT_IDS, LONG)]
    assert second == [hf_greedy(checkpoint, short, 20)]


def test_continuous_batching_of_requests_at_different_positions(checkpoint) -> None:
    # two rows: the third request waits for the first's row and joins the second mid-decode
    requests = [(PROMPT_IDS, 6), (SHORT_PROMPT_IDS, 30), (PROMPT_IDS[::-1] + [44] * 8, 20)]
    config = EngineConfig(dtype="float32", max_batch=2, max_seq_len=64)
    outputs: dict[int, list] = {}
    with Engine.from_pretrained(checkpoint, config) as engine:
        scheduler = engine.scheduler
        seqs = [engine.new_sequence(p, greedy(n), with_text=False) for p, n in requests]
        for i, seq in enumerate(seqs):
            scheduler.submit(seq, lambda out, i=i: outputs.setdefault(i, []).append(out))
        while not scheduler.idle:
            scheduler.step()
        got = [seq.output_ids for seq in seqs]
    assert all(out[-1].finished and out[-1].error is None for out in outputs.values())
    assert got == [hf_greedy(checkpoint, p, n) for p, n in requests]


def test_prefix_cache_with_prefixes_longer_than_the_window(checkpoint) -> None:
    # 32 cached positions (4 to 6 windows) restore the ring for the prefix's end; the prompt
    # of whole blocks prefills only its last token again
    shared = [3 + i % 90 for i in range(32)]
    prompts = [shared + [5, 9, 11], shared + [60, 61, 62, 63, 64, 65], shared]
    config = EngineConfig(dtype="float32", max_seq_len=64, prefix_cache_tokens=256)
    with Engine.from_pretrained(checkpoint, config) as engine:
        got = [engine.generate_ids([p], greedy(12)) for p in prompts]
        assert engine.scheduler.stats().cached_prompt_tokens == 32 + 31
    assert got == [[hf_greedy(checkpoint, p, 12)] for p in prompts]


def test_the_memory_plan_counts_the_rings(checkpoint) -> None:
    model = load_hf_model(checkpoint)
    config = EngineConfig(gpu_memory=1.0, max_batch=4, max_seq_len=64, prefix_cache_tokens=0)
    plan = plan_device_memory(model, config, CpuPlatform())
    cfg, dtype = model.cfg, model.dtype
    assert (
        plan.kv_bytes
        == KVCache.nbytes(cfg, 4, 64, dtype)
        < KVCache.nbytes(cfg, 4, 64, dtype, ring=False)
    )
    allocated = KVCache(cfg, 4, 64, dtype)
    assert plan.kv_bytes == sum(t.nbytes for t in allocated.k + allocated.v)
