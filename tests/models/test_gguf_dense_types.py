"""GGUFs whose dense projections are quantised, as downloaded files store them: a Q4_K_M-like
file (attention q, k and o in Q4_K, v in Q6_K, the output head in Q6_K) and a Q8_0 one. Each
projection loads in the file's type (GgufWeightSource.stored_projection: the file's bytes, not
a dequantised copy), a v of another type than q and k runs as its own call beside their
stacked one (in the attention block too), and the model gives transformers' greedy tokens
(float32, on the dequantised float model the file stands for, float activations) on every
decode target, one set of tokens on every target in bfloat16 and with the default q8
activations (as llama.cpp computes), and --dense-format q8_0 re-quantises the projections from
the values they stand for. A llama-arch (Mixtral) file, whose q and k rows the converter
permutes, keeps them quantised too, its rows reordered as bytes."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from gguf_checkpoints import random_dense_encoder, write_encoded_checkpoint, write_gguf
from hf_checkpoints import PROMPT_IDS, greedy_reference, write_custom_checkpoint
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.models.loading import load_model
from hybridmoe.moe.backends import DECODE_TARGETS
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.quant.formats import weight_format

os.environ.setdefault("HF_HUB_OFFLINE", "1")

N_GREEDY = 10
GREEDY = SamplingParams(max_tokens=N_GREEDY, temperature=0.0, ignore_eos=True)
# per file: the ggml type of each attention projection and of the output head
FILE_TYPES = {
    "q4_k_m": {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K",
               "lm_head": "Q6_K"},
    "q8_0": {"q_proj": "Q8_0", "k_proj": "Q8_0", "v_proj": "Q8_0", "o_proj": "Q8_0",
             "lm_head": "Q8_0"},
}  # fmt: skip
# rows of whole k-quant super-blocks (256 weights): hidden and q width 256
WIDE_QWEN3 = dict(
    hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
    intermediate_size=128, norm_topk_prob=True, tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module", params=list(FILE_TYPES))
def quantised(request, tmp_path_factory: pytest.TempPathFactory):
    """(the GGUF, transformers' greedy tokens and logits on the float model it stands for, the
    float checkpoint's directory, its types)."""
    types = FILE_TYPES[request.param]
    root = tmp_path_factory.mktemp(f"gguf-dense-{request.param}")
    hf_dir = write_custom_checkpoint("qwen3_moe", WIDE_QWEN3, root / "hf", seed=0)
    encoder = random_dense_encoder(types)
    float_dir = write_encoded_checkpoint(hf_dir, root / "float", dense=encoder)
    gguf_path = write_gguf(hf_dir, root / "model.gguf", dense=encoder)
    tokens, logits = greedy_reference(float_dir, PROMPT_IDS, N_GREEDY, 1e-3)
    assert len(set(tokens)) > 1, tokens
    return gguf_path, tokens, logits, float_dir, types


def test_projections_keep_the_files_types(quantised) -> None:
    gguf_path, _, _, _, types = quantised
    model = load_model(gguf_path)
    for layer in model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            projection = getattr(layer.attn, name)
            fmt = weight_format(types[name].lower())
            assert projection.fmt == fmt
            rows = projection.out_features
            assert projection.weight.shape == (rows, fmt.row_bytes(projection.in_features))
    assert model.lm_head.fmt == weight_format(types["lm_head"].lower())
    stacked = model.layers[0].attn._stacked_qkv()  # q and k as one, v apart where it differs
    assert (stacked.v is not None) == (types["q_proj"] != types["v_proj"])
    assert stacked.stacked.fmt == weight_format(types["q_proj"].lower())


@pytest.mark.parametrize("target", list(DECODE_TARGETS))
def test_quantised_dense_greedy_matches_transformers(quantised, target: str) -> None:
    gguf_path, tokens, reference_logits, _, _ = quantised
    _assert_transformers_greedy(gguf_path, tokens, reference_logits, target)


def _assert_transformers_greedy(gguf_path, tokens, reference_logits, target: str) -> None:
    """float32, float activations (transformers' arithmetic): its greedy tokens, its logits."""
    offload = OffloadConfig(decode_target=target, activation_quant="none")
    with Engine.from_pretrained(gguf_path, EngineConfig(dtype="float32", offload=offload)) as e:
        [ours] = e.generate_ids([PROMPT_IDS], GREEDY)
        logits = e.model.logits(PROMPT_IDS + tokens[:-1])
    assert ours == tokens
    torch.testing.assert_close(logits, reference_logits, atol=1e-4, rtol=1e-4)


def test_quantised_dense_bfloat16_gives_one_set_of_tokens(quantised) -> None:
    """bfloat16 activations (float ones: q8's are the next test's) on the file's exact
    weights: every decode target the resident one's tokens, its logits near transformers'
    float32 ones."""
    gguf_path, tokens, reference_logits, _, _ = quantised

    def run(target: str) -> tuple[list[int], torch.Tensor]:
        offload = OffloadConfig(decode_target=target, activation_quant="none")
        config = EngineConfig(dtype="bfloat16", offload=offload)
        with Engine.from_pretrained(gguf_path, config) as engine:
            [ours] = engine.generate_ids([PROMPT_IDS], GREEDY)
            return ours, engine.model.logits(PROMPT_IDS + tokens[:-1])

    reference, logits = run("resident")
    scale = reference_logits.abs().max()
    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=0.05 * scale)
    for target in DECODE_TARGETS:
        if target not in ("resident", "auto"):
            assert run(target)[0] == reference, target


