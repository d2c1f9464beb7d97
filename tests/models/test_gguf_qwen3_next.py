"""GGUF Qwen3-Next (`qwen3next`) and Qwen3.5-MoE (`qwen35moe`) files against transformers.

Each case writes a tiny transformers checkpoint (tests/hybrid_checkpoints.py), converts it to
GGUF as llama.cpp's converter does (tests/gguf_hybrid_checkpoints.py: ssm.* metadata, 1 + w norms,
-exp(A_log), the split qkvz, Qwen3.5's tiled value heads), and compares with transformers on
the float model the file stands for (each tensor through what the file stores and back):
the same ModelConfig as that model's safetensors load, identical greedy tokens (float32) on
every decode target for prompts of 1, 7 and 64 tokens (the prefill's chunk; the k-quant
files: 7), logits within tolerance, and requests of those lengths batched. Two kinds of file
per family: F32 (Qwen3.5's with a multi-token-prediction block to leave unread), and a
Q4_K_M-like one: dense tensors BF16, experts seeded random Q4_K / Q5_K / Q6_K blocks (rows of
256 weights), dequantised by gguf.quants for transformers; and a Qwen3-Next file whose dense
matrices are Q8_0, its attention, shared experts and head kept in that type.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
import torch

from gguf_checkpoints import KQUANT_FILE_TYPES, random_kquants
from gguf_hybrid_checkpoints import write_hybrid_gguf, write_hybrid_reference
from hybrid_checkpoints import hf_greedy, hf_model, write_checkpoint
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.errors import CheckpointError, UnsupportedConfigError
from hybridmoe.layers.gated_deltanet import GatedDeltaNet
from hybridmoe.loader.gguf import GgufFile
from hybridmoe.loader.gguf_tokenizer import gguf_tokenizer
from hybridmoe.models.loading import load_model
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.quant.formats import weight_format

os.environ.setdefault("HF_HUB_OFFLINE", "1")

N_GREEDY = 8
LOGITS_ATOL, LOGITS_RTOL = 2e-3, 1e-4  # as tests/hybrid_oracle.py (the delta-rule state)
MIN_REFERENCE_GAP = 1e-3
GREEDY = SamplingParams(max_tokens=N_GREEDY, temperature=0.0, ignore_eos=True)
_rng = random.Random(15)
PROMPTS = {n: [_rng.randrange(3, 96) for _ in range(n)] for n in (1, 7, 64)}
FLOAT = dict(activation_quant="none")  # as transformers computes the dequantised model
TARGETS = {
    "resident": OffloadConfig(decode_target="resident", **FLOAT),
    "cpu": OffloadConfig(decode_target="cpu", **FLOAT),
    "offload": OffloadConfig(decode_target="offload", expert_cache_slots=3, **FLOAT),
    "hybrid": OffloadConfig(decode_target="hybrid", expert_cache_slots=3, max_fetch=1, **FLOAT),
}
# per MoE layer index mod 2: the ggml types of gate, up, down (Q4_K_M: down gets more bits)
KQUANT_TYPES = KQUANT_FILE_TYPES["q4_k_m"]
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
# case id -> (tests/hybrid_checkpoints.py case, dense type, k-quant experts, MTP blocks)
CASES = {
    "qwen3next-F32": ("qwen3_next", "F32", False, 0),
    "qwen35moe-F32-mtp": ("qwen3_5_moe", "F32", False, 1),
    "qwen3next-BF16-kquant": ("qwen3_next_wide", "BF16", True, 0),
    "qwen35moe-BF16-kquant-mtp": ("qwen3_5_moe_wide", "BF16", True, 1),
    "qwen3next-Q8_0-kquant": ("qwen3_next_wide", "Q8_0", True, 0),
}
SSM_KEYS = ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")


@dataclass(frozen=True)
class Case:
    gguf_path: Path
    float_dir: Path  # the float checkpoint the GGUF stands for
    kquant: bool
    dense_type: str  # the ggml type of its dense matrices
    tokens: dict[int, list[int]]  # prompt length -> transformers' greedy tokens
    logits: dict[int, torch.Tensor]  # prompt length -> [T + N_GREEDY - 1, V]


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    checkpoint, dense_type, kquant, mtp = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = write_checkpoint(checkpoint, root / "hf")
    experts = random_kquants(KQUANT_TYPES) if kquant else None
    gguf_path = write_hybrid_gguf(
        hf_dir, root / "model.gguf", dense_type, experts, mtp, chat_template=TEMPLATE
    )
    float_dir = write_hybrid_reference(hf_dir, root / "float", dense_type, experts)
    model, tokens, logits = hf_model(float_dir), {}, {}
    for n, prompt in PROMPTS.items():
        tokens[n], logits[n] = hf_greedy(model, prompt, N_GREEDY)
        top2 = logits[n][n - 1 :].topk(2, dim=-1).values
        gaps = top2[:, 0] - top2[:, 1]
        assert gaps.min() >= MIN_REFERENCE_GAP, f"prompt {n}: near-tie {gaps.tolist()}"
    return Case(gguf_path, float_dir, kquant, dense_type, tokens, logits)


def _engine(path: Path, offload: OffloadConfig) -> Engine:
    config = EngineConfig(dtype="float32", max_batch=4, max_seq_len=128, offload=offload)
    return Engine.from_pretrained(path, config)


def test_config_is_the_safetensors_loads(case: Case) -> None:
    ours = load_model(case.gguf_path)
    assert ours.cfg == load_model(case.float_dir).cfg
    if not case.kquant:
        return
    sparse = [i for i, is_sparse in enumerate(ours.cfg.sparse_layers) if is_sparse]
    for i, layer in zip(sparse, ours.moe_layers, strict=True):
        gate, _, down = KQUANT_TYPES[i % 2]
        bank = layer.experts.store  # the file's types, not dequantised
        assert bank.gate_up_fmt == weight_format(gate.lower()), i
        assert bank.down_fmt == weight_format(down.lower()), i


def test_quantised_dense_projections_stay_in_the_files_type(case: Case) -> None:
    """A Q8_0 file's attention, shared-expert and dense-MLP projections and its output head
    load as Q8_0 bytes (the family's restore rewrites norms, A_log and the linear attention's
    input projection, not these; a matrix whose rows are not whole blocks the file keeps in
    F32); the linear attention's projections are read by `get`, as floats."""
    if case.dense_type != "Q8_0":
        pytest.skip("a float-dense file")
    model = load_model(case.gguf_path)
    q8_0 = weight_format("q8_0")
    assert model.lm_head.fmt == q8_0
    stored = []
    for layer in model.layers:
        if isinstance(layer.attn, GatedDeltaNet):
            assert not any(p.fmt.is_quantized for p in layer.attn.projections())
        else:
            stored += layer.attn.projections()
        stored += layer.mlp.projections()
    formats = {p.fmt.name for p in stored if p.in_features % 32 == 0}
    assert len(stored) > 8 and formats == {"q8_0"}, formats


