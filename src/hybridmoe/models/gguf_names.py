"""Checkpoint tensor names -> GGUF tensor names, as llama.cpp's converter (convert_hf_to_gguf.py,
through gguf-py's TensorNameMap) names the parts of the families hybridmoe supports.

The model builder asks for Hugging Face names; a GGUF file holds the same tensors under
llama.cpp's names, with each layer's routed experts merged into three tensors
(`blk.N.ffn_{gate,up,down}_exps.weight`, [E, rows, cols] in numpy order).
tests/loader/test_gguf_names.py checks this table against gguf-py's own map.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

from hybridmoe.loader.gguf_weights import GgufNameMap

GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
# decoder layer part (after `model.layers.N.`) -> GGUF part (after `blk.N.`)
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",  # a dense layer's MLP
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",  # Qwen2-MoE
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# per MoE block prefix: the router, and the merged experts by role
ROUTER_NAME = "ffn_gate_inp"
EXPERT_NAMES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # gate, up, down

# decoder layer tensors whose checkpoint name has no .weight/.bias -> the GGUF part with its kind
# (llama.cpp's converter appends `.weight` to gpt-oss's `self_attn.sinks`)
BARE_LAYER_NAMES = {"self_attn.sinks": "attn_sinks.weight"}
NO_NAMES: Mapping[str, str] = MappingProxyType({})

_LAYER = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<part>.+)\.(?P<kind>weight|bias)$")
_BARE_LAYER = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<part>.+)$")
_GLOBAL = re.compile(r"^(?P<part>.+)\.(?P<kind>weight|bias)$")


def gguf_name_map(
    moe_prefix: str,
    expert_names: tuple[str, str, str],
    router: str = "gate",
    layer_overrides: Mapping[str, str] = NO_NAMES,
) -> GgufNameMap:
    """The map of a family whose MoE block is `model.layers.N.<moe_prefix>` with router
    `<moe_prefix>.<router>` and experts `experts.{gate,up,down name}` (models/registry.py:
    WeightNames), with `layer_overrides` (decoder layer part -> GGUF part) where llama.cpp
    names the family's parts otherwise than LAYER_NAMES (GgufSpec.layer_names). A merged
    expert tensor is asked for as `<moe_prefix>.experts.<name>.weight` (and its bias, where
    the family has expert biases, as `.bias`)."""
    layer_names = dict(LAYER_NAMES)
    layer_names[f"{moe_prefix}.{router}"] = ROUTER_NAME
    for name, gguf in zip(expert_names, EXPERT_NAMES, strict=True):
        layer_names[f"{moe_prefix}.experts.{name}"] = gguf
    layer_names.update(layer_overrides)

    def name_map(name: str) -> str | None:
        found = _LAYER.match(name)
        if found is not None:
            part = layer_names.get(found["part"])
            return None if part is None else f"blk.{found['layer']}.{part}.{found['kind']}"
        found = _BARE_LAYER.match(name)
        if found is not None:
            part = BARE_LAYER_NAMES.get(found["part"])
            return None if part is None else f"blk.{found['layer']}.{part}"
        found = _GLOBAL.match(name)
        part = None if found is None else GLOBAL_NAMES.get(found["part"])
        return None if part is None else f"{part}.{found['kind']}"

    return name_map
