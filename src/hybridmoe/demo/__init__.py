"""The embedded demo checkpoint: a small Qwen3-MoE built deterministically on first use.

Its tokenizer ships with the package (demo/assets); its weights are generated from a fixed
seed into the cache directory once, then loaded from disk like any user checkpoint.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybridmoe.env import cache_dir

DEMO_VERSION = "v1"
DEMO_SEED = 1234
DEMO_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "torch_dtype": "float32",
}
ASSET_FILES = ("tokenizer.json", "tokenizer_config.json")


def demo_checkpoint_dir() -> Path:
    """Directory of the demo checkpoint, built on first call (safe against concurrent builds)."""
    target = cache_dir() / f"demo-qwen3moe-{DEMO_VERSION}"
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        _write_checkpoint(staging)
        staging.rename(target)  # atomic: readers see all of it or nothing
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_checkpoint(directory: Path) -> None:
    assets = resources.files("hybridmoe.demo") / "assets"
    for name in ASSET_FILES:
        (directory / name).write_bytes((assets / name).read_bytes())
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    vocab_size = len(tokenizer["model"]["vocab"]) + len(
        [t for t in tokenizer["added_tokens"] if t["content"] not in tokenizer["model"]["vocab"]]
    )
    eos = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|im_end|>")
    config = dict(DEMO_CONFIG, vocab_size=vocab_size, eos_token_id=eos)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    save_file(_demo_weights(config), str(directory / "model.safetensors"), {"format": "pt"})


def _demo_weights(cfg: dict) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(DEMO_SEED)
    hidden, heads, kv_heads, head_dim = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )

    def randn(*shape: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    weights = {"model.embed_tokens.weight": randn(cfg["vocab_size"], hidden, std=0.5)}
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = randn(cfg["vocab_size"], hidden, std=0.5)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        weights[f"{p}.input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden)
        weights[f"{p}.self_attn.q_proj.weight"] = randn(heads * head_dim, hidden)
        weights[f"{p}.self_attn.k_proj.weight"] = randn(kv_heads * head_dim, hidden)
        weights[f"{p}.self_attn.v_proj.weight"] = randn(kv_heads * head_dim, hidden)
        weights[f"{p}.self_attn.o_proj.weight"] = randn(hidden, heads * head_dim)
        weights[f"{p}.self_attn.q_norm.weight"] = torch.ones(head_dim)
        weights[f"{p}.self_attn.k_norm.weight"] = torch.ones(head_dim)
        if i in cfg["mlp_only_layers"]:
            _mlp(weights, f"{p}.mlp", hidden, cfg["intermediate_size"], randn)
            continue
        weights[f"{p}.mlp.gate.weight"] = randn(cfg["num_experts"], hidden, std=0.5)
        for e in range(cfg["num_experts"]):
            _mlp(weights, f"{p}.mlp.experts.{e}", hidden, cfg["moe_intermediate_size"], randn)
    return weights


def _mlp(weights: dict, prefix: str, hidden: int, inter: int, randn) -> None:
    weights[f"{prefix}.gate_proj.weight"] = randn(inter, hidden)
    weights[f"{prefix}.up_proj.weight"] = randn(inter, hidden)
    weights[f"{prefix}.down_proj.weight"] = randn(hidden, inter)
