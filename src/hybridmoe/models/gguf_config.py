"""GGUF metadata -> the config.json fields a family's parser reads.

A GGUF file has no config.json: llama.cpp's converter wrote the architecture into metadata
keys (`<arch>.block_count`, `<arch>.expert_count`, ...). Each family's GgufSpec translates them
into the config.json dict its own parser (models/<family>.py) reads, so a GGUF model gets
exactly the ModelConfig, defaults and checks of the same checkpoint in safetensors. A key the
translation needs and the file lacks is an UnsupportedConfigError naming the key; facts the
metadata does not hold but the tensors show (biases, tied embeddings, dense layers) are read
from which tensors the file has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridmoe.config.model import ModelConfig
from hybridmoe.errors import UnsupportedConfigError
from hybridmoe.loader.gguf import GgufFile
from hybridmoe.loader.gguf_weights import GgufNameMap, Restore

# GGUF `<arch>.rope.scaling.type` -> config.json rope_type; "none" means no scaling
ROPE_SCALING_TYPES = {"none": None, "linear": "linear", "yarn": "yarn"}
EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")


@dataclass(frozen=True)
class GgufSpec:
    """How a family is stored in GGUF: its `general.architecture`, the translation of its
    metadata into config.json fields, what must be undone on its tensors (given the parsed
    config), if anything, and its decoder layer parts that llama.cpp names otherwise than
    the shared table (models/gguf_names.py LAYER_NAMES: checkpoint part -> GGUF part)."""

    architecture: str
    config: Callable[[GgufFile], dict[str, Any]]
    restore: Callable[[ModelConfig], Restore] | None = None
    # the family's own name map, given the parsed config; None: models/gguf_names.py's
    # gguf_name_map of the family's WeightNames
    names: Callable[[ModelConfig], GgufNameMap] | None = None
    layer_names: tuple[tuple[str, str], ...] = ()  # (checkpoint part, GGUF part) pairs


class GgufKeys:
    """The metadata of one file, read by key suffix under its architecture (`<arch>.<suffix>`)."""

    def __init__(self, gguf: GgufFile):
        self.gguf, self.arch = gguf, gguf.architecture

    def require(self, suffix: str, kind: type = int) -> Any:
        return self.gguf.require(f"{self.arch}.{suffix}", kind)

    def get(self, suffix: str, kind: type = int, default: Any = None) -> Any:
        return self.gguf.get(f"{self.arch}.{suffix}", kind, default)

    def has_tensor(self, name: str) -> bool:
        return name in self.gguf.tensors

    def refuse(self, suffix: str, why: str) -> None:
        value = self.get(suffix, object)
        raise UnsupportedConfigError(
            f"{self.gguf.path}: metadata key '{self.arch}.{suffix}' = {value!r} is not "
            f"supported: {why}"
        )


def decoder_fields(
    keys: GgufKeys, architecture: str, partial_rotary: bool = False
) -> dict[str, Any]:
    """The config.json fields every supported family shares, for `architecture` (its
    `architectures` name). `partial_rotary`: the family rotates `rope.dimension_count` dims of
    each head (its `partial_rotary_factor`); otherwise any count but the head's is refused."""
    hidden = keys.require("embedding_length")
    heads = keys.require("attention.head_count")
    head_dim = keys.get("attention.key_length", int, hidden // max(heads, 1))
    if keys.get("attention.value_length", int, head_dim) != head_dim:
        keys.refuse("attention.value_length", f"must equal the key length {head_dim}")
    rotary = _partial_rotary(keys, head_dim) if partial_rotary else {}
    if not partial_rotary and keys.get("rope.dimension_count", int, head_dim) != head_dim:
        keys.refuse("rope.dimension_count", f"partial rotary is not supported (head {head_dim})")
    return {
        **rotary,
        "architectures": [architecture],
        "hidden_act": "silu",  # every supported family's experts; GGUF does not say
        "vocab_size": _vocab_size(keys),
        "hidden_size": hidden,
        "num_hidden_layers": text_block_count(keys),
        "num_attention_heads": heads,
        "num_key_value_heads": keys.get("attention.head_count_kv", int, heads),
        "head_dim": head_dim,
        "num_experts": keys.require("expert_count"),
        "num_experts_per_tok": keys.require("expert_used_count"),
        "rms_norm_eps": keys.require("attention.layer_norm_rms_epsilon", float),
        "rope_theta": keys.require("rope.freq_base", float),
        "rope_scaling": _rope_scaling(keys),
        "max_position_embeddings": keys.require("context_length"),
        "tie_word_embeddings": not keys.has_tensor("output.weight"),
        "eos_token_id": [i for k in EOS_KEYS if (i := keys.gguf.get(k)) is not None] or None,
    }


def text_block_count(keys: GgufKeys) -> int:
    """The decoder layers of the text model: `block_count` less the multi-token-prediction
    layers llama.cpp's converter appends after them (`nextn_predict_layers`, Qwen3.5's MTP)."""
    blocks, nextn = keys.require("block_count"), keys.get("nextn_predict_layers", int, 0)
    if not 0 <= nextn < blocks:
        keys.refuse("nextn_predict_layers", f"must be below block_count {blocks}")
    return blocks - nextn


def nextn_prefixes(keys: GgufKeys) -> tuple[str, ...]:
    """The tensor-name prefixes of the multi-token-prediction layers (`blk.N.` past the text
    model's layers), which hybridmoe does not run (as for safetensors' `mtp.` tensors)."""
    return tuple(f"blk.{i}." for i in range(text_block_count(keys), keys.require("block_count")))


def _partial_rotary(keys: GgufKeys, head_dim: int) -> dict[str, float]:
    """{partial_rotary_factor} from `rope.dimension_count` (rotary dims of each head)."""
    dims = keys.require("rope.dimension_count")
    factor = dims / head_dim
    if not 0 < dims <= head_dim or dims % 2 or int(head_dim * factor) != dims:
        keys.refuse("rope.dimension_count", f"must be even and within the head ({head_dim})")
    return {"partial_rotary_factor": factor}


def dense_layers(keys: GgufKeys) -> list[int]:
    """Layers without a router (`blk.N.ffn_gate_inp`): dense MLPs (Qwen's `mlp_only_layers`)."""
    layers = text_block_count(keys)
    return [i for i in range(layers) if not keys.has_tensor(f"blk.{i}.ffn_gate_inp.weight")]


def dense_width(keys: GgufKeys, dense: list[int]) -> int | None:
    """The dense MLP width (`feed_forward_length`): required when a layer is dense."""
    return keys.require("feed_forward_length") if dense else keys.get("feed_forward_length")


def has_attention_bias(keys: GgufKeys) -> bool:
    return keys.has_tensor("blk.0.attn_q.bias")


def _vocab_size(keys: GgufKeys) -> int:
    size = keys.get("vocab_size")
    if size is not None:
        return size
    tokens = keys.gguf.get("tokenizer.ggml.tokens", list)
    if tokens is None:
        raise UnsupportedConfigError(
            f"{keys.gguf.path}: metadata key '{keys.arch}.vocab_size' is missing (and there is "
            "no 'tokenizer.ggml.tokens' to count)"
        )
    return len(tokens)


def _rope_scaling(keys: GgufKeys) -> dict[str, Any] | None:
    kind = keys.get("rope.scaling.type", str, "none")
    if kind not in ROPE_SCALING_TYPES:
        keys.refuse("rope.scaling.type", f"supported: {', '.join(ROPE_SCALING_TYPES)}")
    rope_type = ROPE_SCALING_TYPES[kind]
    if rope_type is None:
        return None
    scaling = {"rope_type": rope_type, "factor": keys.require("rope.scaling.factor", float)}
    if rope_type == "yarn":
        scaling["original_max_position_embeddings"] = keys.require(
            "rope.scaling.original_context_length"
        )
        optional = {
            "attention_factor": "rope.scaling.attn_factor",
            "beta_fast": "rope.scaling.yarn_beta_fast",
            "beta_slow": "rope.scaling.yarn_beta_slow",
        }
        for field, suffix in optional.items():
            value = keys.get(suffix, float)
            if value is not None:
                scaling[field] = value
    return scaling


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """weight [rows, ...] -> [rows, ...]: undo llama.cpp's converter permutation of llama-arch
    q/k rows (`LlamaModel.permute`), which stores each head's rows, in the checkpoint ordered
    (half, pair) for the half-split rotary layout, as (pair, half): interleaved pairs."""
    rows = weight.shape[0]
    rest = tuple(weight.shape[1:])
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )
