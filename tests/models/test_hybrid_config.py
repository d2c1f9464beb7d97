"""Config parsing of the hybrid linear-attention families: the layer map from `layer_types`
or `full_attention_interval` as transformers' config classes build it, the partial-rotary
default, Qwen3.5's text_config inside a multimodal config, and clear refusals."""

from __future__ import annotations

import pytest
import transformers

from hybridmoe.errors import UnsupportedConfigError
from hybridmoe.models.registry import MODEL_REGISTRY

SIZES = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8,
)  # fmt: skip
CLASSES = {
    "Qwen3NextForCausalLM": "Qwen3NextConfig",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeTextConfig",
}


def _parse(architecture: str, raw: dict):
    return MODEL_REGISTRY[architecture].config_from({**raw, "architectures": [architecture]})


@pytest.mark.parametrize("architecture", CLASSES)
@pytest.mark.parametrize("interval", [None, 2, 3])
def test_layer_map_is_transformers(architecture: str, interval: int | None) -> None:
    extra = {} if interval is None else {"full_attention_interval": interval}
    hf = getattr(transformers, CLASSES[architecture])(**SIZES, **extra)
    expected = tuple(t == "linear_attention" for t in hf.layer_types)
    assert _parse(architecture, {**SIZES, **extra}).linear_layers == expected
    assert _parse(architecture, hf.to_dict()).linear_layers == expected  # layer_types spelt


@pytest.mark.parametrize("architecture", CLASSES)
def test_partial_rotary_defaults_to_a_quarter(architecture: str) -> None:
    assert _parse(architecture, SIZES).rope.partial_rotary_factor == 0.25
    cfg = _parse(architecture, {**SIZES, "rope_parameters": {"partial_rotary_factor": 0.5}})
    assert cfg.rope.partial_rotary_factor == 0.5


def test_multimodal_config_reads_its_text_config() -> None:
    raw = {"text_config": dict(SIZES), "tie_word_embeddings": True}
    cfg = _parse("Qwen3_5MoeForConditionalGeneration", raw)
    text = _parse("Qwen3_5MoeForCausalLM", SIZES)
    assert cfg.linear_attention == text.linear_attention and cfg.linear_layers == text.linear_layers
    assert cfg.tie_word_embeddings and cfg.norm_topk_prob


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layer_types": ["linear_attention"] * 5 + ["sliding_attention"]}, "layer_types"),
        ({"layer_types": ["full_attention"] * 2}, "layer_types"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"full_attention_interval": 0}, "full_attention_interval"),
    ],
)
def test_bad_hybrid_fields_are_refused(change: dict, field: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=field):
        _parse("Qwen3NextForCausalLM", {**SIZES, **change})


def test_other_families_still_refuse_partial_rotary() -> None:
    raw = {**SIZES, "moe_intermediate_size": 8, "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedConfigError, match="partial_rotary_factor"):
        _parse("Qwen3MoeForCausalLM", raw)
