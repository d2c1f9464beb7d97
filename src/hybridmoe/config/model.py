"""ModelConfig: everything the engine needs to know about one checkpoint's architecture.

Family modules translate a Hugging Face `config.json` into a ModelConfig; nothing below the
model registry reads `config.json` directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from hybridmoe.errors import UnsupportedConfigError

QkNorm = Literal["none", "per_head", "full"]  # Qwen3: RMSNorm per head; OLMoE: over all heads


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | yarn | llama3
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = derived from factor
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    partial_rotary_factor: float = 1.0  # rotary on the first int(head_dim * this) dims only


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5): each key head serves
    num_value_heads // num_key_heads consecutive value heads."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # the depthwise causal conv1d's width over q, k and v

    def __post_init__(self) -> None:
        sizes = (self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim)
        if min(sizes) < 1 or self.num_value_heads % self.num_key_heads:
            raise UnsupportedConfigError(
                f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_key_heads}), and every linear size >= 1"
            )
        if self.conv_kernel < 2:
            raise UnsupportedConfigError(
                f"linear_conv_kernel_dim ({self.conv_kernel}) must be >= 2"
            )

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False)
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: QkNorm = "none"
    clip_qkv: float | None = None
    sliding_window: int | None = None
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert
    eos_token_ids: tuple[int, ...] = ()
    # True: the router's top-k weights stay float32 (MixtralTopKRouter never casts its float32
    # softmax values); False: they are rounded to the activation dtype, as the Qwen3-MoE,
    # Qwen2-MoE and OLMoE TopKRouters do (`router_top_value.to(router_logits.dtype)`).
    router_weights_fp32: bool = False
    # Per layer: linear attention (True) or full attention (False); () = full attention only.
    linear_layers: tuple[bool, ...] = ()
    linear_attention: LinearAttentionConfig | None = None  # set when any layer is linear
    # per layer: whether it attends within `sliding_window` (gpt-oss's `layer_types`); None:
    # every layer does when `sliding_window` is set
    sliding_layers: tuple[bool, ...] | None = None
    router_bias: bool = False  # the router's linear gate has a bias (gpt-oss)
    expert_bias: bool = False  # experts' gate/up and down projections have biases (gpt-oss)
    # how an expert combines gate and up (quant/expert_math.py: ExpertActivation): "silu" =
    # silu(gate) * up; "clamped_swiglu" (gpt-oss) with swiglu_alpha and swiglu_limit
    expert_activation: str = "silu"
    swiglu_alpha: float = 1.0
    swiglu_limit: float = float("inf")

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise UnsupportedConfigError(
                f"num_hidden_layers ({self.num_layers}) must be >= 1: a model without decoder "
                "layers would ignore every layer's weights"
            )
        if len(self.sparse_layers) != self.num_layers:
            raise UnsupportedConfigError(
                f"sparse layer map has {len(self.sparse_layers)} entries, "
                f"num_hidden_layers is {self.num_layers}"
            )
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.linear_layers and len(self.linear_layers) != self.num_layers:
            raise UnsupportedConfigError(
                f"layer_types has {len(self.linear_layers)} entries, "
                f"num_hidden_layers is {self.num_layers}"
            )
        if any(self.linear_layers) and self.linear_attention is None:
            raise UnsupportedConfigError("linear attention layers need their sizes")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise UnsupportedConfigError(
                f"layer_types has {len(self.sliding_layers)} entries, "
                f"num_hidden_layers is {self.num_layers}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise UnsupportedConfigError(
                f"num_experts_per_tok ({self.top_k}) must be in [1, {self.num_experts}]"
            )

    def is_linear(self, layer_idx: int) -> bool:
        """Layer `layer_idx` is a linear-attention layer (recurrent state, no KV)."""
        return bool(self.linear_layers) and self.linear_layers[layer_idx]

    @property
    def has_recurrent_state(self) -> bool:
        return any(self.linear_layers)

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window layer `layer_idx` attends within; None: every earlier key."""
        if self.sliding_layers is not None and not self.sliding_layers[layer_idx]:
            return None
        return self.sliding_window

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, sparse in enumerate(self.sparse_layers) if sparse)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


# A family's reference defaults: config.json field -> the value its `transformers` config class
# gives when the field is absent, or a function of the reader for a default derived from other
# fields (head_dim = hidden_size // num_attention_heads).
ConfigDefaults = Mapping[str, Any]


