"""The supported families: how each reads its config.json and names its MoE weights."""

from __future__ import annotations

from hybridmoe.models.config import HfConfigReader, ModelConfig, read_rope
from hybridmoe.models.registry import ModelFamily, register


def _common(r: HfConfigReader, architecture: str, **family_fields) -> ModelConfig:
    r.refuse_if("hidden_act", r.raw.get("hidden_act", "silu") != "silu", "only 'silu' experts")
    layers = r.require("num_hidden_layers")
    fields = dict(
        architecture=architecture,
        vocab_size=r.require("vocab_size"),
        hidden_size=r.require("hidden_size"),
        num_layers=layers,
        num_heads=r.require("num_attention_heads"),
        num_kv_heads=r.get("num_key_value_heads", r.require("num_attention_heads")),
        head_dim=r.head_dim(),
        intermediate_size=r.get("intermediate_size", 0),
        num_experts=r.first(("num_experts", "num_local_experts")),
        top_k=r.require("num_experts_per_tok"),
        norm_topk_prob=r.get("norm_topk_prob", False, bool),
        sparse_layers=(True,) * layers,
        rms_norm_eps=r.get("rms_norm_eps", 1e-6, float),
        rope=read_rope(r),
        max_position_embeddings=r.get("max_position_embeddings", 4096),
        tie_word_embeddings=r.get("tie_word_embeddings", False, bool),
        eos_token_ids=r.eos_token_ids(),
    )
    fields.update(family_fields)
    return ModelConfig(**fields)


def _qwen_sparse_layers(r: HfConfigReader) -> tuple[bool, ...]:
    """Qwen MoE layer map: `mlp_only_layers` are dense; otherwise every `decoder_sparse_step`-th."""
    layers = r.require("num_hidden_layers")
    step = r.get("decoder_sparse_step", 1)
    dense = r.get("mlp_only_layers", [], list)
    r.refuse_if("decoder_sparse_step", step < 1, "must be >= 1")
    is_index = [isinstance(i, int) and not isinstance(i, bool) for i in dense]
    r.refuse_if("mlp_only_layers", not all(is_index), "must be a list of layer indices")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


def _qwen3_moe(r: HfConfigReader) -> ModelConfig:
    window = r.get("sliding_window", None) if r.get("use_sliding_window", False, bool) else None
    return _common(
        r,
        "Qwen3MoeForCausalLM",
        moe_intermediate_size=r.require("moe_intermediate_size"),
        sparse_layers=_qwen_sparse_layers(r),
        qkv_bias=r.get("attention_bias", False, bool),
        o_bias=r.get("attention_bias", False, bool),
        qk_norm="per_head",
        sliding_window=window,
    )


def _qwen2_moe(r: HfConfigReader) -> ModelConfig:
    r.refuse_if(
        "use_sliding_window",
        r.get("use_sliding_window", False, bool),
        "per-layer sliding windows of Qwen2-MoE are not implemented",
    )
    return _common(
        r,
        "Qwen2MoeForCausalLM",
        moe_intermediate_size=r.require("moe_intermediate_size"),
        sparse_layers=_qwen_sparse_layers(r),
        qkv_bias=r.get("qkv_bias", True, bool),
        shared_expert_intermediate_size=r.get("shared_expert_intermediate_size", 0),
    )


def _mixtral(r: HfConfigReader) -> ModelConfig:
    return _common(
        r,
        "MixtralForCausalLM",
        moe_intermediate_size=r.require("intermediate_size"),
        norm_topk_prob=True,  # Mixtral always renormalises its top-k weights
        sliding_window=r.get("sliding_window", None),
    )


def _olmoe(r: HfConfigReader) -> ModelConfig:
    clip = r.get("clip_qkv", None, float)
    r.refuse_if("clip_qkv", clip is not None and clip <= 0, "must be positive")
    return _common(
        r,
        "OlmoeForCausalLM",
        moe_intermediate_size=r.require("intermediate_size"),
        qkv_bias=r.get("attention_bias", False, bool),
        o_bias=r.get("attention_bias", False, bool),
        qk_norm="full",
        clip_qkv=clip,
    )


register(ModelFamily("Qwen3MoeForCausalLM", _qwen3_moe))
register(ModelFamily("Qwen2MoeForCausalLM", _qwen2_moe))
register(ModelFamily("OlmoeForCausalLM", _olmoe))
register(ModelFamily("MixtralForCausalLM", _mixtral, "block_sparse_moe", ("w1", "w3", "w2")))
