"""MoeRuntime.close() alone releases the expert slots: nothing it owns forms a reference cycle
that would keep them (device memory on an accelerator) until a garbage collection."""

from __future__ import annotations

import gc
import weakref

import pytest

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.models.loading import load_model
from hybridmoe.moe.config import OffloadConfig


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("target", ["offload", "hybrid"])
def test_close_releases_the_slots_without_a_garbage_collection(demo_checkpoint, no_gc, target):
    offload = OffloadConfig(decode_target=target, expert_cache_slots=4, max_fetch=1)
    engine = Engine(load_model(demo_checkpoint), None, EngineConfig(offload=offload))
    engine.generate_ids([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    cache = engine.moe_runtime.cache
    slots = [weakref.ref(cache.slot_bank.gate_up), weakref.ref(cache.slot_bank.down)]
    cache_ref = weakref.ref(cache)
    del cache
    engine.close()
    # the engine object is still alive, and nothing it owned keeps the cache in a cycle
    assert cache_ref() is None and [ref() for ref in slots] == [None, None]


def test_a_closed_cache_holds_no_slots_even_when_referenced(demo_checkpoint, no_gc):
    offload = OffloadConfig(decode_target="offload", expert_cache_slots=4)
    engine = Engine(load_model(demo_checkpoint), None, EngineConfig(offload=offload))
    cache = engine.moe_runtime.cache
    slots = [weakref.ref(cache.slot_bank.gate_up), weakref.ref(cache.slot_bank.down)]
    engine.close()
    assert [ref() for ref in slots] == [None, None]
