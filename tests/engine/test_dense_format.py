"""--dense-format: the dense projections quantised at load, computed from the same stored
values by the CPU kernel (decode steps) and by torch (prefill, or HYBRIDMOE_DENSE_KERNEL=0),
so every decode target gives the same tokens within a format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridmoe import env
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe.config import OffloadConfig

PROMPTS = [[5, 17, 300, 42, 7], [9, 1000]]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
TARGETS = [
    OffloadConfig(decode_target="cpu"),
    OffloadConfig(decode_target="cpu", cpu_kernel="torch"),
    OffloadConfig(decode_target="offload", expert_cache_slots=4),
    OffloadConfig(decode_target="hybrid", expert_cache_slots=3, max_fetch=1),
]


def generate(directory: Path, dense_format: str, offload: OffloadConfig) -> list[list[int]]:
    config = EngineConfig(dtype="float32", dense_format=dense_format, offload=offload)
    with Engine.from_pretrained(directory, config) as engine:
        return engine.generate_ids(PROMPTS, GREEDY)


def last_logits(directory: Path, dense_format: str) -> torch.Tensor:
    config = EngineConfig(dtype="float32", dense_format=dense_format)
    with Engine.from_pretrained(directory, config) as engine:
        return engine.model.logits(PROMPTS[0])[-1]  # [V]


@pytest.mark.parametrize("dense_format", ["q8_0", "q4_0"])
def test_projections_are_stored_in_the_format(demo_checkpoint: Path, dense_format: str):
    config = EngineConfig(dtype="float32", dense_format=dense_format)
    with Engine.from_pretrained(demo_checkpoint, config) as engine:
        model = engine.model
        for layer in model.layers:
            assert {p.fmt.name for p in layer.projections()} == {dense_format}
        for moe in model.moe_layers:
            assert moe.router.gate.fmt.name == "f32"  # the router stays as loaded
        assert model.moe_layers and len(model.moe_layers) < len(model.layers)  # dense MLPs too
        assert model.lm_head.fmt.name == "q8_0"  # q4_0's head too, as llama.cpp keeps it
        assert model.embed.dtype.is_floating_point


@pytest.mark.parametrize("dense_format", ["q8_0", "q4_0"])
def test_every_target_agrees_within_a_dense_format(
    demo_checkpoint: Path, dense_format: str, monkeypatch: pytest.MonkeyPatch
):
    reference = generate(demo_checkpoint, dense_format, TARGETS[0])
    moved = last_logits(demo_checkpoint, dense_format) - last_logits(demo_checkpoint, "auto")
    assert float(moved.abs().max()) > 1e-3  # the weights are quantised: it shows
    for offload in TARGETS[1:]:
        assert generate(demo_checkpoint, dense_format, offload) == reference, offload
    monkeypatch.setenv("HYBRIDMOE_DENSE_KERNEL", "0")  # torch's dequantise-then-matmul
    env.reread_switches()
    assert generate(demo_checkpoint, dense_format, TARGETS[0]) == reference


def test_dense_kernel_keeps_the_tokens_of_torch(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
):
    kernel = generate(demo_checkpoint, "auto", TARGETS[0])
    monkeypatch.setenv("HYBRIDMOE_DENSE_KERNEL", "0")
    env.reread_switches()
    assert generate(demo_checkpoint, "auto", TARGETS[0]) == kernel


def test_unknown_dense_format_is_refused():
    with pytest.raises(ValueError, match="dense_format must be one of auto, q8_0, q4_0"):
        EngineConfig(dense_format="q6_k")