def test_default_q8_activations_give_one_set_of_tokens(quantised) -> None:
    """With no flags (activation_quant auto) every quantised projection computes by the q8
    contract (numba_dense_q8's kernel, one CPU call for any number of tokens; the attention
    block's too): every decode target gives the resident one's tokens, and the logits stay
    within q8's error of transformers' float ones."""
    gguf_path, tokens, reference_logits, _, _ = quantised

    def run(target: str) -> tuple[list[int], torch.Tensor]:
        config = EngineConfig(dtype="float32", offload=OffloadConfig(decode_target=target))
        with Engine.from_pretrained(gguf_path, config) as engine:
            model = engine.model
            projections = [p for layer in model.layers for p in layer.projections()]
            assert {p.activation_quant for p in [*projections, model.lm_head]} == {"q8"}
            [ours] = engine.generate_ids([PROMPT_IDS], GREEDY)
            return ours, model.logits(PROMPT_IDS + tokens[:-1])

    reference, logits = run("resident")
    scale = reference_logits.abs().max()
    assert not torch.equal(logits, reference_logits)
    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=0.05 * scale)
    for target in DECODE_TARGETS:
        if target not in ("resident", "auto"):
            assert run(target)[0] == reference, target


def test_dense_format_q8_0_requantises_the_values_the_file_stands_for(quantised) -> None:
    """--dense-format q8_0 on the GGUF gives the tokens it gives on the float checkpoint the
    file stands for (both quantise the same float32 values)."""
    gguf_path, _, _, float_dir, _ = quantised

    def run(path) -> list[int]:
        config = EngineConfig(dtype="float32", dense_format="q8_0")
        with Engine.from_pretrained(path, config) as engine:
            layer = engine.model.layers[0].attn
            assert layer.q_proj.fmt.name == "q8_0" and layer.v_proj.fmt.name == "q8_0"
            assert engine.model.lm_head.fmt.name == "q8_0"
            return engine.generate_ids([PROMPT_IDS], GREEDY)[0]

    assert run(gguf_path) == run(float_dir)


# a llama-arch (Mixtral) file: llama.cpp's converter stores q and k with their rows permuted
WIDE_MIXTRAL = dict(
    hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, num_local_experts=4, num_experts_per_tok=2, intermediate_size=128,
    tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def mixtral_quantised(tmp_path_factory: pytest.TempPathFactory):
    """(the Q4_K_M-like Mixtral GGUF, transformers' greedy tokens and logits, the float
    checkpoint it stands for)."""
    root = tmp_path_factory.mktemp("gguf-dense-mixtral")
    hf_dir = write_custom_checkpoint("mixtral", WIDE_MIXTRAL, root / "hf", seed=1)
    encoder = random_dense_encoder(FILE_TYPES["q4_k_m"])
    float_dir = write_encoded_checkpoint(hf_dir, root / "float", dense=encoder)
    gguf_path = write_gguf(hf_dir, root / "model.gguf", dense=encoder)
    tokens, logits = greedy_reference(float_dir, PROMPT_IDS, N_GREEDY, 1e-3)
    assert len(set(tokens)) > 1, tokens
    return gguf_path, tokens, logits, float_dir


def test_mixtral_permuted_rows_stay_in_the_files_types(mixtral_quantised) -> None:
    """q and k, whose rows the file holds permuted (llama's rotary layout), load in their
    quantised type with the rows reordered as bytes (models/mixtral.py's RowRestore): each
    projection's values are the float checkpoint's, exactly."""
    gguf_path, _, _, float_dir = mixtral_quantised
    model = load_model(gguf_path)
    floats = load_file(str(float_dir / "model.safetensors"))
    types = FILE_TYPES["q4_k_m"]
    for i, layer in enumerate(model.layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            projection = getattr(layer.attn, name)
            assert projection.fmt == weight_format(types[name].lower()), name
            values = projection.fmt.dequantize(projection.weight, torch.float32)
            expected = floats[f"model.layers.{i}.self_attn.{name}.weight"]
            assert torch.equal(values.reshape(expected.shape), expected), (i, name)
    assert model.lm_head.fmt == weight_format(types["lm_head"].lower())


@pytest.mark.parametrize("target", list(DECODE_TARGETS))
def test_mixtral_quantised_dense_greedy_matches_transformers(mixtral_quantised, target) -> None:
    gguf_path, tokens, reference_logits, _ = mixtral_quantised
    _assert_transformers_greedy(gguf_path, tokens, reference_logits, target)
