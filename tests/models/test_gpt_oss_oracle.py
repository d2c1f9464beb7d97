"""gpt-oss (float experts) against Hugging Face `transformers` on tiny random checkpoints it
wrote (tests/hf_checkpoints.py: sliding windows of 5 and 8, shorter than the prompts; biases,
sinks and a swiglu_limit the projections reach): identical greedy tokens and logits within
float32 tolerance for every decode target, a batch of two prompt lengths, and that each part
(sinks, biases, clamp, window) moves the logits, so that matching them is a test of it."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from hf_checkpoints import (
    ORACLE_CASES,
    PROMPT_IDS,
    SHORT_PROMPT_IDS,
    hf_greedy,
    hf_logits,
    write_hf_checkpoint,
)
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.engine.placement import expert_shape_banks
from hybridmoe.errors import UnsupportedConfigError
from hybridmoe.layers import attention
from hybridmoe.models.loading import load_hf_model
from hybridmoe.moe.config import OffloadConfig

CASES = [case for case in ORACLE_CASES if case[0] == "gpt_oss"]
N_GREEDY = 16
GREEDY = SamplingParams(max_tokens=N_GREEDY, temperature=0.0, ignore_eos=True)
LOGITS_ATOL = LOGITS_RTOL = 1e-4  # fp32 against fp32: summation order only
TARGETS = [
    OffloadConfig(decode_target="cpu"),
    OffloadConfig(decode_target="resident"),
    OffloadConfig(decode_target="offload", expert_cache_slots=4),
    OffloadConfig(decode_target="hybrid", expert_cache_slots=1, max_fetch=1),
    OffloadConfig(decode_target="hybrid", expert_cache_slots=5, max_fetch=2),
]


@dataclass(frozen=True)
class Reference:
    directory: Path
    tokens: list[int]  # HF greedy continuation of PROMPT_IDS
    short_tokens: list[int]  # ... of SHORT_PROMPT_IDS
    logits: torch.Tensor  # [T, V] HF logits of PROMPT_IDS + tokens[:-1]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def reference(request, tmp_path_factory) -> Reference:
    directory = write_hf_checkpoint(*request.param, tmp_path_factory.mktemp("gpt-oss"))
    tokens = hf_greedy(directory, PROMPT_IDS, N_GREEDY)
    short_tokens = hf_greedy(directory, SHORT_PROMPT_IDS, N_GREEDY)
    logits = hf_logits(directory, PROMPT_IDS + tokens[:-1])
    return Reference(directory, tokens, short_tokens, logits)


def decode_logits(engine: Engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] logits of decode steps feeding `tokens` one by one after the prompt."""
    model = engine.model
    cache = KVCache(model.cfg, 1, len(prompt) + len(tokens) + 1, model.dtype)
    model.forward(
        torch.tensor([prompt]), model.make_batch(torch.arange(len(prompt))[None], [0], cache)
    )
    rows = []
    for i, token in enumerate(tokens):
        batch = model.make_batch(torch.tensor([[len(prompt) + i]]), [0], cache, is_decode=True)
        rows.append(model.forward(torch.tensor([[token]]), batch)[0])
    return torch.stack(rows)


def _id(offload: OffloadConfig) -> str:
    return f"{offload.decode_target}-s{offload.expert_cache_slots}-f{offload.max_fetch}"


