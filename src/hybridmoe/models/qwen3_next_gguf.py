"""Qwen3-Next (`qwen3next`) and Qwen3.5-MoE (`qwen35moe`) GGUF files, as llama.cpp's converter
(convert_hf_to_gguf.py: Qwen3NextModel, and for Qwen3.5 its V-head reordering subclass) writes
them, read back as the checkpoint's own tensors so the model builds exactly as from safetensors.

Metadata: the Gated DeltaNet sizes are `ssm.*` keys: `ssm.conv_kernel` (linear_conv_kernel_dim),
`ssm.state_size` (linear_key_head_dim), `ssm.group_count` (linear_num_key_heads),
`ssm.time_step_rank` (linear_num_value_heads), `ssm.inner_size` (value heads x value head dim);
`full_attention_interval` (llama.cpp's layer map: every interval-th layer is full attention);
`rope.dimension_count`, the rotary dims (partial_rotary_factor x head_dim). Qwen3.5's
`rope.dimension_sections` (interleaved MRoPE) is not read: for text, whose positions are the
same on all three axes, MRoPE is the plain rotary the safetensors path computes.

What the converter changed, undone here (`restore`):
- the RMSNorm weights of the (1 + w) convention (attn_norm, post_attention_norm, output_norm,
  attn_q_norm, attn_k_norm; not the gated ssm_norm) are stored as 1 + w;
- A_log is stored as ssm_a = -exp(A_log); dt_bias as ssm_dt.bias; conv1d as [channels, kernel];
- Qwen3-Next's in_proj_qkvz (grouped by key head) is split into attn_qkv (q, k, v of all
  heads, head-major) and attn_gate (z); in_proj_ba is ssm_ba as it was;
- Qwen3.5's in_proj_qkv/z/b/a are attn_qkv, attn_gate, ssm_beta, ssm_alpha; with more value
  heads than key heads, every value-head axis (the v rows of attn_qkv and of the conv,
  attn_gate, ssm_beta, ssm_alpha, ssm_a, ssm_dt, the columns of ssm_out) is reordered from
  grouped by key head to tiled (value head j of every key head side by side), which ggml's
  broadcast wants; Qwen3-Next's converter does not reorder them.
Unchanged: attn_q (per head its query rows, then its gate rows, as q_proj), and the MoE tensors
(the shared expert's, ffn_gate_inp_shexp). post_attention_layernorm is `post_attention_norm`.
Multi-token-prediction layers appended past the text layers (`nextn_predict_layers`) are not
read (gguf_config.nextn_prefixes), as safetensors' `mtp.` tensors are not.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from hybridmoe.config.model import LinearAttentionConfig, ModelConfig
from hybridmoe.errors import CheckpointError
from hybridmoe.loader.gguf import GgufFile
from hybridmoe.loader.gguf_weights import REWRITTEN, GgufNameMap, RowRestore
from hybridmoe.models.gguf_config import (
    GgufKeys,
    GgufSpec,
    decoder_fields,
    dense_layers,
    dense_width,
    has_attention_bias,
)
from hybridmoe.models.gguf_names import EXPERT_NAMES, GLOBAL_NAMES, LAYER_NAMES, ROUTER_NAME

# checkpoint part after `model.layers.N.` -> GGUF part after `blk.N.` (several: a tensor the
# converter split along its rows)
LAYER_PARTS: dict[str, str | tuple[str, ...]] = {
    **{
        f"{hf}.{kind}": f"{g}.{kind}"
        for hf, g in LAYER_NAMES.items()
        for kind in ("weight", "bias")
    },
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate.weight": f"{ROUTER_NAME}.weight",
    **{
        f"mlp.experts.{hf}.weight": f"{g}.weight"
        for hf, g in zip(("gate_proj", "up_proj", "down_proj"), EXPERT_NAMES, strict=True)
    },
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",  # Qwen3.5
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_qkvz.weight": ("attn_qkv.weight", "attn_gate.weight"),  # Qwen3-Next
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
# (1 + w) RMSNorms, stored as 1 + w (the gated linear_attn.norm is a plain scale)
_OFFSET_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)
_LAYER = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<part>.+)$")


def hybrid_name_map(cfg: ModelConfig) -> GgufNameMap:
    """Checkpoint names of both families -> their GGUF tensors."""

    def name_map(name: str) -> str | tuple[str, ...] | None:
        found = _LAYER.match(name)
        if found is not None:
            part, block = LAYER_PARTS.get(found["part"]), f"blk.{found['layer']}."
            if isinstance(part, tuple):
                return tuple(block + p for p in part)
            return None if part is None else block + part
        base, _, kind = name.rpartition(".")
        return f"{GLOBAL_NAMES[base]}.{kind}" if base in GLOBAL_NAMES else None

    return name_map


def qwen3next_restore(cfg: ModelConfig) -> RowRestore:
    """in_proj_qkvz regrouped by key head, the offset norms and A_log undone; every other
    tensor (attention, the experts' and shared experts' projections, the output head) as
    stored, so quantised ones keep the file's type."""
    return _restore(
        lambda name: name.endswith("linear_attn.in_proj_qkvz.weight"),
        lambda name, value: _grouped_qkvz(value, cfg.linear_attention),
    )


def qwen35moe_restore(cfg: ModelConfig) -> RowRestore:
    """As qwen3next_restore; the linear attention's tensors regrouped where value heads are
    tiled (more value heads than key heads)."""
    spec = cfg.linear_attention
    tiled = spec.num_value_heads != spec.num_key_heads
    return _restore(
        lambda name: tiled and ".linear_attn." in name,
        lambda name, value: _grouped_value_heads(name, value, spec),
    )


