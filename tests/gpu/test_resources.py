"""Resources across many decode steps and at close: no growth of pinned staging buffers, threads,
device or pinned host memory; host expert banks page-locked while the engine lives (or pageable
when asked, with the same tokens) and unlocked by close(), after the copies that read them, or
before their memory is freed; a refused registration leaves no error behind for torch."""

from __future__ import annotations

import gc
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hf_checkpoints import PROMPT_IDS
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.errors import PinnedMemoryError
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.platform.base import create_platform
from hybridmoe.platform.cuda import CudaRuntime

from .decoding import greedy_steps
from .device_helpers import spin, spin_cycles

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
        assert platform.pinned_regions == 2 * len(banks)
        tokens = engine.generate_ids(prompts, params)
    finally:
        engine.close()
    assert platform.pinned_regions == 0  # close() unregistered every bank
    assert not any(b.gate_up.is_pinned() or b.down.is_pinned() for b in banks)
    platform.close()  # idempotent

    with hybrid_engine(tiny_checkpoint, device, pin_memory=False) as pageable:
        runtime = pageable.moe_runtime
        assert not any(b.gate_up.is_pinned() or b.down.is_pinned() for b in runtime.banks)
        assert runtime.platform.pinned_regions == 0
        assert pageable.generate_ids(prompts, params) == tokens


def kernel_runs(device: torch.device) -> bool:
    """A kernel launch succeeds: torch's launch check finds no error left by an earlier call."""
    return (torch.ones(8, device=device) * 2).sum().item() == 16


@pytest.mark.cuda_only
def test_a_bank_freed_before_close_is_unregistered_first(device) -> None:
    platform = create_platform(device)
    try:
        bank = platform.pin(torch.randn(1 << 20))
        ptr = bank.untyped_storage().data_ptr()
        assert bank.is_pinned() and platform.pinned_regions == 1
        del bank
        gc.collect()
        assert platform.pinned_regions == 0
        assert CudaRuntime(device).unregister(ptr) != 0  # the finalizer already did
        assert kernel_runs(device)  # and that refusal's error was cleared
    finally:
        platform.close()


@pytest.mark.cuda_only
def test_a_refused_registration_leaves_no_error_for_the_next_kernel(device) -> None:
    runtime = CudaRuntime(device)
    bank = torch.randn(1 << 20)
    ptr, half = bank.untyped_storage().data_ptr(), bank.nbytes // 2
    assert runtime.register(ptr + half, half) == 0  # part of the bank, locked by someone else
    platform = create_platform(device)
    try:
        with pytest.raises(PinnedMemoryError, match="--no-pin-memory"):
            platform.pin(bank)
        assert platform.pinned_regions == 0
        assert kernel_runs(device)
    finally:
        platform.close()
        assert runtime.unregister(ptr + half) == 0


@pytest.mark.cuda_only
def test_close_waits_for_the_copies_that_read_a_bank(device) -> None:
    platform = create_platform(device)
    bank = platform.pin(torch.randn(1 << 22))
    dst = torch.empty(1 << 22, device=device)
    spin(platform.copy_stream, spin_cycles(device, 0.05))  # the copy queues behind it
    platform.start_copies([(bank, dst)])
    platform.close()
    assert platform.copy_stream.query(), "close() unlocked the bank while a copy was queued"
    assert platform.pinned_regions == 0 and not bank.is_pinned()
    assert torch.equal(dst.cpu(), bank)
