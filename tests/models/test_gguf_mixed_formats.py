"""GGUFs whose experts mix k-quant types as downloaded files do: Q4_K_M-like (Q4_K gate/up beside
Q6_K down in one layer and Q5_K down in the other) and Q2_K-like (Q2_K gate/up beside Q3_K down,
then Q3_K throughout). Each loads in the file's types, layer by layer, and gives transformers'
greedy tokens (float32, on the dequantised float model) on every decode target, and with q8
activations one set of tokens on every target; a layer whose gate and up differ in type is
refused in one line naming both."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from gguf_checkpoints import (
    KQUANT_FILE_TYPES,
    WIDE_QWEN3,
    random_kquants,
    write_encoded_checkpoint,
    write_gguf,
)
from hf_checkpoints import PROMPT_IDS, greedy_reference, write_custom_checkpoint
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.errors import CheckpointError
from hybridmoe.models.loading import load_model
from hybridmoe.moe.backends import DECODE_TARGETS
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.quant.formats import weight_format

os.environ.setdefault("HF_HUB_OFFLINE", "1")

N_GREEDY = 10
GREEDY = SamplingParams(max_tokens=N_GREEDY, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(KQUANT_FILE_TYPES))
def mixed(request, tmp_path_factory: pytest.TempPathFactory):
    """(the GGUF, transformers' greedy tokens and logits on the float model it stands for, its
    types per layer)."""
    types = KQUANT_FILE_TYPES[request.param]
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    hf_dir = write_custom_checkpoint("qwen3_moe", WIDE_QWEN3, root / "hf", seed=0)
    encoder = random_kquants(types)
    float_dir = write_encoded_checkpoint(hf_dir, root / "float", encoder)
    gguf_path = write_gguf(hf_dir, root / "model.gguf", experts=encoder)
    tokens, logits = greedy_reference(float_dir, PROMPT_IDS, N_GREEDY, 1e-3)
    assert len(set(tokens)) > 1, tokens
    return gguf_path, tokens, logits, types


def test_banks_hold_each_layers_file_types(mixed) -> None:
    model = load_model(mixed[0])
    for layer, types in mixed[3].items():
        bank = model.moe_layers[layer].experts.store
        assert bank.gate_up_fmt == weight_format(types[0].lower())
        assert bank.down_fmt == weight_format(types[2].lower())
        if types[0] != types[2]:
            with pytest.raises(ValueError, match="no one format"):
                bank.fmt  # noqa: B018


@pytest.mark.parametrize("target", list(DECODE_TARGETS))
def test_mixed_gguf_greedy_matches_transformers(mixed, target: str) -> None:
    gguf_path, tokens, reference_logits, _ = mixed
    offload = OffloadConfig(decode_target=target, activation_quant="none")  # transformers'

    with Engine.from_pretrained(gguf_path, EngineConfig(dtype="float32", offload=offload)) as e:
        [ours] = e.generate_ids([PROMPT_IDS], GREEDY)
        logits = e.model.logits(PROMPT_IDS + tokens[:-1])
    assert ours == tokens
    torch.testing.assert_close(logits, reference_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "target", [dict(decode_target="hybrid", expert_cache_slots=2, max_fetch=1),
               dict(decode_target="offload", expert_cache_slots=3)],
)  # fmt: skip
def test_mixed_gguf_small_caches_share_slots_between_formats(mixed, target: dict) -> None:
    """Slots too few for one layer's experts: each is refilled by either layer, in its types."""
    gguf_path, tokens, _, _ = mixed
    offload = OffloadConfig(activation_quant="none", **target)
    with Engine.from_pretrained(gguf_path, EngineConfig(dtype="float32", offload=offload)) as e:
        [ours] = e.generate_ids([PROMPT_IDS], GREEDY)
        assert e.moe_runtime.cache.total_stats().evictions > 0
    assert ours == tokens


def test_gate_and_up_of_different_types_are_refused(tmp_path: Path) -> None:
    hf_dir = write_custom_checkpoint("qwen3_moe", WIDE_QWEN3, tmp_path / "hf")
    types = {0: ("Q4_K", "Q5_K", "Q6_K"), 1: ("Q4_K", "Q4_K", "Q6_K")}
    path = write_gguf(hf_dir, tmp_path / "bad.gguf", experts=random_kquants(types))
    with pytest.raises(CheckpointError) as error:
        load_model(path)
    message = str(error.value)
    assert "\n" not in message
    assert "'blk.0.ffn_gate_exps.weight' is Q4_K but 'blk.0.ffn_up_exps.weight' is Q5_K" in message


def test_mixed_gguf_default_q8_activations_give_one_set_of_tokens(mixed) -> None:
    """With no flags (activation_quant auto) each file computes by the q8 contract (integer
    super-blocks of every k-quant, two types in a layer): every decode target gives the
    resident target's tokens (bank_moe, the contract's torch reference), the banks really
    compute with q8, and its logits stay within q8's error of transformers' float ones."""
    gguf_path, _, reference_logits, _ = mixed

    def run(**target) -> tuple[list[int], torch.Tensor]:
        offload = OffloadConfig(**target)
        config = EngineConfig(dtype="float32", offload=offload)
        with Engine.from_pretrained(gguf_path, config) as engine:
            assert all(bank.q8_activations for bank in engine.moe_runtime.banks)
            [ours] = engine.generate_ids([PROMPT_IDS], GREEDY)
            return ours, engine.model.logits(PROMPT_IDS + mixed[1][:-1])

    reference, logits = run(decode_target="resident")
    scale = reference_logits.abs().max()
    assert not torch.equal(logits, reference_logits)
    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=0.05 * scale)
    targets = [dict(decode_target=t) for t in DECODE_TARGETS if t not in ("resident", "auto")] + [
        dict(decode_target="hybrid", expert_cache_slots=2, max_fetch=1)
    ]
    for target in targets:
        assert run(**target)[0] == reference, target
