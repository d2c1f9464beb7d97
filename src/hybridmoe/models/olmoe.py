"""OLMoE (`OlmoeForCausalLM`): every layer sparse, q/k norms over all heads, optional qkv
clipping.

OLMOE_DEFAULTS holds the value `transformers.OlmoeConfig` (version 5) gives every field the
parser `get`s when config.json lacks it (tests/models/test_config_defaults.py checks each);
size fields without a meaningful default are required instead.
"""

from __future__ import annotations

from types import MappingProxyType

from hybridmoe.config.model import HfConfigReader, ModelConfig
from hybridmoe.loader.gguf import GgufFile
from hybridmoe.models.gguf_config import GgufKeys, GgufSpec, decoder_fields, has_attention_bias
from hybridmoe.models.parsing import decoder_config
from hybridmoe.models.registry import ModelFamily, register
from hybridmoe.models.transformer import MoeCausalLM


def _attention_heads(r: HfConfigReader) -> int:
    return r.require("num_attention_heads")


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


def parse_olmoe(r: HfConfigReader) -> ModelConfig:
    clip = r.get("clip_qkv", float)
    r.refuse_if("clip_qkv", clip is not None and clip <= 0, "must be positive")
    experts_width = r.require("intermediate_size")
    return decoder_config(
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


def olmoe_config(gguf: GgufFile) -> dict:
    """GGUF `olmoe` metadata as OLMoE config.json fields: the experts' width is
    `feed_forward_length`, qkv clipping `attention.clamp_kqv`."""
    keys = GgufKeys(gguf)
    return {
        **decoder_fields(keys, "OlmoeForCausalLM"),
        "intermediate_size": keys.require("feed_forward_length"),
        "norm_topk_prob": keys.get("expert_weights_norm", bool, False),
        "attention_bias": has_attention_bias(keys),
        "clip_qkv": keys.get("attention.clamp_kqv", float),
    }


OLMOE = register(
    ModelFamily(
        architecture="OlmoeForCausalLM",
        parse_config=parse_olmoe,
        defaults=OLMOE_DEFAULTS,
        build=MoeCausalLM,
        router="softmax_topk",
        attention="gqa",
        gguf=GgufSpec("olmoe", olmoe_config),
    )
)
