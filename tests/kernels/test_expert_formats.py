"""End to end on the demo model: for a fixed expert format, every decode target and CPU kernel
gives the greedy tokens of the `gpu` target in that format (DESIGN.md: exactness)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.quant.bank import ExpertBank, ExpertWeights
from hybridmoe.quant.formats import weight_format

PROMPTS = [[5, 17, 300, 42, 7], [9, 1000]]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
TARGETS = [
    OffloadConfig(decode_target="cpu"),
    OffloadConfig(decode_target="cpu", cpu_kernel="torch"),
    OffloadConfig(decode_target="cpu", cpu_threads=1),
    OffloadConfig(decode_target="offload", expert_cache_slots=4),
    OffloadConfig(decode_target="hybrid", expert_cache_slots=3, max_fetch=1),
    OffloadConfig(decode_target="hybrid", expert_cache_slots=1, max_fetch=0),
]


def generate(directory: Path, offload: OffloadConfig) -> tuple[list[list[int]], list[ExpertBank]]:
    """Greedy tokens of PROMPTS, and the runtime's banks (close() releases them)."""
    with Engine.from_pretrained(directory, EngineConfig(dtype="float32", offload=offload)) as e:
        return e.generate_ids(PROMPTS, GREEDY), e.moe_runtime.banks


@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_0"])
def test_every_target_agrees_within_a_format(demo_checkpoint: Path, fmt: str) -> None:
    reference, banks = generate(demo_checkpoint, OffloadConfig(expert_format=fmt))
    assert banks and all(bank.fmt == weight_format(fmt) for bank in banks)
    for offload in TARGETS:
        offload = OffloadConfig(**{**offload.__dict__, "expert_format": fmt})
        tokens, _ = generate(demo_checkpoint, offload)
        assert tokens == reference, offload


def test_quantised_experts_change_the_model_only_slightly(demo_checkpoint: Path) -> None:
    f32, _ = generate(demo_checkpoint, OffloadConfig())
    q8, _ = generate(demo_checkpoint, OffloadConfig(decode_target="cpu", expert_format="q8_0"))
    assert q8[0][:3] == f32[0][:3]  # near-ties may flip later, and the paths diverge from there


def test_converted_banks_replace_the_float_experts(demo_checkpoint: Path) -> None:
    offload = OffloadConfig(decode_target="cpu", expert_format="q4_0")
    with Engine.from_pretrained(demo_checkpoint, EngineConfig(offload=offload)) as engine:
        assert all(bank.gate_up.dtype == torch.uint8 for bank in engine.moe_runtime.banks)
        for layer in engine.model.moe_layers:  # no float copy of the experts stays reachable
            assert not any(isinstance(v, ExpertWeights) for v in vars(layer.experts).values())
