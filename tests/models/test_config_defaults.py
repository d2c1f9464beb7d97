"""Config defaults: every field a family's parser takes from its table of defaults, when absent
from config.json, gives the value that `transformers`' config class for that family gives.

The fields are enumerated from the tables themselves (ModelFamily.defaults), so a default added
there without a way to compare it here fails `test_every_default_can_be_compared`."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

import pytest
import transformers

from hf_checkpoints import FAMILIES
from hybridmoe.config.model import ModelConfig
from hybridmoe.models.registry import MODEL_REGISTRY, family_for

# A config.json per family that sets every field of its defaults table to a value other than
# the default (dropping one field then shows that field's default alone). 16 heads divide by
# every family's default num_key_value_heads; head_dim 32 differs from hidden / heads.
_SHAPES: dict[str, Any] = dict(
    vocab_size=51200,
    hidden_size=256,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=32,
    num_experts_per_tok=2,
    hidden_act="silu",
    rms_norm_eps=1e-3,
    rope_theta=5e5,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    eos_token_id=7,
)
_QWEN: dict[str, Any] = dict(
    num_hidden_layers=4,
    num_experts=8,
    moe_intermediate_size=32,
    intermediate_size=96,
    norm_topk_prob=True,
    decoder_sparse_step=2,
    mlp_only_layers=[1],
    sliding_window=64,
)
FULL_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {**_SHAPES, **_QWEN, "attention_bias": True, "use_sliding_window": True},
    # use_sliding_window stays false: we refuse Qwen2-MoE's per-layer windows.
    "qwen2_moe": {
        **_SHAPES,
        **_QWEN,
        "qkv_bias": False,
        "use_sliding_window": False,
        "shared_expert_intermediate_size": 48,
    },
    "mixtral": {
        **_SHAPES,
        "num_hidden_layers": 2,
        "num_local_experts": 8,
        "intermediate_size": 32,
        "sliding_window": 64,
    },
    "olmoe": {
        **_SHAPES,
        "num_hidden_layers": 2,
        "num_experts": 8,
        "intermediate_size": 32,
        "norm_topk_prob": True,
        "attention_bias": True,
        "clip_qkv": 2.0,
    },
    "gpt_oss": {
        **_SHAPES,
        "num_hidden_layers": 2,
        "num_local_experts": 8,
        "intermediate_size": 32,
        "sliding_window": 64,
        "attention_bias": False,
        "swiglu_alpha": 1.5,
        "swiglu_limit": 5.0,
    },
}
_HYBRID: dict[str, Any] = {
    **_SHAPES,
    "num_hidden_layers": 8,
    "num_experts": 8,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "attention_bias": True,
    "linear_conv_kernel_dim": 3,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,
    "linear_num_key_heads": 8,  # dropped, the default 16 still divides the 48 value heads
    "linear_num_value_heads": 48,
    "full_attention_interval": 2,
}
FULL_CONFIGS["qwen3_next"] = {
    **_HYBRID,
    "intermediate_size": 96,
    "norm_topk_prob": False,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [1],
}
FULL_CONFIGS["qwen3_5_moe"] = _HYBRID
# family -> (config class, model class): those of the oracle checkpoints, and the hybrid
# linear-attention families (tests/hybrid_checkpoints.py). Qwen3_5MoeForConditionalGeneration
# reads the same table from its text_config (tests/models/test_hybrid_config.py).
CLASSES = {
    **FAMILIES,
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}
ARCHITECTURE = {family: classes[1] for family, classes in CLASSES.items()}
MULTIMODAL = {"Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}  # -> its table


def _hf_sparse_layers(hf) -> tuple[bool, ...]:
    # Qwen*MoeDecoderLayer: which layers get a sparse MoE block.
    return tuple(
        i not in hf.mlp_only_layers and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0
        for i in range(hf.num_hidden_layers)
    )


def _hf_window(hf) -> int | None:
    layer_types = getattr(hf, "layer_types", None)  # Qwen2-MoE: windows per layer type
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return hf.sliding_window


def _hf_eos(hf) -> tuple[int, ...]:
    eos = hf.eos_token_id
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


def _hf_attention_bias(hf) -> tuple[bool, bool]:
    if hasattr(hf, "qkv_bias"):  # Qwen2-MoE: q/k/v biased, o_proj never
        return hf.qkv_bias, False
    return hf.attention_bias, hf.attention_bias


Compare = tuple[Callable[[ModelConfig], Any], Callable[[Any], Any]]
# config.json field -> (the value we use, the value `transformers` uses) for a parsed config.
EFFECTIVE: dict[str, Compare] = {
    # Any other activation is refused at parse time, so a parsed config runs silu.
    "hidden_act": (lambda cfg: "silu", lambda hf: hf.hidden_act),
    "num_key_value_heads": (lambda cfg: cfg.num_kv_heads, lambda hf: hf.num_key_value_heads),
    "head_dim": (
        lambda cfg: cfg.head_dim,
        lambda hf: getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
    ),
    "intermediate_size": (lambda cfg: cfg.intermediate_size, lambda hf: hf.intermediate_size),
    "norm_topk_prob": (lambda cfg: cfg.norm_topk_prob, lambda hf: hf.norm_topk_prob),
    "rms_norm_eps": (lambda cfg: cfg.rms_norm_eps, lambda hf: hf.rms_norm_eps),
    "rope_theta": (lambda cfg: cfg.rope.theta, lambda hf: hf.rope_parameters["rope_theta"]),
    "max_position_embeddings": (
        lambda cfg: cfg.max_position_embeddings,
        lambda hf: hf.max_position_embeddings,
    ),
    "tie_word_embeddings": (lambda cfg: cfg.tie_word_embeddings, lambda hf: hf.tie_word_embeddings),
    "attention_bias": (lambda cfg: (cfg.qkv_bias, cfg.o_bias), _hf_attention_bias),
    "qkv_bias": (lambda cfg: (cfg.qkv_bias, cfg.o_bias), _hf_attention_bias),
    "use_sliding_window": (lambda cfg: cfg.sliding_window, _hf_window),
    "sliding_window": (lambda cfg: cfg.sliding_window, _hf_window),
    "decoder_sparse_step": (lambda cfg: cfg.sparse_layers, _hf_sparse_layers),
    "mlp_only_layers": (lambda cfg: cfg.sparse_layers, _hf_sparse_layers),
    "shared_expert_intermediate_size": (
        lambda cfg: cfg.shared_expert_intermediate_size,
        lambda hf: hf.shared_expert_intermediate_size,
    ),
    "clip_qkv": (lambda cfg: cfg.clip_qkv, lambda hf: hf.clip_qkv),
    "eos_token_id": (lambda cfg: cfg.eos_token_ids, _hf_eos),
    "moe_intermediate_size": (
        lambda cfg: cfg.moe_intermediate_size,
        lambda hf: hf.moe_intermediate_size,
    ),
    "full_attention_interval": (
        lambda cfg: cfg.linear_layers,
        lambda hf: tuple(t == "linear_attention" for t in hf.layer_types),
    ),
    **{
        field: (lambda cfg, ours=ours: getattr(cfg.linear_attention, ours), attrgetter(field))
        for field, ours in (
            ("linear_conv_kernel_dim", "conv_kernel"),
            ("linear_key_head_dim", "key_head_dim"),
            ("linear_value_head_dim", "value_head_dim"),
            ("linear_num_key_heads", "num_key_heads"),
            ("linear_num_value_heads", "num_value_heads"),
        )
    },
    "swiglu_alpha": (lambda cfg: cfg.swiglu_alpha, lambda hf: hf.swiglu_alpha),
    "swiglu_limit": (lambda cfg: cfg.swiglu_limit, lambda hf: hf.swiglu_limit),
}

DEFAULTED_FIELDS = [
    (family, field)
    for family, architecture in ARCHITECTURE.items()
    for field in MODEL_REGISTRY[architecture].defaults
]


def config_json(family: str, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    raw = {"architectures": [ARCHITECTURE[family]], **FULL_CONFIGS[family]}
    return {name: value for name, value in raw.items() if name not in drop}


def ours(raw: dict[str, Any]) -> ModelConfig:
    return family_for(raw).config_from(raw)


def theirs(family: str, raw: dict[str, Any]):
    """The config `transformers` builds from this config.json (as from_pretrained does)."""
    return getattr(transformers, CLASSES[family][0]).from_dict(raw)


def test_every_family_has_a_table():
    assert set(ARCHITECTURE.values()) | set(MULTIMODAL) == set(MODEL_REGISTRY)
    assert all(MODEL_REGISTRY[a].defaults for a in ARCHITECTURE.values())
    for multimodal, text in MULTIMODAL.items():
        assert MODEL_REGISTRY[multimodal].defaults is MODEL_REGISTRY[text].defaults


@pytest.mark.parametrize(("family", "field"), DEFAULTED_FIELDS)
def test_every_default_can_be_compared(family, field):
    assert field in EFFECTIVE, f"add a comparison for {family}'s default of '{field}'"
    assert field in FULL_CONFIGS[family], f"set '{field}' in FULL_CONFIGS['{family}']"


@pytest.mark.parametrize(("family", "field"), DEFAULTED_FIELDS)
def test_absent_field_takes_the_reference_default(family, field):
    ours_value, theirs_value = EFFECTIVE[field]
    raw = config_json(family, drop=(field,))
    expected = theirs_value(theirs(family, raw))
    actual = ours_value(ours(raw))
    assert actual == expected, f"{family} without '{field}': we use {actual!r}, HF {expected!r}"


@pytest.mark.parametrize("family", ARCHITECTURE)
def test_full_config_matches_transformers(family):
    # Guards the comparisons: with every field present both sides must already agree.
    raw = config_json(family)
    cfg, hf = ours(raw), theirs(family, raw)
    for field in MODEL_REGISTRY[ARCHITECTURE[family]].defaults:
        ours_value, theirs_value = EFFECTIVE[field]
        assert ours_value(cfg) == theirs_value(hf), field


# The cases measured in issue 12, spelled out.
def test_mixtral_rope_theta_and_eps():
    cfg = ours(config_json("mixtral", drop=("rope_theta", "rms_norm_eps")))
    assert cfg.rope.theta == 1e6 and cfg.rms_norm_eps == 1e-5


def test_mixtral_rope_parameters_without_theta():
    raw = config_json("mixtral", drop=("rope_theta",))
    raw["rope_parameters"] = {"rope_type": "default"}
    assert ours(raw).rope.theta == 1e6


def test_olmoe_eps():
    assert ours(config_json("olmoe", drop=("rms_norm_eps",))).rms_norm_eps == 1e-5


def test_qwen2_moe_shared_expert_is_not_dropped():
    cfg = ours(config_json("qwen2_moe", drop=("shared_expert_intermediate_size",)))
    assert cfg.shared_expert_intermediate_size == 5632


@pytest.mark.parametrize(
    ("family", "positions"),
    [
        ("qwen3_moe", 32768),
        ("qwen2_moe", 32768),
        ("mixtral", 131072),
        ("olmoe", 4096),
        ("gpt_oss", 131072),
    ],
)
def test_max_position_embeddings(family, positions):
    cfg = ours(config_json(family, drop=("max_position_embeddings",)))
    assert cfg.max_position_embeddings == positions


@pytest.mark.parametrize(
    ("family", "fp32"),
    [
        ("qwen3_moe", False),
        ("qwen2_moe", False),
        ("mixtral", True),
        ("olmoe", False),
        ("gpt_oss", False),
    ],
)
def test_router_weights_dtype(family, fp32):
    # MixtralTopKRouter keeps its float32 top-k weights; the others cast them to the
    # activation dtype (transformers/models/<family>/modeling_<family>.py).
    assert ours(config_json(family)).router_weights_fp32 is fp32


def test_rope_scaling_wins_over_rope_parameters():
    raw = config_json("qwen3_moe")
    raw["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 7.0}
    hf = theirs("qwen3_moe", raw).rope_parameters
    rope = ours(raw).rope
    assert (rope.rope_type, rope.factor, rope.theta) == (
        hf["rope_type"],
        hf["factor"],
        hf["rope_theta"],
    )


def test_gpt_oss_rope_and_layer_types_defaults():
    # GptOssConfig.__post_init__ fills in YaRN rope_parameters and alternating layer_types
    raw = config_json("gpt_oss", drop=("rope_theta",))
    cfg, hf = ours(raw), theirs("gpt_oss", raw)
    rope, want = cfg.rope, hf.rope_parameters
    assert (rope.rope_type, rope.factor, rope.theta, rope.truncate) == (
        want["rope_type"],
        want["factor"],
        want["rope_theta"],
        want["truncate"],
    )
    assert (rope.original_max_position, rope.beta_fast, rope.beta_slow) == (
        want["original_max_position_embeddings"],
        want["beta_fast"],
        want["beta_slow"],
    )
    assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in hf.layer_types)
    assert cfg.expert_activation == "clamped_swiglu" and cfg.expert_bias and cfg.router_bias
