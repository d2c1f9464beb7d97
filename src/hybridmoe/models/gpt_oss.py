"""gpt-oss (`GptOssForCausalLM`): attention with q/k/v/o biases and per-head learned sinks,
`layer_types` alternating sliding-window and full layers, YaRN RoPE, a router with a bias
(top-k of the logits, softmax over the k), experts with biases and the clamped SwiGLU
(quant/expert_math.py), stored fused: `experts.gate_up_proj` [E, H, 2I] with gate and up
interleaved in the last dimension, `down_proj` [E, I, H], and their biases.

GPT_OSS_DEFAULTS holds the value `transformers.GptOssConfig` (version 5) gives every field the
parser `get`s when config.json lacks it (tests/models/test_config_defaults.py checks each);
size fields without a meaningful default are required instead. Checkpoints with MXFP4 experts
(`quantization_config.quant_method == "mxfp4"`: `gate_up_proj_blocks` / `_scales` and
`down_proj_blocks` / `_scales`, as published) load as stored, in the mxfp4 format
(quant/mxfp4_hf.py rearranges the bytes; nothing is dequantised).

GGUF files (`general.architecture` `gpt-oss`, as llama.cpp's converter writes them) hold the
experts de-interleaved: `blk.N.ffn_{gate,up}_exps` [E, I, H] (gate_up_proj's even and odd
columns), `ffn_down_exps` [E, H, I], each with its bias, in the file's type (MXFP4 as
published, or float); they become the same bank as views of the file.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from hybridmoe.config.model import HfConfigReader, ModelConfig
from hybridmoe.errors import CheckpointError
from hybridmoe.loader.gguf import GgufFile
from hybridmoe.loader.weights import MergedExperts, WeightSource, release_pages
from hybridmoe.models.gguf_config import GgufKeys, GgufSpec, decoder_fields, has_attention_bias
from hybridmoe.models.parsing import decoder_config
from hybridmoe.models.registry import ModelFamily, WeightNames, register
from hybridmoe.models.transformer import MoeCausalLM
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.expert_math import ExpertActivation, ExpertBiases
from hybridmoe.quant.formats import weight_format
from hybridmoe.quant.merged_bank import bank_from_merged
from hybridmoe.quant.mxfp4_hf import bank_from_hf_mxfp4

MXFP4 = weight_format("mxfp4")

# GptOssConfig.__post_init__'s rope_parameters when config.json has none
GPT_OSS_ROPE = MappingProxyType(
    {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    }
)

GPT_OSS_DEFAULTS = MappingProxyType(  # transformers.GptOssConfig
    {
        "hidden_act": "silu",  # unused by its experts (the clamped SwiGLU), but checked
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,  # GptOssConfig.default_theta
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "sliding_window": 128,
        "attention_bias": True,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "eos_token_id": None,
    }
)

LAYER_TYPES = {"sliding_attention": True, "full_attention": False}  # -> attends in the window


def parse_gpt_oss(r: HfConfigReader) -> ModelConfig:
    if not r.raw.get("rope_scaling") and not r.raw.get("rope_parameters"):
        r = HfConfigReader({**r.raw, "rope_parameters": dict(GPT_OSS_ROPE)}, r.source, r.defaults)
    width = r.require("intermediate_size")
    bias = r.get("attention_bias", bool)
    window = r.get("sliding_window")
    r.refuse_if("sliding_window", window < 1, "must be >= 1")
    return decoder_config(
        r,
        "GptOssForCausalLM",
        intermediate_size=width,  # no dense layers
        moe_intermediate_size=width,
        norm_topk_prob=False,  # the softmax over the k chosen logits already sums to 1
        qkv_bias=bias,
        o_bias=bias,
        sliding_window=window,
        sliding_layers=_sliding_layers(r),
        router_bias=True,
        expert_bias=True,
        expert_activation="clamped_swiglu",
        swiglu_alpha=r.get("swiglu_alpha", float),
        swiglu_limit=r.get("swiglu_limit", float),
    )


def _sliding_layers(r: HfConfigReader) -> tuple[bool, ...]:
    """`layer_types` as per-layer sliding flags; absent: sliding, full, sliding, ... (layer 0
    sliding), as GptOssConfig fills it in."""
    layers = r.require("num_hidden_layers")
    types = r.raw.get("layer_types")
    if types is None:
        return tuple(i % 2 == 0 for i in range(layers))
    known = isinstance(types, list) and all(t in LAYER_TYPES for t in types)
    r.refuse_if("layer_types", not known, f"entries must be one of {sorted(LAYER_TYPES)}")
    return tuple(LAYER_TYPES[t] for t in types)


def load_gpt_oss_experts(cfg: ModelConfig, source: WeightSource, prefix: str) -> ExpertBank:
    """The layer's experts from the fused tensors at `prefix` as one stacked bank: float experts
    in the source dtype, gate_up [E, 2I, H] (the interleaved columns of gate_up_proj [E, H, 2I]
    split into gate's I rows, then up's I), down [E, H, I] (down_proj [E, I, H] transposed);
    MXFP4 experts in the mxfp4 format (the same rows); the biases reordered likewise. One expert
    at a time is copied, then the file's pages are released. A GGUF's merged experts are
    that bank already (_gguf_experts)."""
    num, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    activation = ExpertActivation("clamped_swiglu", cfg.swiglu_alpha, cfg.swiglu_limit)
    merged = source.merged_experts(prefix, EXPERT_NAMES)
    if merged is not None:
        return _gguf_experts(cfg, source, prefix, merged, activation)
    bias = source.get(f"{prefix}.gate_up_proj_bias", (num, 2 * inter))  # [E, 2I] interleaved
    biases = ExpertBiases(
        torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1),  # [E, 2I]: gate's, then up's
        source.get(f"{prefix}.down_proj_bias", (num, hidden)),
    )
    if source.has(f"{prefix}.gate_up_proj_blocks"):
        gate_up, down = _mxfp4_experts(cfg, source, prefix).tensors()
        return ExpertBank(gate_up, down, MXFP4, biases=biases, activation=activation)
    fused = source.get(f"{prefix}.gate_up_proj", (num, hidden, 2 * inter), align=False)
    down_in = source.get(f"{prefix}.down_proj", (num, inter, hidden), align=False)
    gate_up = torch.empty((num, 2 * inter, hidden), dtype=source.dtype)  # [E, 2I, H]
    down = torch.empty((num, hidden, inter), dtype=source.dtype)  # [E, H, I]
    for e in range(num):
        gate_up[e, :inter] = fused[e, :, 0::2].T
        gate_up[e, inter:] = fused[e, :, 1::2].T
        down[e] = down_in[e].T
    release_pages([fused, down_in])
    return ExpertBank(gate_up, down, biases=biases, activation=activation)


def _mxfp4_experts(cfg: ModelConfig, source: WeightSource, prefix: str) -> ExpertBank:
    """The layer's MXFP4 experts (HF layout: blocks [E, rows, n / 32, 16] and exponents
    [E, rows, n / 32], uint8) as a stacked mxfp4 bank; CheckpointError naming a tensor whose
    dtype or shape is not the layout's (a row length not a multiple of 32 included)."""
    num, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for name, n in (("moe_intermediate_size", inter), ("hidden_size", hidden)):
        if n % 32:
            raise CheckpointError(
                f"{prefix}: MXFP4 experts need {name} to be a multiple of 32, got {n}"
            )
    tensors = {}
    for proj, rows, n in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
        for part, shape in (("blocks", (num, rows, n // 32, 16)), ("scales", (num, rows, n // 32))):
            name = f"{prefix}.{proj}_{part}"
            tensors[f"{proj}_{part}"] = source.get_stored(name, shape, torch.uint8)
    bank = bank_from_hf_mxfp4(
        tensors["gate_up_proj_blocks"],
        tensors["gate_up_proj_scales"],
        tensors["down_proj_blocks"],
        tensors["down_proj_scales"],
    )
    release_pages(list(tensors.values()))
    return bank


# --- GGUF (`general.architecture` gpt-oss) ---------------------------------------------------

# the names the GGUF name map (models/gguf_names.py) asks llama.cpp's merged experts under
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
# gpt-oss's decoder layer parts llama.cpp names otherwise than the other families
GGUF_LAYER_NAMES = (("post_attention_layernorm", "post_attention_norm"),)


def _gguf_experts(
    cfg: ModelConfig,
    source: WeightSource,
    prefix: str,
    merged: MergedExperts,
    activation: ExpertActivation,
) -> ExpertBank:
    """The layer's experts as llama.cpp's converter stores them (gate_up_proj's even columns
    as ffn_gate_exps [E, I, H], its odd ones as ffn_up_exps, down_proj transposed as
    ffn_down_exps [E, H, I], each with its `.bias`): the bank the fused checkpoint gives,
    gate's rows then up's, as views of the file in its format."""
    num, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gate_bias, up_bias = (source.get(f"{prefix}.{n}.bias", (num, inter)) for n in EXPERT_NAMES[:2])
    biases = ExpertBiases(
        torch.cat((gate_bias, up_bias), dim=1),  # [E, 2I]: gate's, then up's
        source.get(f"{prefix}.{EXPERT_NAMES[2]}.bias", (num, hidden)),
    )
    return bank_from_merged(merged, (num, hidden, inter), biases, activation)


def gpt_oss_gguf_config(gguf: GgufFile) -> dict:
    """GGUF `gpt-oss` metadata as config.json fields, as llama.cpp reads them: the experts'
    width `expert_feed_forward_length`, the window `attention.sliding_window`, YaRN from
    `rope.scaling.*` (required: the converter always writes it), q/k/v/o biases where the
    file has them. The metadata holds neither `layer_types` nor the SwiGLU constants: layers
    slide as llama.cpp has them (see _gguf_layer_types), and swiglu_alpha / swiglu_limit are
    the family's defaults, 1.702 and 7.0, which llama.cpp hard-codes too. YaRN's correction
    range is not truncated (`truncate` false, as gpt-oss's own config.json has it; llama.cpp
    rounds it to whole dimensions)."""
    keys = GgufKeys(gguf)
    fields = decoder_fields(keys, "GptOssForCausalLM")
    if keys.require("rope.scaling.type", str) != "yarn":
        keys.refuse("rope.scaling.type", "gpt-oss's RoPE is YaRN")
    return {
        **fields,
        "intermediate_size": keys.require("expert_feed_forward_length"),
        "sliding_window": keys.require("attention.sliding_window"),
        "layer_types": _gguf_layer_types(keys, fields["num_hidden_layers"]),
        "attention_bias": has_attention_bias(keys),
        "rope_scaling": {**fields["rope_scaling"], "truncate": False},
    }


def _gguf_layer_types(keys: GgufKeys, layers: int) -> list[str]:
    """llama.cpp's gpt-oss layers: even ones slide, odd ones attend to everything (its sliding
    pattern of 2, fixed for the architecture), which is transformers' default `layer_types`.
    A file whose `attention.sliding_window_pattern` says otherwise is refused, since llama.cpp
    would not honour it either."""
    sliding = [i % 2 == 0 for i in range(layers)]
    stated = keys.get("attention.sliding_window_pattern", object)
    if isinstance(stated, int) and not isinstance(stated, bool):  # llama.cpp's n_pattern
        stated = [stated == 0 or i % stated < stated - 1 for i in range(layers)]
    if stated is not None and (not isinstance(stated, list) or stated != sliding):
        keys.refuse("attention.sliding_window_pattern", "gpt-oss slides on even layers only")
    return [("sliding_attention" if s else "full_attention") for s in sliding]


GPT_OSS = register(
    ModelFamily(
        architecture="GptOssForCausalLM",
        parse_config=parse_gpt_oss,
        defaults=GPT_OSS_DEFAULTS,
        build=MoeCausalLM,
        weights=WeightNames(
            expert_names=EXPERT_NAMES, router="router", experts_loader=load_gpt_oss_experts
        ),
        quant_methods=("mxfp4",),
        router="topk_softmax",
        attention="gqa_sinks",
        gguf=GgufSpec("gpt-oss", gpt_oss_gguf_config, layer_names=GGUF_LAYER_NAMES),
    )
)
