"""Tiny random Qwen3-Next / Qwen3.5-MoE checkpoints written by `transformers` itself, for the
hybrid linear-attention oracle tests (tests/models/test_qwen3_next_oracle.py and
test_qwen3_5_moe_oracle.py).

As in hf_checkpoints.py, weights are re-drawn so that no norm is 1 and greedy choices are far
from ties; the Gated DeltaNet decay is drawn slow (A = exp(A_log) in [0.02, 0.5]) so that the
recurrent state carries a long prompt, which the 300-token cases then test.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch
import transformers

_LINEAR = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_COMMON: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=20,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
    **_LINEAR,
)
# case -> (config class, model class, config kwargs on top of _COMMON); 4 or 5 layers: three
# linear layers then full attention (the Qwen3.5 pattern), and a dense MLP layer for Qwen3-Next.
# fmt: off
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_hidden_layers=5, intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[2])),
    "qwen3_next_gqa_groups": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_hidden_layers=4, intermediate_size=40, norm_topk_prob=False,
        linear_num_key_heads=1, linear_num_value_heads=3, full_attention_interval=2)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(num_hidden_layers=4)),
    # expert rows of whole 256-weight k-quant super-blocks (tests/models/test_gguf_qwen3_next.py)
    "qwen3_next_wide": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_hidden_layers=4, intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[1],
        hidden_size=256, moe_intermediate_size=256, num_experts=4)),
    "qwen3_5_moe_wide": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_hidden_layers=4, hidden_size=256, moe_intermediate_size=256, num_experts=4)),
}
# fmt: on
MULTIMODAL_CASE = "qwen3_5_moe_multimodal"  # the qwen3_5_moe text model in a VL checkpoint
_SEED_SALTS: dict[str, int] = {}
_FINAL_NORM_SCALE = 6.0
_EMBED_STD = 0.1


def write_checkpoint(case: str, directory: Path) -> Path:
    """Build `case` with `transformers`, re-draw its weights, save it (float32) into
    `directory`. Deterministic."""
    if case == MULTIMODAL_CASE:
        model = _multimodal_model()
    else:
        config_name, model_name, kwargs = CASES[case]
        config = getattr(transformers, config_name)(**{**_COMMON, **kwargs})
        model = getattr(transformers, model_name)(config)
    _redraw(model, zlib.crc32(case.encode()) + _SEED_SALTS.get(case, 0))
    model.save_pretrained(directory)
    return Path(directory)


def _multimodal_model() -> torch.nn.Module:
    text = {**_COMMON, "num_hidden_layers": 4}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    return transformers.Qwen3_5MoeForConditionalGeneration(config)


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    for name, param in model.named_parameters():
        if name.endswith("A_log"):
            param.copy_((0.02 + 0.48 * torch.rand(param.shape, generator=gen)).log())
        elif name.endswith("norm.weight") or name.endswith("dt_bias"):
            param.copy_(0.2 * normal(param.shape) + (0.0 if "layernorm" in name else 1.0))
        elif name.endswith("bias"):
            param.copy_(0.2 * normal(param.shape))
        elif name.endswith("embed_tokens.weight"):
            param.copy_(_EMBED_STD * normal(param.shape))
        else:  # [.., out, in]: unit-variance outputs for unit-variance inputs
            param.copy_(normal(param.shape) / param.shape[-1] ** 0.5)
        if name in ("model.norm.weight", "model.language_model.norm.weight"):
            # zero-centred: the scale is 1 + w, here _FINAL_NORM_SCALE * (1 +- 0.2)
            param.copy_(_FINAL_NORM_SCALE * (1 + 0.2 * normal(param.shape)) - 1)


def hf_model(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The checkpoint in `transformers` (its torch fallbacks: no fla/causal-conv1d)."""
    config = transformers.AutoConfig.from_pretrained(directory)
    name = config.architectures[0]
    return getattr(transformers, name).from_pretrained(directory, dtype=dtype).eval()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[T, V] float32 logits of one fresh sequence (no cache: the chunked prefill form)."""
    return model(input_ids=torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """`n` greedy tokens through transformers' cache (the prompt in one forward, then one
    token per forward: its recurrent decode form), and the [T + n - 1, V] logits of one fresh
    forward over prompt + tokens[:-1] (its chunked form at every position)."""
    cache = transformers.DynamicCache(config=model.config)
    ids, tokens = torch.tensor([prompt]), []
    for _ in range(n):
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]  # [V]
        tokens.append(int(logits.argmax()))
        ids = torch.tensor([tokens[-1:]])
    return tokens, hf_logits(model, prompt + tokens[:-1])
