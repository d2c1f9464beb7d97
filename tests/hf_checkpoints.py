"""Tiny random checkpoints written by Hugging Face `transformers` itself, and its outputs.

`transformers` is the oracle: it builds each model from its own config class, saves it with
`save_pretrained` (per-expert tensor names, exactly as hub checkpoints; gpt-oss's fused
`experts.gate_up_proj` etc., as its hub checkpoints store them), and computes the
reference logits and greedy tokens. Nothing is downloaded.

Weights are re-drawn here rather than left to `transformers`' init, for two reasons: its init
sets every norm weight to 1 and every bias to 0, which would hide a dropped norm or bias; and
at initializer_range 0.02 the logits are nearly uniform, so greedy ties flip on rounding noise.
"""

from __future__ import annotations

import json
import zlib
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import transformers

# family -> (config class, model class), both by their `transformers` names.
FAMILIES: dict[str, tuple[str, str]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}

_COMMON: dict[str, Any] = dict(
    vocab_size=96,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
    max_position_embeddings=256,
)

# (family, variant) -> config kwargs on top of _COMMON. hidden/heads is 8 or 16 throughout, so a
# `head_dim` of 16 or 24 differs from it; expert and dense MLP widths differ to catch mix-ups.
# fmt: off
VARIANTS: dict[tuple[str, str], dict[str, Any]] = {
    # Qwen3-MoE: q/k RMSNorm per head, no qkv bias.
    ("qwen3_moe", "gqa_head_dim"): dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        intermediate_size=40, norm_topk_prob=True),
    ("qwen3_moe", "mha_tied_top1"): dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32, intermediate_size=48,
        norm_topk_prob=False, tie_word_embeddings=True),
    ("qwen3_moe", "mqa_sparse_step"): dict(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=24, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
        intermediate_size=56, decoder_sparse_step=2, norm_topk_prob=False),
    ("qwen3_moe", "mlp_only_yarn"): dict(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=72,
        mlp_only_layers=[1], norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                         "original_max_position_embeddings": 64}),
    ("qwen3_moe", "mlp_only_tied"): dict(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=48,
        mlp_only_layers=[1], norm_topk_prob=True, tie_word_embeddings=True),
    # Qwen2-MoE: qkv bias, sigmoid-gated shared expert beside the routed ones.
    ("qwen2_moe", "shared_expert"): dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=40,
        shared_expert_intermediate_size=48, norm_topk_prob=False),
    ("qwen2_moe", "gqa_sparse_step_tied"): dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=48,
        shared_expert_intermediate_size=40, decoder_sparse_step=2, norm_topk_prob=True,
        tie_word_embeddings=True),
    ("qwen2_moe", "mqa_mlp_only_top1"): dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        num_experts=6, num_experts_per_tok=1, moe_intermediate_size=24, intermediate_size=56,
        shared_expert_intermediate_size=32, mlp_only_layers=[0, 2], norm_topk_prob=False),
    # Mixtral: always renormalises the top-k probabilities; no q/k norm, no bias.
    ("mixtral", "gqa"): dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=24),
    ("mixtral", "sliding_head_dim"): dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=40,
        sliding_window=5),
    ("mixtral", "mha_tied_top1"): dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_local_experts=6, num_experts_per_tok=1, intermediate_size=32,
        tie_word_embeddings=True),
    ("mixtral", "gqa_wide"): dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    # OLMoE: q/k RMSNorm over the whole projection (not per head), optional qkv clipping.
    ("olmoe", "mha"): dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_experts=8, num_experts_per_tok=2, intermediate_size=24, norm_topk_prob=False),
    ("olmoe", "gqa_clip_qkv"): dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=3, intermediate_size=32, norm_topk_prob=True,
        clip_qkv=0.8),
    ("olmoe", "mqa_tied_top1"): dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        num_experts=4, num_experts_per_tok=1, intermediate_size=40, tie_word_embeddings=True),
    # gpt-oss: sinks, biases everywhere, sliding layers (window shorter than the prompts), YaRN,
    # a swiglu_limit small enough that the clamp cuts unit-variance projections.
    ("gpt_oss", "sliding_yarn"): dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=24,
        sliding_window=5, swiglu_limit=1.2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64}),
    ("gpt_oss", "mqa_full_first_top4"): dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        num_local_experts=6, num_experts_per_tok=4, intermediate_size=32, sliding_window=8,
        layer_types=["full_attention", "sliding_attention"], attention_bias=False,
        swiglu_limit=1.5, swiglu_alpha=1.3),
}
# fmt: on