@pytest.mark.parametrize("target", TARGETS)
def test_greedy_and_logits_match_transformers(case: Case, target: str) -> None:
    """Every prompt length on the F32 files; the k-quant files' 7-token prompt (what their
    experts' formats change is the same at any length; all lengths run batched below)."""
    lengths = [7] if case.kquant else list(PROMPTS)
    with _engine(case.gguf_path, TARGETS[target]) as engine:
        for n in lengths:
            prompt = PROMPTS[n]
            [ours] = engine.generate_ids([prompt], GREEDY)
            assert ours == case.tokens[n], f"prompt of {n} tokens on {target}"
            logits = engine.model.logits(prompt + case.tokens[n][:-1])
            torch.testing.assert_close(logits, case.logits[n], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_batched_requests_of_different_lengths(case: Case) -> None:
    with _engine(case.gguf_path, TARGETS["hybrid"]) as engine:
        ours = engine.generate_ids(list(PROMPTS.values()), GREEDY)
    assert ours == list(case.tokens.values())


def test_tokenizer_and_chat_template_come_from_the_file(case: Case) -> None:
    gguf = GgufFile(case.gguf_path)
    pre = {"qwen3next": "qwen2", "qwen35moe": "qwen35"}[gguf.architecture]
    assert gguf.get("tokenizer.ggml.pre", str) == pre
    tokenizer = gguf_tokenizer(gguf)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|user|>hi"


@pytest.mark.parametrize(
    "key", [f"ssm.{k}" for k in SSM_KEYS] + ["full_attention_interval", "rope.dimension_count"]
)
@pytest.mark.parametrize("checkpoint, arch", [("qwen3_next", "qwen3next"),
                                              ("qwen3_5_moe", "qwen35moe")])  # fmt: skip
def test_a_missing_linear_attention_key_is_named(key, checkpoint, arch, hf_dirs, tmp_path):
    path = write_hybrid_gguf(hf_dirs[checkpoint], tmp_path / "m.gguf", drop_keys=(f"{arch}.{key}",))
    with pytest.raises(UnsupportedConfigError) as error:
        load_model(path)
    message = str(error.value)
    assert "\n" not in message and f"metadata key '{arch}.{key}' is missing" in message


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {c: write_checkpoint(c, root / c) for c in ("qwen3_next", "qwen3_5_moe")}


def test_a_positive_ssm_a_is_refused(hf_dirs, tmp_path) -> None:
    """ssm_a holds -exp(A_log): a file with a value that is not negative is another model."""
    path = write_hybrid_gguf(hf_dirs["qwen3_next"], tmp_path / "m.gguf")
    reader = gguf.GGUFReader(path, "r+")  # edits the file through its mapping
    [ssm_a] = [t for t in reader.tensors if t.name == "blk.0.ssm_a"]
    ssm_a.data[1] = 0.5
    reader.data.flush()
    del reader
    with pytest.raises(CheckpointError) as error:
        load_model(path)
    message = str(error.value)
    assert "\n" not in message and "1 of its 4 values are not (the first: 0.5)" in message
