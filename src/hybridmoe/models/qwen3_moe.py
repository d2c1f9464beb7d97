"""Qwen3-MoE (`Qwen3MoeForCausalLM`): per-head q/k norms, optional sliding window, the Qwen
layer map (`mlp_only_layers`, `decoder_sparse_step`).

QWEN3_MOE_DEFAULTS holds the value `transformers.Qwen3MoeConfig` (version 5) gives every field
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


def parse_qwen3_moe(r: HfConfigReader) -> ModelConfig:
    window = r.get("sliding_window") if r.get("use_sliding_window", bool) else None
    return decoder_config(
        r,
        "Qwen3MoeForCausalLM",
        intermediate_size=r.get("intermediate_size"),
        moe_intermediate_size=r.require("moe_intermediate_size"),
        norm_topk_prob=r.get("norm_topk_prob", bool),
        sparse_layers=qwen_sparse_layers(r),
        qkv_bias=r.get("attention_bias", bool),
        o_bias=r.get("attention_bias", bool),
        qk_norm="per_head",
        sliding_window=window,
    )


def qwen3moe_config(gguf: GgufFile) -> dict:
    """GGUF `qwen3moe` metadata as Qwen3-MoE config.json fields. llama.cpp's qwen3moe graph
    always renormalises the top-k weights; `expert_weights_norm`, when present, says so."""
    keys = GgufKeys(gguf)
    dense = dense_layers(keys)
    window = keys.get("attention.sliding_window")
    return {
        **decoder_fields(keys, "Qwen3MoeForCausalLM"),
        "moe_intermediate_size": keys.require("expert_feed_forward_length"),
        "intermediate_size": dense_width(keys, dense),
        "mlp_only_layers": dense,
        "norm_topk_prob": keys.get("expert_weights_norm", bool, True),
        "attention_bias": has_attention_bias(keys),
        "use_sliding_window": window is not None,
        "sliding_window": window,
    }


QWEN3_MOE = register(
    ModelFamily(
        architecture="Qwen3MoeForCausalLM",
        parse_config=parse_qwen3_moe,
        defaults=QWEN3_MOE_DEFAULTS,
        build=MoeCausalLM,
        router="softmax_topk",
        attention="gqa",
        gguf=GgufSpec("qwen3moe", qwen3moe_config),
    )
)
