"""Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, and the text
model of `Qwen3_5MoeForConditionalGeneration`): hybrid linear attention with MoE.

Most layers are Gated DeltaNet (linear attention with a recurrent state, no KV); every
`full_attention_interval`-th (or as `layer_types` says) is gated full attention with partial
rotary. RMSNorms are zero-centred (scale 1 + w). Every MoE block has a sigmoid-gated shared
expert; the router is softmax top-k (Qwen3.5 always renormalises the top-k weights). The two
families differ in the linear layers' projection layout (Qwen3-Next fuses qkvz and ba, grouped
by key head), in the layer map (Qwen3-Next has Qwen3-MoE's dense layers), and in where the
weights live (Qwen3.5's multimodal checkpoints keep the text model under
`model.language_model`; their vision tower is not loaded).

The DEFAULTS tables hold what `transformers.Qwen3NextConfig` and `Qwen3_5MoeTextConfig`
(version 5) give a field config.json lacks.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import hybridmoe.layers.gated_attention  # noqa: F401  registers attention kind "gated_gqa"
import hybridmoe.layers.gated_deltanet  # noqa: F401  registers the "gated_deltanet*" kinds
from hybridmoe.config.model import HfConfigReader, LinearAttentionConfig, ModelConfig
from hybridmoe.models.gguf_config import GgufSpec
from hybridmoe.models.parsing import decoder_config, qwen_sparse_layers
from hybridmoe.models.qwen3_next_gguf import QWEN3NEXT_GGUF, QWEN35MOE_GGUF
from hybridmoe.models.registry import ModelFamily, WeightNames, register
from hybridmoe.models.transformer import MoeCausalLM

_HYBRID_DEFAULTS = {  # shared by both config classes
    "hidden_act": "silu",
    "num_key_value_heads": 2,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "full_attention_interval": 4,
    "eos_token_id": None,
}
QWEN3_NEXT_DEFAULTS = MappingProxyType(  # transformers.Qwen3NextConfig
    {
        **_HYBRID_DEFAULTS,
        "intermediate_size": 5632,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": (),
    }
)
QWEN3_5_MOE_DEFAULTS = MappingProxyType(  # transformers.Qwen3_5MoeTextConfig
    dict(_HYBRID_DEFAULTS)
)
PARTIAL_ROTARY_DEFAULT = 0.25  # both config classes' partial_rotary_factor
LAYER_TYPES = {"linear_attention": True, "full_attention": False}  # -> is linear


def linear_layers(r: HfConfigReader) -> tuple[bool, ...]:
    """Per layer, linear attention or not: `layer_types` when given, else every
    `full_attention_interval`-th layer is full attention (the config classes' rule)."""
    layers = r.require("num_hidden_layers")
    types = r.raw.get("layer_types")
    if types is None:
        interval = r.get("full_attention_interval")
        r.refuse_if("full_attention_interval", interval < 1, "must be >= 1")
        return tuple((i + 1) % interval != 0 for i in range(layers))
    r.refuse_if(
        "layer_types",
        not isinstance(types, list) or len(types) != layers or not set(types) <= set(LAYER_TYPES),
        f"must list one of {sorted(LAYER_TYPES)} per layer ({layers})",
    )
    return tuple(LAYER_TYPES[t] for t in types)


def _hybrid_fields(r: HfConfigReader) -> dict:
    bias = r.get("attention_bias", bool)
    linear = LinearAttentionConfig(
        num_key_heads=r.get("linear_num_key_heads"),
        num_value_heads=r.get("linear_num_value_heads"),
        key_head_dim=r.get("linear_key_head_dim"),
        value_head_dim=r.get("linear_value_head_dim"),
        conv_kernel=r.get("linear_conv_kernel_dim"),
    )
    return dict(
        moe_intermediate_size=r.get("moe_intermediate_size"),
        shared_expert_intermediate_size=r.get("shared_expert_intermediate_size"),
        qkv_bias=bias,
        o_bias=bias,
        linear_layers=linear_layers(r),
        linear_attention=linear,
    )


def parse_qwen3_next(r: HfConfigReader) -> ModelConfig:
    return decoder_config(
        r,
        "Qwen3NextForCausalLM",
        PARTIAL_ROTARY_DEFAULT,
        intermediate_size=r.get("intermediate_size"),
        norm_topk_prob=r.get("norm_topk_prob", bool),
        sparse_layers=qwen_sparse_layers(r),
        **_hybrid_fields(r),
    )


def parse_qwen3_5_moe_text(r: HfConfigReader, architecture: str) -> ModelConfig:
    """Every layer is sparse; the top-k weights are always renormalised."""
    layers = r.require("num_hidden_layers")
    return decoder_config(
        r,
        architecture,
        PARTIAL_ROTARY_DEFAULT,
        intermediate_size=0,  # no dense MLP layers
        norm_topk_prob=True,
        sparse_layers=(True,) * layers,
        **_hybrid_fields(r),
    )


def parse_qwen3_5_moe_multimodal(r: HfConfigReader) -> ModelConfig:
    """The text model of a Qwen3_5MoeForConditionalGeneration config: `text_config`, with the
    outer `tie_word_embeddings` (the one the multimodal model ties by)."""
    text = HfConfigReader(r.section("text_config"), f"{r.source} (text_config)", r.defaults)
    cfg = parse_qwen3_5_moe_text(text, "Qwen3_5MoeForConditionalGeneration")
    return replace(cfg, tie_word_embeddings=r.get("tie_word_embeddings", bool))


def _family(
    architecture: str,
    parse,
    defaults,
    weights: WeightNames,
    linear: str,
    gguf: GgufSpec | None = None,
) -> ModelFamily:
    return register(
        ModelFamily(
            architecture=architecture,
            parse_config=parse,
            defaults=defaults,
            build=MoeCausalLM,
            weights=weights,
            router="softmax_topk",
            shared_expert="sigmoid_gated",
            attention="gated_gqa",
            linear_attention=linear,
            norm="offset_rms",
            gguf=gguf,
        )
    )


_MTP = ("mtp.",)  # multi-token-prediction heads, which transformers skips too
QWEN3_NEXT = _family(
    "Qwen3NextForCausalLM",
    parse_qwen3_next,
    QWEN3_NEXT_DEFAULTS,
    WeightNames(ignored_prefixes=_MTP),
    "gated_deltanet_qkvz",
    QWEN3NEXT_GGUF,
)
QWEN3_5_MOE = _family(
    "Qwen3_5MoeForCausalLM",
    lambda r: parse_qwen3_5_moe_text(r, "Qwen3_5MoeForCausalLM"),
    QWEN3_5_MOE_DEFAULTS,
    WeightNames(ignored_prefixes=(*_MTP, "model.visual.")),
    "gated_deltanet",
    QWEN35MOE_GGUF,  # GGUF files of the multimodal checkpoints hold the text model only
)
QWEN3_5_MOE_MULTIMODAL = _family(
    "Qwen3_5MoeForConditionalGeneration",
    parse_qwen3_5_moe_multimodal,
    QWEN3_5_MOE_DEFAULTS,
    WeightNames(model_prefix="model.language_model", ignored_prefixes=(*_MTP, "model.visual.")),
    "gated_deltanet",
)