# Variants whose config.json is rewritten afterwards in the older hub spelling that most
# published checkpoints still use (`rope_theta` + `rope_scaling`, `num_experts`), which
# `transformers` 5 still reads; it writes `rope_parameters` and, for Qwen3, `num_local_experts`.
_HUB_SPELLING = {("qwen3_moe", "mlp_only_yarn")}

ORACLE_CASES: list[tuple[str, str]] = list(VARIANTS)

# The prompts the oracle tests use. After PROMPT_IDS every case's 20 greedy tokens have a top-2
# logit gap >= 0.02 and are not one token repeated (_SEED_SALTS picks such weights where the
# default seed did not); after SHORT_PROMPT_IDS the gap is >= 0.007.
PROMPT_IDS = [5, 17, 42, 3, 88, 61, 9, 30, 74, 12, 50, 27]
SHORT_PROMPT_IDS = [60, 8, 33, 71, 4, 19, 90]
_SEED_SALTS = {
    ("qwen3_moe", "gqa_head_dim"): 1,
    ("qwen3_moe", "mha_tied_top1"): 7,
    ("qwen3_moe", "mlp_only_yarn"): 2,
    ("qwen2_moe", "mqa_mlp_only_top1"): 3,
    ("olmoe", "gqa_clip_qkv"): 1,
    ("mixtral", "gqa_wide"): 5,
}

# The final norm is scaled up so that logits spread (std ~4-8) and greedy choices are far from
# ties. Embeddings are kept small against the layers' outputs, else a tied head mostly echoes
# the input token.
_FINAL_NORM_SCALE = 6.0
_EMBED_STD = 0.1


def write_hf_checkpoint(
    family: str, variant: str, directory: Path, dtype: torch.dtype = torch.float32
) -> Path:
    """Build the (family, variant) model with `transformers`, save it into `directory`, return it.

    Deterministic: the same case always gives the same weights.
    """
    config_name, model_name = FAMILIES[family]
    config = getattr(transformers, config_name)(**_COMMON, **VARIANTS[(family, variant)])
    model = getattr(transformers, model_name)(config)
    seed = zlib.crc32(f"{family}/{variant}".encode()) + _SEED_SALTS.get((family, variant), 0)
    _redraw_weights(model, seed)
    directory = Path(directory)
    model.to(dtype).save_pretrained(directory)
    if (family, variant) in _HUB_SPELLING:
        _rewrite_config_in_hub_spelling(directory / "config.json")
    return directory


def write_custom_checkpoint(
    family: str, config_kwargs: dict[str, Any], directory: Path, seed: int = 0
) -> Path:
    """A checkpoint of `family` with `config_kwargs` (on top of the common vocabulary and ids)
    instead of a listed variant, weights drawn as every variant's; float32."""
    config_name, model_name = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_COMMON, **config_kwargs})
    model = getattr(transformers, model_name)(config)
    _redraw_weights(model, seed)
    model.save_pretrained(Path(directory))
    return Path(directory)


