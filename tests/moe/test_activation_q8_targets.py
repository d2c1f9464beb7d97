"""With activation_quant q8, every decode target gives the `resident` target's greedy tokens
(its experts through bank_moe, the torch reference of the q8 contract), on a q8_0 model: the
cpu target's numba q8 kernel, offload's and hybrid's slot banks beside it."""

from __future__ import annotations

import pytest
import torch

from hf_checkpoints import PROMPT_IDS, SHORT_PROMPT_IDS, write_hf_checkpoint
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.moe.cpu_experts import fused_cpu_moe
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.formats import weight_format

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
Q8 = dict(expert_format="q8_0", activation_quant="q8")
TARGETS = [
    OffloadConfig(decode_target="cpu", **Q8),
    OffloadConfig(decode_target="offload", expert_cache_slots=4, **Q8),
    OffloadConfig(decode_target="hybrid", expert_cache_slots=2, max_fetch=1, **Q8),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """hidden 64, expert width 32: whole 32-blocks for q8_0. The q8 kernel is compiled here
    first, outside the CPU executor's timeout (a cold compile on a busy machine can take
    minutes)."""
    fmt = weight_format("q8_0")
    bank = ExpertBank(
        fmt.quantize(torch.zeros(1, 64, 32)), fmt.quantize(torch.zeros(1, 32, 32)), fmt
    ).with_activation_quant("q8")
    fused_cpu_moe(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1), bank)
    return write_hf_checkpoint("qwen3_moe", "mlp_only_tied", tmp_path_factory.mktemp("ckpt"))


def _tokens(directory, offload: OffloadConfig) -> list[list[int]]:
    config = EngineConfig(dtype="float32", offload=offload)
    with Engine.from_pretrained(directory, config) as engine:
        return engine.generate_ids([PROMPT_IDS, SHORT_PROMPT_IDS], GREEDY)


def test_every_target_gives_the_reference_tokens(checkpoint) -> None:
    reference = _tokens(checkpoint, OffloadConfig(decode_target="resident", **Q8))
    for offload in TARGETS:
        assert _tokens(checkpoint, offload) == reference, offload.decode_target


def test_the_banks_compute_with_q8(checkpoint) -> None:
    """The option reaches the banks (else the test above could pass on the float path)."""
    config = EngineConfig(dtype="float32", offload=TARGETS[0])
    with Engine.from_pretrained(checkpoint, config) as engine:
        banks = engine.moe_runtime.banks
        assert banks and all(bank.q8_activations for bank in banks)
    with pytest.raises(ValueError, match="activation_quant must be one of"):
        OffloadConfig(activation_quant="q4")
