"""End to end on the demo model: for a fixed expert format, every decode target and CPU kernel
gives the greedy tokens of the `gpu` target in that format (DESIGN.md: exactness). The
k-quants have no quantiser, so their banks are random block bytes (finite scales) put in by a
test quantiser, on a checkpoint whose widths are whole super-blocks of 256."""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import pytest
import torch
import transformers

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe import config as moe_config
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.quant.bank import ExpertBank, ExpertWeights
from hybridmoe.quant.formats import WEIGHT_FORMATS, weight_format
from random_weights import random_stored

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


# the quantisable formats whose blocks fit the demo's widths (64, 32)
BLOCK_FORMATS = ["bf16", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"]
K_QUANTS = [name for name, fmt in WEIGHT_FORMATS.items() if not fmt.can_quantize]


def assert_every_target_agrees(directory: Path, fmt: str) -> None:
    reference, banks = generate(directory, OffloadConfig(expert_format=fmt))
    assert banks and all(bank.fmt == weight_format(fmt) for bank in banks)
    for offload in TARGETS:
        offload = OffloadConfig(**{**offload.__dict__, "expert_format": fmt})
        tokens, _ = generate(directory, offload)
        assert tokens == reference, offload


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_every_target_agrees_within_a_format(demo_checkpoint: Path, fmt: str) -> None:
    assert_every_target_agrees(demo_checkpoint, fmt)


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE whose hidden and expert widths are 256: one k-quant super-block."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=256, intermediate_size=128, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("wide-qwen3moe")
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(directory)
    return directory


def random_blocks_quantiser(fmt_name: str):
    """A stand-in quantiser for a k-quant: each matrix becomes random block bytes seeded by
    the matrix's own values, so every engine built from one checkpoint gets the same bank."""
    fmt = weight_format(fmt_name)

    def quantize(w: torch.Tensor) -> torch.Tensor:
        seed = zlib.crc32(w.detach().to(torch.float32).contiguous().numpy().tobytes())
        gen = torch.Generator().manual_seed(seed)
        return random_stored(fmt, tuple(w.shape), gen, max_abs=0.1)

    return dataclasses.replace(fmt, quantize_fn=quantize)


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_every_target_agrees_within_a_k_quant(
    wide_checkpoint: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=f"expert_format '{fmt}' has no quantiser"):
        OffloadConfig(expert_format=fmt)
    monkeypatch.setitem(WEIGHT_FORMATS, fmt, random_blocks_quantiser(fmt))
    monkeypatch.setattr(moe_config, "EXPERT_FORMATS", (*moe_config.EXPERT_FORMATS, fmt))
    assert_every_target_agrees(wide_checkpoint, fmt)


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
