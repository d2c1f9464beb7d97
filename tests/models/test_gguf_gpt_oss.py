"""gpt-oss from GGUF (`general.architecture` gpt-oss, written as llama.cpp's converter writes it:
tests/gguf_gpt_oss.py) against `transformers` and against our own safetensors load.

Two tiny checkpoints: float experts (stored F32, BF16 or F16; their gate_up weights scaled so
the clamp at swiglu_limit 7, the only one a GGUF can state, cuts), and MXFP4 experts (seeded
random blocks, compared with the model of their values dequantised by gguf.quants). Windows
of 5 and 6 positions, shorter than the prompts. Each must give the ModelConfig and the expert
bank of the safetensors load, and identical greedy tokens (float32) with logits within float32
tolerance on every decode target, for a batch of two prompt lengths.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file, save_file

from gguf_checkpoints import _quantizer
from gguf_gpt_oss import (
    random_mxfp4,
    write_gpt_oss_encoded_checkpoint,
    write_gpt_oss_gguf,
)
from hf_checkpoints import (
    PROMPT_IDS,
    SHORT_PROMPT_IDS,
    hf_greedy,
    hf_logits,
    top2_gap,
    write_custom_checkpoint,
)
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.errors import UnsupportedConfigError
from hybridmoe.loader.gguf import GgufFile
from hybridmoe.loader.gguf_tokenizer import gguf_tokenizer
from hybridmoe.loader.tokenizer import Tokenizer
from hybridmoe.models.gguf_names import gguf_name_map
from hybridmoe.models.gpt_oss import GPT_OSS
from hybridmoe.models.loading import load_model
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.quant.formats import WEIGHT_FORMATS
from hybridmoe.server.reasoning import Reasoning, resolve_reasoning
from loader.test_gguf_files import _cli_error
from loader.test_gguf_tokenizer import CORPUS, original_tokenizer
from models.test_gpt_oss_oracle import decode_logits
from mxfp4_layout import hf_layout
from server.test_reasoning import ANALYSIS, FINAL, HARMONY_TEMPLATE, HARMONY_TOKENS, MESSAGES

N_GREEDY = 12
GREEDY = SamplingParams(max_tokens=N_GREEDY, temperature=0.0, ignore_eos=True)
LOGITS_ATOL = LOGITS_RTOL = 1e-4
MIN_REFERENCE_GAP = 1e-3
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 32.0}
# fmt: off
CHECKPOINTS = {  # name -> (config kwargs, seed, scale of the experts' gate_up weights)
    "float": (dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=24,
        sliding_window=5, rope_parameters={**YARN, "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 64}), 11, 4.0),
    "mxfp4": (dict(  # H and I whole 32-weight blocks; GptOssConfig's default YaRN
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        num_local_experts=6, num_experts_per_tok=4, intermediate_size=32, sliding_window=6,
        attention_bias=False), 5, 1.0),
}
# fmt: on
TARGETS = {
    "cpu": OffloadConfig(decode_target="cpu"),
    "resident": OffloadConfig(decode_target="resident"),
    "offload": OffloadConfig(decode_target="offload", expert_cache_slots=4),
    "hybrid": OffloadConfig(decode_target="hybrid", expert_cache_slots=2, max_fetch=1),
}
# (expert type, targets): every target for F32 and MXFP4, two for the other float types
RUNS = [("F32", t) for t in TARGETS] + [("MXFP4", t) for t in TARGETS]
RUNS += [(kind, t) for kind in ("BF16", "F16") for t in ("cpu", "hybrid")]
EXPERTS = ("gate", "up", "down")  # a bank's projections; ffn_{gate,up,down}_exps in GGUF


@dataclass(frozen=True)
class Reference:
    hf_dir: Path  # the checkpoint the GGUF was written from
    float_dir: Path  # the float checkpoint it stands for (experts as the file stores them)
    gguf_path: Path
    tokens: list[int]  # transformers' greedy continuations of PROMPT_IDS, SHORT_PROMPT_IDS
    short_tokens: list[int]
    logits: torch.Tensor  # [T, V] transformers' logits of PROMPT_IDS + tokens[:-1]


def _checkpoint(name: str, directory: Path) -> Path:
    config, seed, scale = CHECKPOINTS[name]
    write_custom_checkpoint("gpt_oss", config, directory, seed)
    tensors = load_file(directory / "model.safetensors")
    for key in [k for k in tensors if k.endswith("experts.gate_up_proj")]:
        tensors[key] = tensors[key] * scale
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """expert type -> its Reference, made once per type."""
    root = tmp_path_factory.mktemp("gguf-gpt-oss")
    checkpoints = {name: _checkpoint(name, root / name) for name in CHECKPOINTS}

    @cache
    def make(expert_type: str) -> Reference:
        hf_dir = checkpoints["mxfp4" if expert_type == "MXFP4" else "float"]
        encoder = random_mxfp4(3) if expert_type == "MXFP4" else _quantizer(QType[expert_type])
        float_dir = hf_dir
        if expert_type != "F32":
            float_dir = write_gpt_oss_encoded_checkpoint(hf_dir, root / expert_type, encoder)
        gguf_path = write_gpt_oss_gguf(hf_dir, root / f"{expert_type}.gguf", experts=encoder)
        tokens = hf_greedy(float_dir, PROMPT_IDS, N_GREEDY)
        short_tokens = hf_greedy(float_dir, SHORT_PROMPT_IDS, N_GREEDY)
        logits = hf_logits(float_dir, PROMPT_IDS + tokens[:-1])
        for prompt, continuation in ((PROMPT_IDS, tokens), (SHORT_PROMPT_IDS, short_tokens)):
            gaps = top2_gap(hf_logits(float_dir, prompt + continuation[:-1])[len(prompt) - 1 :])
            assert gaps.min() >= MIN_REFERENCE_GAP, f"near-tie in the reference: {gaps.tolist()}"
        return Reference(hf_dir, float_dir, gguf_path, tokens, short_tokens, logits)

    return make


@pytest.mark.parametrize(("expert_type", "target"), RUNS, ids=[f"{k}-{t}" for k, t in RUNS])
def test_every_target_matches_transformers(reference, expert_type: str, target: str) -> None:
    ref = reference(expert_type)
    config = EngineConfig(dtype="float32", max_seq_len=64, offload=TARGETS[target])
    with Engine.from_pretrained(ref.gguf_path, config) as engine:
        batch = engine.generate_ids([PROMPT_IDS, SHORT_PROMPT_IDS], GREEDY)
        prefill = engine.model.logits(PROMPT_IDS + ref.tokens[:-1])  # [T, V]
        decoded = decode_logits(engine, PROMPT_IDS, ref.tokens[:-1])  # the target's decode
    assert batch == [ref.tokens, ref.short_tokens]
    tol = dict(atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    torch.testing.assert_close(prefill, ref.logits, **tol)
    torch.testing.assert_close(decoded, ref.logits[len(PROMPT_IDS) :], **tol)


@pytest.mark.parametrize("expert_type", ["F32", "BF16", "MXFP4"])
def test_config_and_bank_are_the_safetensors_ones(reference, expert_type: str, tmp_path) -> None:
    """The GGUF load gives the ModelConfig of its checkpoint's safetensors load and, expert by
    expert, the same bank: the same rows (gate's, then up's), biases and activation. MXFP4:
    against the same blocks published in the Hugging Face layout."""
    ref = reference(expert_type)
    ours = load_model(ref.gguf_path)
    if expert_type == "MXFP4":
        theirs = load_model(_hf_mxfp4_checkpoint(ref, tmp_path / "mxfp4"))
    else:  # float32 experts holding the file's values (BF16: exactly, in float32)
        theirs = load_model(ref.float_dir)
    assert ours.cfg == theirs.cfg
    fmt = WEIGHT_FORMATS[expert_type.lower()]
    for mine, other in zip(ours.moe_layers, theirs.moe_layers, strict=True):
        bank, other_bank = mine.experts.store, other.experts.store
        assert bank.formats == (fmt, fmt) and bank.activation == other_bank.activation
        for name in EXPERTS:
            expected = getattr(other_bank, name)
            assert torch.equal(getattr(bank, name).to(expected.dtype), expected), name
        assert torch.equal(bank.biases.gate_up, other_bank.biases.gate_up)
        assert torch.equal(bank.biases.down, other_bank.biases.down)


def _hf_mxfp4_checkpoint(ref: Reference, directory: Path) -> Path:
    """The GGUF's MXFP4 experts as a Hugging Face MXFP4 checkpoint (`*_blocks`, `*_scales`,
    gate_up rows interleaved), the rest of the model as the GGUF's float checkpoint has it."""
    directory.mkdir()
    tensors = load_file(ref.float_dir / "model.safetensors")
    reader = gguf.GGUFReader(ref.gguf_path)
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    for layer in range(json.loads((ref.hf_dir / "config.json").read_text())["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate, up, down = (hf_layout(stored[f"blk.{layer}.ffn_{p}_exps.weight"]) for p in EXPERTS)
        for part in (0, 1):  # blocks, scales: gate's rows even, up's odd
            rows = torch.stack([gate[part], up[part]], dim=2).flatten(1, 2)
            tensors[f"{prefix}.gate_up_proj_{('blocks', 'scales')[part]}"] = rows
        tensors[f"{prefix}.down_proj_blocks"], tensors[f"{prefix}.down_proj_scales"] = down
        del tensors[f"{prefix}.gate_up_proj"], tensors[f"{prefix}.down_proj"]
    save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((ref.float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_the_clamp_and_the_window_move_the_logits(reference) -> None:
    # guards the oracle: with swiglu_limit at its only GGUF value (7.0) the float case's experts
    # are clamped, and its window cuts the prompt; dropping either moves the logits by far more
    # than the tolerance
    ref = reference("F32")
    model = transformers.AutoModelForCausalLM.from_pretrained(ref.float_dir).eval()
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        full = model(ids).logits
        unclamped = copy.deepcopy(model)
        for layer in unclamped.model.layers:
            layer.mlp.experts.limit = math.inf
        assert (unclamped(ids).logits - full).abs().max() > 1e-2
        model.config.sliding_window = 4096
        assert (model(ids).logits - full).abs().max() > 1e-2


def test_name_map_agrees_with_gguf_py() -> None:
    """Every gpt-oss checkpoint name maps to what gguf-py (and the converter) calls it."""
    weights, spec = GPT_OSS.weights, GPT_OSS.gguf
    ours = gguf_name_map(
        weights.moe_prefix, weights.expert_names, weights.router, dict(spec.layer_names)
    )
    theirs = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, 4)
    parts = ["input_layernorm", "post_attention_layernorm", "mlp.router"]
    parts += [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    parts += [f"mlp.experts.{p}" for p in weights.expert_names]
    for name in [f"model.layers.3.{p}" for p in parts] + ["model.embed_tokens", "model.norm"]:
        for kind in ("weight", "bias"):
            assert ours(f"{name}.{kind}") == f"{theirs.get_name(name)}.{kind}", name
    assert ours("model.layers.3.self_attn.sinks") == "blk.3.attn_sinks.weight"
    assert theirs.get_name("model.layers.3.self_attn.sinks") == "blk.3.attn_sinks"
    assert ours("lm_head.weight") == "output.weight"


@pytest.mark.parametrize(
    "key",
    [
        "gpt-oss.attention.sliding_window",
        "gpt-oss.expert_feed_forward_length",
        "gpt-oss.rope.scaling.type",
        "gpt-oss.rope.scaling.original_context_length",
    ],
)
def test_missing_metadata_key_is_named(reference, key: str, tmp_path) -> None:
    ref = reference("F32")
    path = write_gpt_oss_gguf(ref.hf_dir, tmp_path / "m.gguf", drop_keys=(key,))
    with pytest.raises(UnsupportedConfigError, match=f"metadata key '{key}' is missing"):
        load_model(path)
    if key == "gpt-oss.attention.sliding_window":
        assert f"'{key}' is missing" in _cli_error(path)


def test_a_sliding_pattern_llama_cpp_would_not_honour_is_refused(reference, tmp_path) -> None:
    ref = reference("F32")
    path = write_gpt_oss_gguf(
        ref.hf_dir, tmp_path / "m.gguf", extra={"gpt-oss.attention.sliding_window_pattern": 3}
    )
    with pytest.raises(UnsupportedConfigError, match="sliding_window_pattern' = 3"):
        load_model(path)
    same = {"gpt-oss.attention.sliding_window_pattern": 2}  # llama.cpp's own: accepted
    assert load_model(write_gpt_oss_gguf(ref.hf_dir, tmp_path / "ok.gguf", extra=same))


HARMONY_REPLY = (
    f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>"
)


def test_harmony_chat_from_the_gguf(reference, tmp_path) -> None:
    """A GGUF with an o200k-split vocabulary (`tokenizer.ggml.pre` gpt-4o), harmony's special
    tokens and a harmony template: ids as its tokenizer.json gives them, the template renders
    with `reasoning_effort`, serve picks the harmony format from it, and a reply splits into
    the analysis channel (reasoning) and the final one (content)."""
    spec, path = original_tokenizer("gpt-4o", tmp_path / "orig")
    first = 1 + max([*spec["model"]["vocab"].values(), *(t["id"] for t in spec["added_tokens"])])
    spec["added_tokens"] += [
        {"id": first + i, "content": token, "single_word": False, "lstrip": False}
        | {"rstrip": False, "normalized": False, "special": True}
        for i, token in enumerate(HARMONY_TOKENS)
    ]
    path.write_text(json.dumps({k: v for k, v in spec.items() if k not in ("pre", "add_bos")}))
    gguf_path = write_gpt_oss_gguf(
        reference("F32").hf_dir, tmp_path / "h.gguf", tokenizer=spec, chat_template=HARMONY_TEMPLATE
    )
    ours, original = gguf_tokenizer(GgufFile(gguf_path)), Tokenizer.from_dir(path.parent)
    for text in [*CORPUS, HARMONY_REPLY]:
        assert ours.encode(text, False) == original.encode(text, False), text
    reasoning, stop_ids = resolve_reasoning(ours, "auto")
    assert reasoning is not None and reasoning.name == "harmony"
    assert stop_ids == {first + HARMONY_TOKENS.index(t) for t in ("<|return|>", "<|call|>")}
    prompt = ours.apply_chat_template(MESSAGES, variables={"reasoning_effort": "high"})
    assert prompt.startswith("<|start|>system<|message|>Reasoning: high<|end|>")
    ids = ours.encode(HARMONY_REPLY, False)
    assert {first + i for i in range(len(HARMONY_TOKENS) - 1)} <= set(ids)  # markers: one id
    stream = reasoning.stream(prompt)
    pieces = stream.feed(ours.decode(ids, skip_special_tokens=False)) + stream.finish()
    assert "".join(p.text for p in pieces if isinstance(p, Reasoning)) == ANALYSIS
    assert "".join(p for p in pieces if isinstance(p, str)) == FINAL