@torch.no_grad()
def _redraw_weights(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)

    def normal(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    in_out = model.config.model_type == "gpt_oss"  # its fused experts are [E, in, out]
    for name, param in model.named_parameters():  # a tied lm_head is listed once, as embed
        if in_out and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            param.copy_(normal(param.shape) / param.shape[-2] ** 0.5)
        elif name.endswith("sinks"):  # per-head logits: big enough to take a share of mass
            param.copy_(normal(param.shape))
        elif name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * normal(param.shape))
        elif name.endswith("bias"):
            param.copy_(0.2 * normal(param.shape))
        elif name.endswith("embed_tokens.weight"):
            param.copy_(_EMBED_STD * normal(param.shape))
        else:  # [.., out, in]: unit-variance outputs for unit-variance inputs
            param.copy_(normal(param.shape) / param.shape[-1] ** 0.5)
        if name == "model.norm.weight":
            param.mul_(_FINAL_NORM_SCALE)


def _rewrite_config_in_hub_spelling(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    if "num_local_experts" in config and config["model_type"] != "mixtral":
        config["num_experts"] = config.pop("num_local_experts")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


@lru_cache(maxsize=8)
def _hf_model(
    directory: str, dtype: torch.dtype, experts_implementation: str | None
) -> torch.nn.Module:
    kwargs = (
        {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    return model.eval()


@torch.no_grad()
def hf_logits(
    directory: Path,
    prompt_ids: list[int],
    dtype: torch.dtype = torch.float32,
    experts_implementation: str | None = None,
) -> torch.Tensor:
    """Logits [T, V] of `transformers` for one fresh sequence, computed in `dtype` and returned
    as float32. `experts_implementation`: "eager", "batched_mm" or "grouped_mm"; None: its
    default."""
    model = _hf_model(str(directory), dtype, experts_implementation)
    return model(torch.tensor([prompt_ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(
    directory: Path,
    prompt_ids: list[int],
    n: int,
    dtype: torch.dtype = torch.float32,
    experts_implementation: str | None = None,
    use_cache: bool = False,
) -> list[int]:
    """`n` greedy tokens from `transformers`: a full forward per step, no KV cache, and EOS is
    emitted like any other token (`generate(min_new_tokens=n)` would instead forbid it).
    `dtype` and `experts_implementation` as for `hf_logits`. `use_cache`: instead, the prompt
    in one forward and then one token per forward through a KV cache (a decode step's shapes:
    in bf16 its GEMMs and attention round differently for one row than for a whole sequence)."""
    if use_cache:
        return _hf_greedy_cached(
            _hf_model(str(directory), dtype, experts_implementation), prompt_ids, n
        )
    ids = list(prompt_ids)
    for _ in range(n):
        logits = hf_logits(directory, ids, dtype, experts_implementation)  # [T, V]
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt_ids) :]


def _hf_greedy_cached(model: torch.nn.Module, prompt_ids: list[int], n: int) -> list[int]:
    cache = transformers.DynamicCache(config=model.config)
    ids, tokens = torch.tensor([prompt_ids]), []
    for _ in range(n):
        logits = model(ids, cache=cache, use_cache=True).logits[0, -1]  # [V]
        tokens.append(int(logits.float().argmax()))
        ids = torch.tensor([tokens[-1:]])
    return tokens


def greedy_reference(
    directory: Path, prompt_ids: list[int], n: int, min_gap: float
) -> tuple[list[int], torch.Tensor]:
    """`transformers`' `n` greedy tokens after `prompt_ids` (float32, hf_greedy) and its logits
    [T, V] of the prompt and the tokens but the last (hf_logits): an oracle's reference,
    asserted free of near-ties (top-2 gap >= `min_gap` at each generated position), where
    float noise could pick another token."""
    tokens = hf_greedy(directory, prompt_ids, n)
    logits = hf_logits(directory, prompt_ids + tokens[:-1])
    gaps = top2_gap(logits[len(prompt_ids) - 1 :])
    assert gaps.min() >= min_gap, f"near-tie in the reference: {gaps.tolist()}"
    return tokens, logits


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """Per row of [T, V] logits, the distance from the best to the second best logit."""
    top2 = logits.topk(2, dim=-1).values  # [T, 2]
    return top2[:, 0] - top2[:, 1]
