"""Resources across many decode steps and at close: no growth of pinned staging buffers, threads,
device or pinned host memory; host expert banks page-locked while the engine lives (or pageable
when asked, with the same tokens) and unlocked by close()."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hf_checkpoints import PROMPT_IDS
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe.config import OffloadConfig

from .decoding import greedy_steps

HYBRID = OffloadConfig(decode_target="hybrid", expert_cache_slots=4, max_fetch=1)
STEPS = 200
WARM_STEPS = 10  # every staging buffer and allocator block exists after these


def hybrid_engine(directory: Path, device: torch.device, **offload) -> Engine:
    config = replace(HYBRID, **offload)
    return Engine.from_pretrained(
        directory, EngineConfig(dtype="float32", device=str(device), offload=config)
    )


def pinned_host_bytes() -> int | None:
    """Bytes held by torch's pinned host allocator (staging buffers); None where this torch
    does not report them."""
    stats_fn = getattr(torch.cuda, "host_memory_stats", None)
    if stats_fn is None:
        return None
    try:
        return stats_fn().get("allocated_bytes.current")
    except RuntimeError:
        return None


def resources(engine: Engine, device: torch.device) -> dict[str, int | None]:
    found: dict[str, int | None] = {"python threads": threading.active_count()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        found["staging sets"] = engine.moe_runtime.cpu_executor.sync.staging_sets
        found["device bytes allocated"] = torch.cuda.memory_allocated(device)
        found["pinned host bytes"] = pinned_host_bytes()
    return found


def test_nothing_grows_across_many_decode_steps(tiny_checkpoint: Path, device) -> None:
    threads_before = threading.active_count()
    engine = hybrid_engine(tiny_checkpoint, device)
    try:
        snapshots = {}
        for step, _ in enumerate(greedy_steps(engine, PROMPT_IDS, STEPS), start=1):
            if step in (WARM_STEPS, STEPS):
                snapshots[step] = resources(engine, device)
        stats = engine.moe_runtime.cache.total_stats()
    finally:
        engine.close()
    print(f"after {WARM_STEPS} and {STEPS} steps: {snapshots}")
    assert snapshots[STEPS] == snapshots[WARM_STEPS]
    assert stats.cpu_routes > 0 and stats.fetched > 0  # both sides of the hybrid step ran
    assert threading.active_count() == threads_before  # close() joined the CPU workers


@pytest.mark.cuda_only
def test_host_banks_are_pinned_until_close(tiny_checkpoint: Path, device) -> None:
    prompts = [PROMPT_IDS]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine = hybrid_engine(tiny_checkpoint, device)
    platform, banks = engine.moe_runtime.platform, engine.moe_runtime.banks
    try:
        assert banks and all(b.gate_up.is_pinned() and b.down.is_pinned() for b in banks)
        assert len(platform._pinned) == 2 * len(banks)
        tokens = engine.generate_ids(prompts, params)
    finally:
        engine.close()
    assert platform._pinned == []  # close() unregistered every bank
    assert not any(b.gate_up.is_pinned() or b.down.is_pinned() for b in banks)
    platform.close()  # idempotent

    with hybrid_engine(tiny_checkpoint, device, pin_memory=False) as pageable:
        runtime = pageable.moe_runtime
        assert not any(b.gate_up.is_pinned() or b.down.is_pinned() for b in runtime.banks)
        assert runtime.platform._pinned == []
        assert pageable.generate_ids(prompts, params) == tokens
