"""--attention-kernel end to end: the engine's decode steps attend through the CPU kernel
(kernels/numba_attention.py) on every decode target, which then agree with each other bit for
bit (the kernel's inputs are the same on every target); off, the default, no step calls it.
Against SDPA the kernel is a tolerance (tests/layers/test_decode_attention.py), so the tokens
are compared with the default's only in float32, where the demo's top two logits stand at
least 0.04 apart at every step (measured), far beyond the kernel's 1e-5."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe.config import OffloadConfig

PROMPTS = [[5, 17, 300, 42, 7], [9, 1000]]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
TARGETS = [
    OffloadConfig(decode_target="cpu"),
    OffloadConfig(decode_target="offload", expert_cache_slots=4),
    OffloadConfig(decode_target="hybrid", expert_cache_slots=3, max_fetch=1),
]


def generate(directory: Path, dtype: str, kernel: bool, offload: OffloadConfig) -> list[list[int]]:
    config = EngineConfig(dtype=dtype, attention_kernel=kernel, offload=offload)
    with Engine.from_pretrained(directory, config) as engine:
        return engine.generate_ids(PROMPTS, GREEDY)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_target_gives_the_kernels_tokens(
    demo_checkpoint: Path, dtype: str, attention_kernel_calls: list[int]
) -> None:
    reference = generate(demo_checkpoint, dtype, True, TARGETS[0])
    calls = attention_kernel_calls
    assert calls and max(calls) == len(PROMPTS)  # both rows in one call
    for offload in TARGETS[1:]:
        assert generate(demo_checkpoint, dtype, True, offload) == reference, offload
    if dtype == "float32":
        assert generate(demo_checkpoint, dtype, False, TARGETS[0]) == reference


def test_off_by_default(demo_checkpoint: Path, attention_kernel_calls: list[int]) -> None:
    assert EngineConfig().attention_kernel is False
    generate(demo_checkpoint, "bfloat16", False, TARGETS[0])
    assert attention_kernel_calls == []
