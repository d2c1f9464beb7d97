"""Qwen2-MoE (`Qwen2MoeForCausalLM`): q/k/v biases, the Qwen layer map, and a sigmoid-gated
shared expert beside the routed ones in every MoE layer. Per-layer sliding windows are refused.

QWEN2_MOE_DEFAULTS holds the value `transformers.Qwen2MoeConfig` (version 5) gives every field
the parser `get`s when config.json lacks it (tests/models/test_config_defaults.py checks each);
size fields without a meaningful default are required instead.
"""

from __future__ import annotations

from types import MappingProxyType

from hybridmoe.config.model import HfConfigReader, ModelConfig
from hybridmoe.loader.gguf import GgufFile
from hybridmoe.models.gguf_config import (
    GgufKeys,
    GgufSpec,
    decoder_fields,
    dense_layers,
    dense_width,
    has_attention_bias,
)
from hybridmoe.models.parsing import decoder_config, qwen_sparse_layers
from hybridmoe.models.registry import ModelFamily, register
from hybridmoe.models.transformer import MoeCausalLM

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


def parse_qwen2_moe(r: HfConfigReader) -> ModelConfig:
    r.refuse_if(
        "use_sliding_window",
        r.get("use_sliding_window", bool),
        "per-layer sliding windows of Qwen2-MoE are not implemented",
    )
    return decoder_config(
        r,
        "Qwen2MoeForCausalLM",
        intermediate_size=r.get("intermediate_size"),
        moe_intermediate_size=r.require("moe_intermediate_size"),
        norm_topk_prob=r.get("norm_topk_prob", bool),
        sparse_layers=qwen_sparse_layers(r),
        qkv_bias=r.get("qkv_bias", bool),
        shared_expert_intermediate_size=r.get("shared_expert_intermediate_size"),
    )


def qwen2moe_config(gguf: GgufFile) -> dict:
    """GGUF `qwen2moe` metadata as Qwen2-MoE config.json fields (llama.cpp's qwen2moe graph
    does not renormalise the top-k weights unless `expert_weights_norm` says so)."""
    keys = GgufKeys(gguf)
    dense = dense_layers(keys)
    return {
        **decoder_fields(keys, "Qwen2MoeForCausalLM"),
        "moe_intermediate_size": keys.require("expert_feed_forward_length"),
        "shared_expert_intermediate_size": keys.require("expert_shared_feed_forward_length"),
        "intermediate_size": dense_width(keys, dense),
        "mlp_only_layers": dense,
        "norm_topk_prob": keys.get("expert_weights_norm", bool, False),
        "qkv_bias": has_attention_bias(keys),
    }


QWEN2_MOE = register(
    ModelFamily(
        architecture="Qwen2MoeForCausalLM",
        parse_config=parse_qwen2_moe,
        defaults=QWEN2_MOE_DEFAULTS,
        build=MoeCausalLM,
        router="softmax_topk",
        shared_expert="sigmoid_gated",
        attention="gqa",
        gguf=GgufSpec("qwen2moe", qwen2moe_config),
    )
)
