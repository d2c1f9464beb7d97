"""End to end: every decode target gives the reference's greedy tokens and logits, for every
supported family, cache size and fetch cap."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_checkpoints import PROMPT_IDS, SHORT_PROMPT_IDS, write_hf_checkpoint
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.errors import CpuExpertError
from hybridmoe.moe.config import OffloadConfig

FAMILY_CASES = [
    ("qwen3_moe", "gqa_head_dim"),
    ("qwen2_moe", "shared_expert"),
    ("mixtral", "gqa"),
    ("olmoe", "gqa_clip_qkv"),
]
N_TOKENS = 12
GREEDY = SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)
LOGITS_ATOL = LOGITS_RTOL = 1e-4  # fp32; only summation order may differ between targets


def decode_logits(engine: Engine, prompt: list[int], steps: int) -> torch.Tensor:
    """[steps, V] logits of greedy decode steps after the prompt, through the decode path."""
    model = engine.model
    cache = KVCache(model.cfg, 1, len(prompt) + steps + 1, model.dtype)
    batch = model.make_batch(torch.arange(len(prompt))[None], [0], cache)
    token = int(model.forward(torch.tensor([prompt]), batch).argmax())
    rows = []
    for i in range(steps):
        positions = torch.tensor([[len(prompt) + i]])
        batch = model.make_batch(positions, [0], cache, is_decode=True)
        logits = model.forward(torch.tensor([[token]]), batch)  # [1, V]
        rows.append(logits[0])
        token = int(logits.argmax())
    return torch.stack(rows)


def offload_configs(top_k: int, total_experts: int) -> list[OffloadConfig]:
    mid = max(top_k, total_experts // 2)
    configs = [OffloadConfig(decode_target="cpu")]
    for slots in sorted({top_k, mid, total_experts}):
        configs.append(OffloadConfig(decode_target="offload", expert_cache_slots=slots))
    for slots in sorted({1, mid, total_experts}):
        for max_fetch in sorted({0, 1, top_k}):
            configs.append(
                OffloadConfig(decode_target="hybrid", expert_cache_slots=slots, max_fetch=max_fetch)
            )
    return configs


def _id(config: OffloadConfig) -> str:
    return f"{config.decode_target}-s{config.expert_cache_slots}-f{config.max_fetch}"


@pytest.fixture(scope="module", params=FAMILY_CASES, ids=lambda case: "/".join(case))
def reference(request, tmp_path_factory) -> tuple[Path, list[list[int]], torch.Tensor]:
    directory = write_hf_checkpoint(*request.param, tmp_path_factory.mktemp("ckpt"))
    with Engine.from_pretrained(directory, EngineConfig(dtype="float32")) as engine:
        tokens = engine.generate_ids([PROMPT_IDS, SHORT_PROMPT_IDS], GREEDY)
        logits = decode_logits(engine, PROMPT_IDS, N_TOKENS)
    return directory, tokens, logits


def test_every_target_matches_the_reference(reference) -> None:
    directory, ref_tokens, ref_logits = reference
    with Engine.from_pretrained(directory, EngineConfig(dtype="float32")) as probe:
        top_k = probe.model.cfg.top_k
        total = probe.model.cfg.num_experts * len(probe.model.cfg.moe_layer_ids)
    for offload in offload_configs(top_k, total):
        config = EngineConfig(dtype="float32", offload=offload)
        with Engine.from_pretrained(directory, config) as engine:
            assert engine.generate_ids([PROMPT_IDS, SHORT_PROMPT_IDS], GREEDY) == ref_tokens, _id(
                offload
            )
            logits = decode_logits(engine, PROMPT_IDS, N_TOKENS)
            max_diff = (logits - ref_logits).abs().max().item()
            torch.testing.assert_close(
                logits,
                ref_logits,
                atol=LOGITS_ATOL,
                rtol=LOGITS_RTOL,
                msg=lambda m, o=offload, d=max_diff: f"{_id(o)}: max |diff| {d:.2e}\n{m}",
            )


def test_hybrid_stats_account_for_every_route(demo_checkpoint: Path) -> None:
    offload = OffloadConfig(decode_target="hybrid", expert_cache_slots=3, max_fetch=1)
    with Engine.from_pretrained(demo_checkpoint, EngineConfig(offload=offload)) as engine:
        engine.generate_ids([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=6, ignore_eos=True))
        stats = engine.stats.experts
        cfg = engine.model.cfg
        decode_routes = engine.stats.decode_tokens * cfg.top_k * len(cfg.moe_layer_ids)
        assert stats.routes == decode_routes
        assert stats.hits + stats.fetched_routes + stats.cpu_routes == stats.routes
        assert stats.cpu_routes > 0 and stats.fetched > 0
        assert "hit rate" in engine.stats.summary() and "CPU routes" in engine.stats.summary()


@pytest.mark.parametrize("target", ["cpu", "hybrid"])
def test_failing_cpu_worker_raises_and_engine_recovers(demo_checkpoint: Path, target) -> None:
    offload = OffloadConfig(decode_target=target, expert_cache_slots=2, max_fetch=0)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with Engine.from_pretrained(demo_checkpoint, EngineConfig(offload=offload)) as engine:
        expected = engine.generate_ids([[5, 6, 7]], params)
        executor = engine.moe_runtime.cpu_executor
        working = executor.expert_fn

        def broken(*args):
            raise RuntimeError("simulated kernel fault")

        executor.expert_fn = broken
        with pytest.raises(CpuExpertError, match="layer 0"):
            engine.generate_ids([[5, 6, 7]], params)
        executor.expert_fn = working
        assert engine.generate_ids([[5, 6, 7]], params) == expected


def test_offload_refuses_too_few_slots(demo_checkpoint: Path) -> None:
    offload = OffloadConfig(decode_target="offload", expert_cache_slots=1)
    with pytest.raises(ValueError, match="expert_cache_slots=1"):
        Engine.from_pretrained(demo_checkpoint, EngineConfig(offload=offload))
