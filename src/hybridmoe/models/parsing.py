"""Reading the config.json fields the families share: each family module's parser starts from
`decoder_config` and adds or overrides its own fields."""

from __future__ import annotations

from hybridmoe.config.model import HfConfigReader, ModelConfig, read_rope


def decoder_config(
    r: HfConfigReader,
    architecture: str,
    partial_rotary_default: float | None = None,
    **family_fields,
) -> ModelConfig:
    """The ModelConfig of a decoder-only MoE transformer whose every layer is sparse, with
    `family_fields` on top; `partial_rotary_default` as read_rope takes it."""
    r.refuse_if("hidden_act", r.get("hidden_act", str) != "silu", "only 'silu' experts")
    layers = r.require("num_hidden_layers")
    heads = r.require("num_attention_heads")
    r.refuse_if("num_attention_heads", heads < 1, "must be >= 1")
    fields = dict(
        architecture=architecture,
        vocab_size=r.require("vocab_size"),
        hidden_size=r.require("hidden_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=r.get("num_key_value_heads"),
        head_dim=r.get("head_dim"),
        num_experts=r.first(("num_experts", "num_local_experts")),
        top_k=r.require("num_experts_per_tok"),
        sparse_layers=(True,) * layers,
        rms_norm_eps=r.get("rms_norm_eps", float),
        rope=read_rope(r, partial_rotary_default),
        max_position_embeddings=r.get("max_position_embeddings"),
        tie_word_embeddings=r.get("tie_word_embeddings", bool),
        eos_token_ids=r.eos_token_ids(),
    )
    fields.update(family_fields)
    return ModelConfig(**fields)


def qwen_sparse_layers(r: HfConfigReader) -> tuple[bool, ...]:
    """Qwen MoE layer map: `mlp_only_layers` are dense; otherwise every `decoder_sparse_step`-th."""
    layers = r.require("num_hidden_layers")
    step = r.get("decoder_sparse_step")
    dense = r.get("mlp_only_layers", list)
    r.refuse_if("decoder_sparse_step", step < 1, "must be >= 1")
    is_index = [isinstance(i, int) and not isinstance(i, bool) for i in dense]
    r.refuse_if("mlp_only_layers", not all(is_index), "must be a list of layer indices")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
