"""The hybrid target fetches at most `max_fetch` experts per MoE layer call, and copies no more
than those experts' tensors to the device."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hf_checkpoints import PROMPT_IDS, SHORT_PROMPT_IDS
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe.config import OffloadConfig

TENSORS_PER_EXPERT = 2  # gate_up and down


@pytest.mark.parametrize("max_fetch", [1, 2])
def test_fetches_per_layer_call_never_exceed_the_cap(tiny_checkpoint: Path, device, max_fetch):
    # prefill on the CPU: the only copies are decode's fetches
    offload = OffloadConfig(
        decode_target="hybrid", expert_cache_slots=6, max_fetch=max_fetch, prefill="cpu"
    )
    config = EngineConfig(dtype="float32", device=str(device), offload=offload)
    calls: list[tuple[int, int]] = []  # per ensure_experts_hybrid call: (fetched, CPU routes)
    copies_per_call: list[int] = []
    with Engine.from_pretrained(tiny_checkpoint, config) as engine:
        cache = engine.moe_runtime.cache
        ensure, start_copies = cache.ensure_experts_hybrid, cache.platform.start_copies

        def recording_ensure(layer_idx, topk_ids):
            before = replace(cache.stats_by_layer[layer_idx])
            cpu_routes = ensure(layer_idx, topk_ids)
            after = cache.stats_by_layer[layer_idx]
            assert cpu_routes == after.cpu_routes - before.cpu_routes
            calls.append((after.fetched - before.fetched, cpu_routes))
            return cpu_routes

        def recording_start_copies(copies):
            copies_per_call.append(len(copies))
            return start_copies(copies)

        cache.ensure_experts_hybrid = recording_ensure  # shadows the method on this instance
        cache.platform.start_copies = recording_start_copies
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        engine.generate_ids([PROMPT_IDS, SHORT_PROMPT_IDS], params)
    assert calls and len(copies_per_call) == len(calls)
    assert max(fetched for fetched, _ in calls) <= max_fetch, calls
    assert max(copies_per_call) <= TENSORS_PER_EXPERT * max_fetch, copies_per_call
    # the cap was reached while other misses went to the CPU: it bound, not just held
    assert any(fetched == max_fetch and cpu > 0 for fetched, cpu in calls), calls