@pytest.mark.parametrize("offload", TARGETS, ids=_id)
def test_every_target_matches_transformers(reference: Reference, offload) -> None:
    config = EngineConfig(dtype="float32", offload=offload)
    with Engine.from_pretrained(reference.directory, config) as engine:
        batch = engine.generate_ids([PROMPT_IDS, SHORT_PROMPT_IDS], GREEDY)
        assert batch == [reference.tokens, reference.short_tokens]
        prompt_len = len(PROMPT_IDS)
        prefill = engine.model.logits(PROMPT_IDS + reference.tokens[:-1])  # [T, V]
        decoded = decode_logits(engine, PROMPT_IDS, reference.tokens[:-1])
    tol = dict(atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    torch.testing.assert_close(prefill, reference.logits, **tol)
    torch.testing.assert_close(decoded, reference.logits[prompt_len - 1 + 1 :], **tol)


def _ablations(model) -> dict[str, torch.nn.Module]:
    """Copies of the HF model each without one part gpt-oss adds."""

    def without(change) -> torch.nn.Module:
        other = copy.deepcopy(model)
        with torch.no_grad():
            for layer in other.model.layers:
                change(layer)
        return other

    return {
        "sinks": without(lambda layer: layer.self_attn.sinks.fill_(-math.inf)),
        "expert biases": without(
            lambda layer: (
                layer.mlp.experts.gate_up_proj_bias.zero_(),
                layer.mlp.experts.down_proj_bias.zero_(),
            )
        ),
        "router bias": without(lambda layer: layer.mlp.router.bias.zero_()),
        "clamp": without(lambda layer: setattr(layer.mlp.experts, "limit", math.inf)),
    }


@torch.no_grad()
def test_each_part_moves_the_logits(reference: Reference) -> None:
    # guards the oracle: logits within 1e-4 of transformers' mean sinks, biases, the clamp and
    # the window are all computed, since dropping any one moves them by far more
    model = transformers.AutoModelForCausalLM.from_pretrained(reference.directory).eval()
    ids = torch.tensor([PROMPT_IDS + reference.tokens[:-1]])
    full = model(ids).logits
    for part, other in _ablations(model).items():
        moved = (other(ids).logits - full).abs().max().item()
        assert moved > 1e-2, f"without {part} the logits move by {moved:.2e} only"
    model.config.sliding_window = 4096  # every layer attends to every key
    moved = (model(ids).logits - full).abs().max().item()
    assert moved > 1e-2, f"without the window the logits move by {moved:.2e} only"


def test_bf16_targets_agree(reference: Reference) -> None:
    # the accumulation contract in bf16: cpu (numba kernel) and hybrid with one slot (CPU and
    # slot partials) give the same tokens
    outputs = []
    for offload in (TARGETS[0], TARGETS[3]):
        config = EngineConfig(dtype="bfloat16", offload=offload)
        with Engine.from_pretrained(reference.directory, config) as engine:
            outputs.append(engine.generate_ids([PROMPT_IDS, SHORT_PROMPT_IDS], GREEDY))
    assert [len(tokens) for tokens in outputs[0]] == [N_GREEDY, N_GREEDY]
    assert outputs[0] == outputs[1]


def test_other_quantised_checkpoints_are_refused(reference: Reference, tmp_path) -> None:
    # mxfp4 loads (tests/models/test_gpt_oss_mxfp4.py); any other quant_method is refused
    (tmp_path / "config.json").write_text(
        (reference.directory / "config.json")
        .read_text()
        .replace(
            '"architectures"',
            '"quantization_config": {"quant_method": "gptq"},\n  "architectures"',
            1,
        )
    )
    with pytest.raises(UnsupportedConfigError, match="quant_method 'gptq'"):
        load_hf_model(tmp_path)


def test_unknown_layer_type_is_refused(reference: Reference, tmp_path) -> None:
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((reference.directory / name).read_bytes())
    config = (tmp_path / "config.json").read_text().replace('"full_attention"', '"chunked"', 1)
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(UnsupportedConfigError, match="layer_types.*sliding_attention"):
        load_hf_model(tmp_path)


def test_attention_in_chunks_of_query_rows(reference: Reference, monkeypatch) -> None:
    monkeypatch.setattr(attention, "SINK_SCORES_BYTES", 1)  # one query row per chunk
    model = load_hf_model(reference.directory)
    logits = model.logits(PROMPT_IDS + reference.tokens[:-1])
    torch.testing.assert_close(logits, reference.logits, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_memory_plan_counts_the_expert_biases(reference: Reference) -> None:
    model = load_hf_model(reference.directory)
    bank = model.moe_layers[0].experts.store
    assert bank.biases is not None
    banks = expert_shape_banks(model, OffloadConfig())
    assert all(b.expert_nbytes == bank.expert_nbytes for b in banks)


def test_prefix_cache_reuse_with_sliding_layers(reference: Reference) -> None:
    # a second request starts from 32 cached positions of its 40: the suffix prefill's
    # queries see only their window of the copied keys on sliding layers
    prompt = [3 + i % 90 for i in range(40)]
    expected = hf_greedy(reference.directory, prompt, 8)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    config = EngineConfig(dtype="float32", prefix_cache_tokens=256)
    with Engine.from_pretrained(reference.directory, config) as engine:
        assert engine.generate_ids([prompt], greedy) == [expected]
        assert engine.generate_ids([prompt], greedy) == [expected]
        assert engine.stats.prefix_cache.hit_tokens == 32