class HfConfigReader:
    """Reads fields of a config.json dict; every error names the field and the file.

    `get` takes an absent (or null) field's value from `defaults`, the family's table, and only
    from there: a field without a reference default is `require`d instead."""

    def __init__(
        self,
        raw: dict[str, Any],
        source: str = "config.json",
        defaults: ConfigDefaults | None = None,
    ):
        self.raw = raw
        self.source = source
        self.defaults = defaults or {}

    def require(self, name: str, kind: type = int) -> Any:
        if name not in self.raw or self.raw[name] is None:
            raise UnsupportedConfigError(f"{self.source}: required field '{name}' is missing")
        return self._typed(name, self.raw[name], kind)

    def get(self, name: str, kind: type = int) -> Any:
        value = self.raw.get(name)
        return self.default(name) if value is None else self._typed(name, value, kind)

    def default(self, name: str) -> Any:
        if name not in self.defaults:
            raise KeyError(f"no reference default for '{name}' in this family's table")
        default = self.defaults[name]
        return default(self) if callable(default) else default

    def section(self, name: str) -> dict[str, Any]:
        """A nested object such as `rope_scaling`; {} when absent or null."""
        value = self.raw.get(name)
        return {} if value is None else dict(self._typed(name, value, dict))

    def first(self, names: tuple[str, ...], kind: type = int) -> Any:
        for name in names:
            if self.raw.get(name) is not None:
                return self._typed(name, self.raw[name], kind)
        raise UnsupportedConfigError(
            f"{self.source}: required field '{names[0]}' is missing (also looked for "
            f"{', '.join(repr(n) for n in names[1:])})"
        )

    def refuse_if(self, name: str, bad: bool, why: str) -> None:
        if bad:
            raise UnsupportedConfigError(
                f"{self.source}: field '{name}' = {self.raw.get(name)!r} is not supported: {why}"
            )

    def _typed(self, name: str, value: Any, kind: type) -> Any:
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise UnsupportedConfigError(
                f"{self.source}: field '{name}' must be {kind.__name__}, got {value!r}"
            )
        return value

    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.raw.get("eos_token_id")
        eos = self.default("eos_token_id") if eos is None else eos
        ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
        # bool is an int subclass; `true` here is a corrupt file, not id 1.
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise UnsupportedConfigError(
                f"{self.source}: field 'eos_token_id' must be an id or a list of ids, got {eos!r}"
            )
        return tuple(ids)

    def hidden_per_head(self) -> int:
        """hidden_size // num_attention_heads: the reference head_dim when it is absent."""
        hidden, heads = self.require("hidden_size"), self.require("num_attention_heads")
        self.refuse_if("num_attention_heads", heads < 1, "must be >= 1")
        return hidden // heads


SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def read_rope(reader: HfConfigReader, partial_default: float | None = None) -> RopeConfig:
    """RoPE settings from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`;
    like transformers, a `rope_scaling` that is present wins over `rope_parameters`.
    `partial_default`: the family's `partial_rotary_factor` when absent; None: the family
    rotates whole heads and refuses any other factor."""
    field = "rope_scaling" if reader.raw.get("rope_scaling") else "rope_parameters"
    params = reader.section(field)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedConfigError(
            f"{reader.source}: field '{field}.rope_type' = {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    absent = 1.0 if partial_default is None else partial_default
    partial = params.get("partial_rotary_factor", reader.raw.get("partial_rotary_factor", absent))
    numeric = isinstance(partial, (int, float)) and not isinstance(partial, bool)
    if not numeric or (partial_default is None and partial != 1.0) or not 0 < partial <= 1:
        raise UnsupportedConfigError(
            f"{reader.source}: field 'partial_rotary_factor' = {partial!r} is not supported"
        )
    theta = params["rope_theta"] if "rope_theta" in params else reader.get("rope_theta", float)
    max_pos = reader.get("max_position_embeddings")
    if rope_type != "default" and params.get("factor") is None:
        raise UnsupportedConfigError(f"{reader.source}: field '{field}.factor' is missing")
    try:
        return replace(
            _rope_config(params, rope_type, theta, max_pos), partial_rotary_factor=float(partial)
        )
    except (TypeError, ValueError) as e:
        raise UnsupportedConfigError(
            f"{reader.source}: a value in field '{field}' or 'rope_theta' is not a number ({e})"
        ) from e


def _rope_config(params: dict[str, Any], rope_type: str, theta: Any, max_pos: int) -> RopeConfig:
    def optional_float(name: str) -> float | None:
        return None if params.get(name) is None else float(params[name])

    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor") or 1.0),
        original_max_position=int(params.get("original_max_position_embeddings") or max_pos),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=optional_float("attention_factor"),
        mscale=optional_float("mscale"),
        mscale_all_dim=optional_float("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )
