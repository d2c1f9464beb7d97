"""GGUF files of every family against transformers and against our own safetensors load.

Each case writes a tiny transformers checkpoint, converts it to GGUF as llama.cpp's converter
does (tests/gguf_checkpoints.py), and requires: the same ModelConfig as the safetensors load,
identical greedy tokens (float32) on every decode target, and logits within float32 tolerance.
Quantised experts are compared with the float checkpoint they stand for (experts replaced by
their dequantised values). Expert types join the parametrisation by being registered formats.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from gguf_checkpoints import GGUF_ARCH, write_dequantized_checkpoint, write_gguf
from hf_checkpoints import ORACLE_CASES, PROMPT_IDS, greedy_reference
from hf_checkpoints import write_hf_checkpoint as write_hf
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.models.loading import load_model
from hybridmoe.moe.backends import DECODE_TARGETS
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.quant.formats import WEIGHT_FORMATS

os.environ.setdefault("HF_HUB_OFFLINE", "1")

N_GREEDY = 12
LOGITS_ATOL = LOGITS_RTOL = 1e-4
MIN_REFERENCE_GAP = 1e-3
GREEDY = SamplingParams(max_tokens=N_GREEDY, temperature=0.0, ignore_eos=True)
# GGUF types of experts: the registered formats among those gguf-py can quantise in numpy
# (for the test's writer). Rows here are 32 or 64 weights, so 256-weight k-quant blocks need
# another case shape; they are listed so that a registered one fails loudly until it has one.
GGUF_EXPERT_TYPES = ("F32", "BF16", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")
EXPERT_TYPES = [t for t in GGUF_EXPERT_TYPES if t.lower() in WEIGHT_FORMATS]
# one case per family whose expert rows (H and I) are whole 32-weight blocks
QUANT_CASES = [
    ("qwen3_moe", "mha_tied_top1"),
    ("qwen2_moe", "gqa_sparse_step_tied"),
    ("mixtral", "gqa_wide"),
    ("olmoe", "gqa_clip_qkv"),
]


@dataclass(frozen=True)
class Case:
    float_dir: Path  # the checkpoint the GGUF stands for (experts dequantised)
    gguf_path: Path
    tokens: list[int]  # transformers' greedy continuation of PROMPT_IDS
    logits: torch.Tensor  # transformers' [T, V] logits of PROMPT_IDS + tokens[:-1]


def make_case(root: Path, family: str, variant: str, expert_type: str) -> Case:
    hf_dir = write_hf(family, variant, root / "hf")
    float_dir = hf_dir
    if expert_type != "F32":
        float_dir = write_dequantized_checkpoint(hf_dir, root / "float", expert_type)
    gguf_path = write_gguf(hf_dir, root / f"model-{expert_type}.gguf", expert_type)
    tokens, logits = greedy_reference(float_dir, PROMPT_IDS, N_GREEDY, MIN_REFERENCE_GAP)
    return Case(float_dir, gguf_path, tokens, logits)


# the families tests/gguf_checkpoints.py writes as GGUF (gpt-oss: tests/gguf_gpt_oss.py)
GGUF_CASES = [case for case in ORACLE_CASES if case[0] in GGUF_ARCH]


@pytest.mark.parametrize("case", GGUF_CASES, ids=["-".join(c) for c in GGUF_CASES])
def test_gguf_config_and_logits_equal_safetensors(case, tmp_path: Path) -> None:
    hf_dir = write_hf(*case, tmp_path / "hf")
    ours_hf = load_model(hf_dir)
    ours_gguf = load_model(write_gguf(hf_dir, tmp_path / "model.gguf"))
    assert ours_gguf.cfg == ours_hf.cfg
    torch.testing.assert_close(
        ours_gguf.logits(PROMPT_IDS), ours_hf.logits(PROMPT_IDS), atol=1e-5, rtol=1e-5
    )


@pytest.fixture(
    scope="module",
    params=[(c, t) for c in QUANT_CASES for t in EXPERT_TYPES],
    ids=[f"{'-'.join(c)}-{t}" for c in QUANT_CASES for t in EXPERT_TYPES],
)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    (family, variant), expert_type = request.param
    return make_case(
        tmp_path_factory.mktemp(f"{family}-{expert_type}"), family, variant, expert_type
    )


def _engine(path: Path, target: str, activation_quant: str = "none") -> Engine:
    """Float activations by default here: transformers computes the dequantised model so (the
    default, q8 for q8_0/q4_0 experts, has its own test below)."""
    offload = OffloadConfig(decode_target=target, activation_quant=activation_quant)
    return Engine.from_pretrained(path, EngineConfig(dtype="float32", offload=offload))


@pytest.mark.parametrize("target", list(DECODE_TARGETS))
def test_gguf_greedy_matches_transformers(case: Case, target: str) -> None:
    with _engine(case.gguf_path, target) as engine:
        [ours] = engine.generate_ids([PROMPT_IDS], GREEDY)
        logits = engine.model.logits(PROMPT_IDS + case.tokens[:-1])
    assert ours == case.tokens
    torch.testing.assert_close(logits, case.logits, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_gguf_greedy_matches_safetensors(case: Case) -> None:
    """The GGUF and its float checkpoint loaded as safetensors (the targets agree with each
    other for a safetensors load: tests/moe)."""
    runs = []
    for path in (case.gguf_path, case.float_dir):
        with _engine(path, "hybrid") as engine:
            runs.append(engine.generate_ids([PROMPT_IDS], GREEDY))
    assert runs[0] == runs[1]


def test_gguf_experts_stay_in_the_files_format(case: Case) -> None:
    model = load_model(case.gguf_path)
    type_name = case.gguf_path.stem.removeprefix("model-")
    for layer in model.moe_layers:
        bank = layer.experts.store
        assert bank.fmt is WEIGHT_FORMATS[type_name.lower()]


@pytest.mark.parametrize("target", list(DECODE_TARGETS))
def test_gguf_default_activations(case: Case, target: str) -> None:
    """With no flags a file's q8_0/q4_0 experts compute by the q8 contract (llama.cpp's
    arithmetic), its other types on float activations; every target gives the resident
    target's tokens and logits (bank_moe: the contract's torch reference, or the float one)."""
    fmt = WEIGHT_FORMATS[case.gguf_path.stem.removeprefix("model-").lower()]
    runs = {}
    for name in ("resident", target):
        with _engine(case.gguf_path, name, activation_quant="auto") as engine:
            banks = engine.moe_runtime.banks
            assert all(bank.q8_activations == fmt.has_integer_dots for bank in banks), name
            [tokens] = engine.generate_ids([PROMPT_IDS], GREEDY)
            runs[name] = tokens, engine.model.logits(PROMPT_IDS + tokens[:-1])
    assert runs[target][0] == runs["resident"][0]
    torch.testing.assert_close(runs[target][1], runs["resident"][1], atol=1e-5, rtol=1e-5)