def _restore(
    regrouped: Callable[[str], bool], regroup: Callable[[str, torch.Tensor], torch.Tensor]
) -> RowRestore:
    """A family's RowRestore: the tensors `regrouped` names regrouped by `regroup`, then
    _restore_scalars; every tensor neither rewrites passes as stored."""

    def order(name: str, rows: int) -> str | None:
        return REWRITTEN if regrouped(name) or _scalar(name) else None

    def values(name: str, value: torch.Tensor) -> torch.Tensor:
        if regrouped(name):
            value = regroup(name, value)
        return _restore_scalars(name, value)

    return RowRestore(order, values)


def _scalar(name: str) -> bool:
    """Whether _restore_scalars rewrites tensor `name`."""
    return _offset_norm(name) or name.endswith(".A_log")


def _offset_norm(name: str) -> bool:
    return name == "model.norm.weight" or name.endswith(_OFFSET_NORMS)


def _restore_scalars(name: str, value: torch.Tensor) -> torch.Tensor:
    """Undo `1 + w` on the offset norms and `-exp(A_log)` (computed in float32)."""
    if _offset_norm(name):
        return (value.float() - 1).to(value.dtype)
    if name.endswith(".A_log"):
        bad = ~(value <= 0)  # positive or NaN
        if bool(bad.any()):
            raise CheckpointError(
                f"ssm_a ({name}) must hold -exp(A_log) <= 0; {int(bad.sum())} of its "
                f"{value.numel()} values are not (the first: {float(value[bad][0])})"
            )
        return (-value.float()).log().to(value.dtype)
    return value


def _grouped_qkvz(value: torch.Tensor, s: LinearAttentionConfig) -> torch.Tensor:
    """[q | k | v | z of all heads, H] (attn_qkv then attn_gate) -> in_proj_qkvz's rows: per
    key head its q, its k, the v and then the z of its value heads."""
    q, k, v, z = value.split([s.key_dim, s.key_dim, s.value_dim, s.value_dim])
    heads = [t.reshape(s.num_key_heads, -1, value.shape[-1]) for t in (q, k, v, z)]
    return torch.cat(heads, dim=1).reshape(value.shape)


def _grouped_value_heads(name: str, value: torch.Tensor, s: LinearAttentionConfig):
    """Qwen3.5's value-head axes of `name` from tiled back to grouped by key head."""
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # the v rows / channels only
        qk, v = value.split([2 * s.key_dim, s.value_dim])
        return torch.cat([qk, _untiled(v, 0, s, s.value_head_dim)])
    if name.endswith("in_proj_z.weight"):
        return _untiled(value, 0, s, s.value_head_dim)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return _untiled(value, 0, s, 1)
    if name.endswith("out_proj.weight"):
        return _untiled(value, 1, s, s.value_head_dim)
    return value  # norm.weight: one scale per value dim, shared by the heads


def _untiled(t: torch.Tensor, dim: int, s: LinearAttentionConfig, head_dim: int):
    """`t` whose axis `dim` (value heads x head_dim) is tiled (index j * key_heads + k) ->
    grouped (k * (value_heads // key_heads) + j)."""
    per_key = s.num_value_heads // s.num_key_heads
    shape = t.shape
    split = (*shape[:dim], per_key, s.num_key_heads, head_dim, *shape[dim + 1 :])
    return t.reshape(split).transpose(dim, dim + 1).reshape(shape)


def _hybrid_fields(keys: GgufKeys) -> dict:
    """The linear-attention and shared-expert config.json fields of both families."""
    value_heads = keys.require("ssm.time_step_rank")
    inner = keys.require("ssm.inner_size")
    if value_heads < 1 or inner % value_heads:
        keys.refuse("ssm.inner_size", f"must be a multiple of ssm.time_step_rank {value_heads}")
    return {
        "linear_conv_kernel_dim": keys.require("ssm.conv_kernel"),
        "linear_key_head_dim": keys.require("ssm.state_size"),
        "linear_num_key_heads": keys.require("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "full_attention_interval": keys.require("full_attention_interval"),
        "moe_intermediate_size": keys.require("expert_feed_forward_length"),
        "shared_expert_intermediate_size": keys.require("expert_shared_feed_forward_length"),
        "attention_bias": has_attention_bias(keys),
    }


def qwen3next_config(gguf: GgufFile) -> dict:
    """GGUF `qwen3next` metadata as Qwen3-Next config.json fields (top-k renormalised unless
    `expert_weights_norm` says otherwise: Qwen3-Next's default)."""
    keys = GgufKeys(gguf)
    dense = dense_layers(keys)
    return {
        **decoder_fields(keys, "Qwen3NextForCausalLM", partial_rotary=True),
        **_hybrid_fields(keys),
        "intermediate_size": dense_width(keys, dense),
        "mlp_only_layers": dense,
        "norm_topk_prob": keys.get("expert_weights_norm", bool, True),
    }


def qwen35moe_config(gguf: GgufFile) -> dict:
    """GGUF `qwen35moe` metadata as Qwen3.5-MoE text config.json fields."""
    keys = GgufKeys(gguf)
    if not keys.get("expert_weights_norm", bool, True):
        keys.refuse("expert_weights_norm", "Qwen3.5-MoE always renormalises the top-k weights")
    return {
        **decoder_fields(keys, "Qwen3_5MoeForCausalLM", partial_rotary=True),
        **_hybrid_fields(keys),
    }


QWEN3NEXT_GGUF = GgufSpec("qwen3next", qwen3next_config, qwen3next_restore, hybrid_name_map)
QWEN35MOE_GGUF = GgufSpec("qwen35moe", qwen35moe_config, qwen35moe_restore, hybrid_name_map)
