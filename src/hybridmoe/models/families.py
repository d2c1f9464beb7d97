"""The supported families: how each reads its config.json and names its MoE weights.

Each family's table of defaults holds the value its `transformers` config class (version 5)
gives every field the parser `get`s when config.json lacks it; tests/models/
test_config_defaults.py checks each entry against that class. Size fields without a meaningful
default (vocab_size, hidden_size, expert counts and widths, ...) are required instead.
"""

from __future__ import annotations

from types import MappingProxyType

from hybridmoe.models.config import HfConfigReader, ModelConfig, read_rope
from hybridmoe.models.registry import ModelFamily, register


def _common(r: HfConfigReader, architecture: str, **family_fields) -> ModelConfig:
    r.refuse_if("hidden_act", r.get("hidden_act", str) != "silu", "only 'silu' experts")
    layers = r.require("num_hidden_layers")
    heads = r.require("num_attention_heads")
    r.refuse_if("num_attention_heads", heads < 1, "must be >= 1")
    fields = dict(
        architecture=architecture,
        vocab_size=r.require("vocab_size"),
        hidden_size=r.require("hidden_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=r.get("num_key_value_heads"),
        head_dim=r.get("head_dim"),
        num_experts=r.first(("num_experts", "num_local_experts")),
        top_k=r.require("num_experts_per_tok"),
        sparse_layers=(True,) * layers,
        rms_norm_eps=r.get("rms_norm_eps", float),
        rope=read_rope(r),
        max_position_embeddings=r.get("max_position_embeddings"),
        tie_word_embeddings=r.get("tie_word_embeddings", bool),
        eos_token_ids=r.eos_token_ids(),
    )
    fields.update(family_fields)
    return ModelConfig(**fields)


def _qwen_sparse_layers(r: HfConfigReader) -> tuple[bool, ...]:
    """Qwen MoE layer map: `mlp_only_layers` are dense; otherwise every `decoder_sparse_step`-th."""
    layers = r.require("num_hidden_layers")
    step = r.get("decoder_sparse_step")
    dense = r.get("mlp_only_layers", list)
    r.refuse_if("decoder_sparse_step", step < 1, "must be >= 1")
    is_index = [isinstance(i, int) and not isinstance(i, bool) for i in dense]
    r.refuse_if("mlp_only_layers", not all(is_index), "must be a list of layer indices")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


def _attention_heads(r: HfConfigReader) -> int:
    return r.require("num_attention_heads")


QWEN3_MOE_DEFAULTS = MappingProxyType(  # transformers.Qwen3MoeConfig
    {
        "hidden_act": "silu",
        "num_key_value_heads": 4,
        "head_dim": HfConfigReader.hidden_per_head,  # Qwen3MoeAttention's getattr default
        "intermediate_size": 6144,  # dense (mlp_only / off-step) layers
        "norm_topk_prob": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,  # used only with use_sliding_window
        "decoder_sparse_step": 1,
        "mlp_only_layers": (),
        "eos_token_id": None,
    }
)


def _qwen3_moe(r: HfConfigReader) -> ModelConfig:
    window = r.get("sliding_window") if r.get("use_sliding_window", bool) else None
    return _common(
        r,
        "Qwen3MoeForCausalLM",
        intermediate_size=r.get("intermediate_size"),
        moe_intermediate_size=r.require("moe_intermediate_size"),
        norm_topk_prob=r.get("norm_topk_prob", bool),
        sparse_layers=_qwen_sparse_layers(r),
        qkv_bias=r.get("attention_bias", bool),
        o_bias=r.get("attention_bias", bool),
        qk_norm="per_head",
        sliding_window=window,
    )


QWEN2_MOE_DEFAULTS = MappingProxyType(  # transformers.Qwen2MoeConfig
    {
        "hidden_act": "silu",
        "num_key_value_heads": 16,
        "head_dim": HfConfigReader.hidden_per_head,  # Qwen2MoeAttention's getattr default
        "intermediate_size": 5632,  # dense (mlp_only / off-step) layers
        "norm_topk_prob": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "qkv_bias": True,
        "use_sliding_window": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": (),
        "shared_expert_intermediate_size": 5632,  # every MoE layer has a shared expert
        "eos_token_id": None,
    }
)


def _qwen2_moe(r: HfConfigReader) -> ModelConfig:
    r.refuse_if(
        "use_sliding_window",
        r.get("use_sliding_window", bool),
        "per-layer sliding windows of Qwen2-MoE are not implemented",
    )
    return _common(
        r,
        "Qwen2MoeForCausalLM",
        intermediate_size=r.get("intermediate_size"),
        moe_intermediate_size=r.require("moe_intermediate_size"),
        norm_topk_prob=r.get("norm_topk_prob", bool),
        sparse_layers=_qwen_sparse_layers(r),
        qkv_bias=r.get("qkv_bias", bool),
        shared_expert_intermediate_size=r.get("shared_expert_intermediate_size"),
    )


MIXTRAL_DEFAULTS = MappingProxyType(  # transformers.MixtralConfig
    {
        "hidden_act": "silu",
        "num_key_value_heads": 8,
        "head_dim": HfConfigReader.hidden_per_head,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,  # MixtralConfig.default_theta
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "eos_token_id": 2,
    }
)


def _mixtral(r: HfConfigReader) -> ModelConfig:
    experts_width = r.require("intermediate_size")
    return _common(
        r,
        "MixtralForCausalLM",
        intermediate_size=experts_width,  # no dense layers
        moe_intermediate_size=experts_width,
        norm_topk_prob=True,  # Mixtral always renormalises its top-k weights
        router_weights_fp32=True,  # MixtralTopKRouter does not round them to the activation dtype
        sliding_window=r.get("sliding_window"),
    )


OLMOE_DEFAULTS = MappingProxyType(  # transformers.OlmoeConfig
    {
        "hidden_act": "silu",
        "num_key_value_heads": _attention_heads,  # OlmoeConfig.__post_init__
        "head_dim": HfConfigReader.hidden_per_head,  # OlmoeAttention's getattr default
        "norm_topk_prob": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "clip_qkv": None,
        "eos_token_id": 50279,
    }
)


def _olmoe(r: HfConfigReader) -> ModelConfig:
    clip = r.get("clip_qkv", float)
    r.refuse_if("clip_qkv", clip is not None and clip <= 0, "must be positive")
    experts_width = r.require("intermediate_size")
    return _common(
        r,
        "OlmoeForCausalLM",
        intermediate_size=experts_width,  # no dense layers
        moe_intermediate_size=experts_width,
        norm_topk_prob=r.get("norm_topk_prob", bool),
        qkv_bias=r.get("attention_bias", bool),
        o_bias=r.get("attention_bias", bool),
        qk_norm="full",
        clip_qkv=clip,
    )


register(ModelFamily("Qwen3MoeForCausalLM", _qwen3_moe, QWEN3_MOE_DEFAULTS))
register(ModelFamily("Qwen2MoeForCausalLM", _qwen2_moe, QWEN2_MOE_DEFAULTS))
register(ModelFamily("OlmoeForCausalLM", _olmoe, OLMOE_DEFAULTS))
register(
    ModelFamily(
        "MixtralForCausalLM", _mixtral, MIXTRAL_DEFAULTS, "block_sparse_moe", ("w1", "w3", "w2")
    )
)
