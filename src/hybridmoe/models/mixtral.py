"""Mixtral (`MixtralForCausalLM`): every layer sparse, experts named w1/w3/w2 under
`block_sparse_moe`, top-k weights always renormalised and kept in float32.

MIXTRAL_DEFAULTS holds the value `transformers.MixtralConfig` (version 5) gives every field the
parser `get`s when config.json lacks it (tests/models/test_config_defaults.py checks each);
size fields without a meaningful default are required instead.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from hybridmoe.config.model import HfConfigReader, ModelConfig
from hybridmoe.loader.gguf import GgufFile
from hybridmoe.loader.gguf_weights import RowRestore
from hybridmoe.models.gguf_config import GgufKeys, GgufSpec, decoder_fields, unpermute_rope_rows
from hybridmoe.models.parsing import decoder_config
from hybridmoe.models.registry import ModelFamily, WeightNames, register
from hybridmoe.models.transformer import MoeCausalLM

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


def parse_mixtral(r: HfConfigReader) -> ModelConfig:
    experts_width = r.require("intermediate_size")
    return decoder_config(
        r,
        "MixtralForCausalLM",
        intermediate_size=experts_width,  # no dense layers
        moe_intermediate_size=experts_width,
        norm_topk_prob=True,  # Mixtral always renormalises its top-k weights
        router_weights_fp32=True,  # MixtralTopKRouter does not round them to the activation dtype
        sliding_window=r.get("sliding_window"),
    )


def mixtral_config(gguf: GgufFile) -> dict:
    """GGUF `llama` metadata with experts as Mixtral config.json fields (a `llama` file without
    experts is a dense model: refused). The experts' width is `feed_forward_length`."""
    keys = GgufKeys(gguf)
    if not keys.get("expert_count"):
        keys.refuse("expert_count", "a llama GGUF without experts is a dense model")
    if not keys.get("expert_weights_norm", bool, True):
        keys.refuse("expert_weights_norm", "Mixtral always renormalises its top-k weights")
    return {
        **decoder_fields(keys, "MixtralForCausalLM"),
        "intermediate_size": keys.require("feed_forward_length"),
        "sliding_window": keys.get("attention.sliding_window"),
    }


def mixtral_restore(cfg: ModelConfig) -> RowRestore:
    """llama.cpp's converter permutes llama-arch q/k rows for its rotary layout: undo it, as a
    row order (a quantised q or k stays in the file's type, its rows reordered)."""
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}

    def order(name: str, rows: int) -> torch.Tensor | None:
        parts = name.rsplit(".", 2)
        if len(parts) < 3 or parts[-2] not in heads:
            return None
        return unpermute_rope_rows(torch.arange(rows), heads[parts[-2]])

    return RowRestore(order)


MIXTRAL = register(
    ModelFamily(
        architecture="MixtralForCausalLM",
        parse_config=parse_mixtral,
        defaults=MIXTRAL_DEFAULTS,
        build=MoeCausalLM,
        weights=WeightNames(moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2")),
        router="softmax_topk",
        attention="gqa",
        gguf=GgufSpec("llama", mixtral_config, mixtral_restore),
    )
)
