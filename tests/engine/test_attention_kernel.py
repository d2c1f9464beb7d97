"""--attention-kernel end to end: the engine's decode steps attend through the CPU kernel
(kernels/numba_attention.py) on every decode target, which then agree with each other bit for
bit (the kernel's inputs are the same on every target); off, no step calls it. The default,
auto, takes it where it computes SDPA's bits (bfloat16, on a machine whose SDPA it reproduces:
numba_attention.gives_sdpa_bits), so the default's tokens are SDPA's there, and SDPA's
elsewhere. Against SDPA in float32 the kernel is a tolerance (tests/layers/
test_decode_attention.py), so "on" is compared with "off" there where the demo's top two logits
stand at least 0.04 apart at every step (measured), far beyond the kernel's 1e-5."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.kernels import numba_attention
from hybridmoe.moe.config import OffloadConfig

PROMPTS = [[5, 17, 300, 42, 7], [9, 1000]]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
TARGETS = [
    OffloadConfig(decode_target="cpu"),
    OffloadConfig(decode_target="offload", expert_cache_slots=4),
    OffloadConfig(decode_target="hybrid", expert_cache_slots=3, max_fetch=1),
]


def generate(directory: Path, dtype: str, kernel: str, offload: OffloadConfig) -> list[list[int]]:
    config = EngineConfig(dtype=dtype, attention_kernel=kernel, offload=offload)
    with Engine.from_pretrained(directory, config) as engine:
        return engine.generate_ids(PROMPTS, GREEDY)


def demo_heads(directory: Path) -> tuple[int, int, int]:
    with Engine.from_pretrained(directory, EngineConfig()) as engine:
        cfg = engine.model.cfg
        return cfg.num_heads, cfg.num_kv_heads, cfg.head_dim


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_target_gives_the_kernels_tokens(
    demo_checkpoint: Path, dtype: str, attention_kernel_calls: list[int]
) -> None:
    reference = generate(demo_checkpoint, dtype, "on", TARGETS[0])
    calls = attention_kernel_calls
    assert calls and max(calls) == len(PROMPTS)  # both rows in one call
    for offload in TARGETS[1:]:
        assert generate(demo_checkpoint, dtype, "on", offload) == reference, offload
    if dtype == "float32":
        assert generate(demo_checkpoint, dtype, "off", TARGETS[0]) == reference


def test_off_calls_no_kernel(demo_checkpoint: Path, attention_kernel_calls: list[int]) -> None:
    generate(demo_checkpoint, "bfloat16", "off", TARGETS[0])
    assert attention_kernel_calls == []


def test_auto_by_default_where_the_bits_are_sdpas(
    demo_checkpoint: Path, attention_kernel_calls: list[int]
) -> None:
    """auto, the default: float32 on SDPA; bfloat16 on the kernel exactly where it gives
    SDPA's bits, and then the same tokens as SDPA's (off) on every target, batched."""
    assert EngineConfig().attention_kernel == "auto"
    generate(demo_checkpoint, "float32", "auto", TARGETS[0])
    assert attention_kernel_calls == []
    sdpa = generate(demo_checkpoint, "bfloat16", "off", TARGETS[0])
    exact = numba_attention.gives_sdpa_bits(*demo_heads(demo_checkpoint))
    for offload in TARGETS:
        assert generate(demo_checkpoint, "bfloat16", "auto", offload) == sdpa, offload
    assert bool(attention_kernel_calls) == exact


def test_a_bad_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="attention_kernel must be one of auto, on, off"):
        EngineConfig(attention_kernel="yes")
