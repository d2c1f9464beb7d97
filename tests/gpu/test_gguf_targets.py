"""On the accelerator, a Q4_K_M-like GGUF (Q4_K gate/up beside Q6_K down in one layer and Q5_K
down in the other, the experts kept in the file's types) gives one set of greedy tokens on every
decode target with no flags (q8 activations: the accelerator's gathered_moe and the CPU's
kernel compute the same contract), the tokens of the cpu device's `gpu` target (the contract's
torch reference); issue 15's "the same tokens on every decode target" for a downloaded file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gguf_checkpoints import KQUANT_FILE_TYPES, WIDE_QWEN3, random_kquants, write_gguf
from hf_checkpoints import PROMPT_IDS, SHORT_PROMPT_IDS, write_custom_checkpoint
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe.cache_stats import ExpertCacheStats
from hybridmoe.moe.config import OffloadConfig

PROMPTS = [PROMPT_IDS, SHORT_PROMPT_IDS]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
# 2 MoE layers x 4 experts, top-2: 2 slots miss often, and hold either layer's types in turn
TARGETS: dict[str, dict] = {
    "offload-min-slots": dict(decode_target="offload", expert_cache_slots=2),
    "cpu": dict(decode_target="cpu"),
    "hybrid-fetch1": dict(decode_target="hybrid", expert_cache_slots=2, max_fetch=1),
}


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf-q4_k_m")
    hf_dir = write_custom_checkpoint("qwen3_moe", WIDE_QWEN3, root / "hf", seed=0)
    encoder = random_kquants(KQUANT_FILE_TYPES["q4_k_m"])
    return write_gguf(hf_dir, root / "model.gguf", experts=encoder)


def generate(
    path: Path, device: torch.device, **offload
) -> tuple[list[list[int]], ExpertCacheStats]:
    """The greedy tokens of PROMPTS decoded together, and the call's expert counters."""
    config = EngineConfig(dtype="float32", device=str(device), offload=OffloadConfig(**offload))
    with Engine.from_pretrained(path, config) as engine:
        assert all(bank.q8_activations for bank in engine.moe_runtime.banks)
        tokens = engine.generate_ids(PROMPTS, GREEDY)
        return tokens, engine.stats.experts


@pytest.fixture(scope="module")
def reference(q4_k_m_file: Path, device: torch.device) -> list[list[int]]:
    """The `gpu` target's tokens on the accelerator, checked against the cpu device's."""
    tokens, _ = generate(q4_k_m_file, device, decode_target="gpu")
    assert len(set(tokens[0])) > 1, tokens
    assert tokens == generate(q4_k_m_file, torch.device("cpu"), decode_target="gpu")[0]
    return tokens


@pytest.mark.parametrize("name", list(TARGETS))
def test_every_target_gives_the_gpu_targets_tokens(
    q4_k_m_file: Path, device: torch.device, reference: list[list[int]], name: str
) -> None:
    tokens, experts = generate(q4_k_m_file, device, **TARGETS[name])
    assert tokens == reference, name
    if TARGETS[name]["decode_target"] != "cpu":
        assert experts.fetched > 0, name  # slots refilled across the layers' types
    if TARGETS[name]["decode_target"] != "offload":
        assert experts.cpu_routes > 0, name
