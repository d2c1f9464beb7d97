"""Hybrid linear attention (Qwen3.5-MoE): decode tok/s at batch 1 and 4, hybridmoe against
Hugging Face `transformers` (its torch fallbacks: no fla / causal-conv1d) on the same small
random Qwen3.5-MoE-shaped checkpoint, side by side in one run; and the recurrent-state bytes
per sequence of Qwen3.5-35B-A3B's real shape beside its KV bytes.

    python benchmarks/bench_hybrid_attention.py [--tokens 24] [--threads 2] [--repeats 2]

The checkpoint (bf16, written by transformers) goes to --checkpoint-dir and is reused. Decode
time is t(prompt + N tokens) - t(prompt + 1 token) for both engines, best of --repeats
interleaved rounds; both decode greedily and their tokens are compared. hybridmoe runs the
`resident` decode target (every expert in memory, as transformers has them).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import transformers

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.kv_cache import kv_bytes_per_position, state_bytes
from hybridmoe.models.registry import MODEL_REGISTRY
from hybridmoe.moe.config import OffloadConfig

SHAPE = dict(  # ~0.5B parameters: Qwen3.5-MoE's structure, small enough for a shared CPU
    vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
    linear_key_head_dim=64, linear_value_head_dim=64, num_experts=32, num_experts_per_tok=8,
    moe_intermediate_size=384, shared_expert_intermediate_size=384,
    max_position_embeddings=4096,
)  # fmt: skip
# Qwen3.5-35B-A3B (transformers' Qwen3_5MoeTextConfig defaults, documented as that checkpoint's):
# 40 layers, every 4th full attention (10), 30 Gated DeltaNet layers with 16 key heads and 32
# value heads of 128 dims, conv kernel 4; full attention with 2 KV heads of 256 dims.
REAL_SHAPE = dict(
    num_hidden_layers=40, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    vocab_size=248320, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
)  # fmt: skip


def ensure_checkpoint(directory: Path) -> Path:
    if (directory / "config.json").exists():
        return directory
    config = transformers.Qwen3_5MoeTextConfig(**SHAPE)
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def time_ours(engine: Engine, prompts: list[list[int]], n: int) -> tuple[float, list]:
    def run(tokens: int) -> tuple[float, list]:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        out = engine.generate_ids(prompts, params)
        return time.perf_counter() - start, out

    t1, _ = run(1)
    tn, out = run(n)
    return tn - t1, out


@torch.no_grad()
def time_hf(model, prompts: list[list[int]], n: int) -> tuple[float, list]:
    ids = torch.tensor(prompts)

    def run(tokens: int):
        start = time.perf_counter()
        out = model.generate(
            ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, use_cache=True
        )
        return time.perf_counter() - start, out[:, ids.shape[1] :].tolist()

    t1, _ = run(1)
    tn, out = run(n)
    return tn - t1, out


def report_state_bytes() -> None:
    family = MODEL_REGISTRY["Qwen3_5MoeForCausalLM"]
    cfg = family.config_from({**REAL_SHAPE, "architectures": ["Qwen3_5MoeForCausalLM"]})
    state = state_bytes(cfg, torch.bfloat16)
    kv = kv_bytes_per_position(cfg, torch.bfloat16)
    s = cfg.linear_attention
    print(
        f"Qwen3.5-35B-A3B shape, bf16: {sum(cfg.linear_layers)} linear layers x (delta state "
        f"{s.num_value_heads}x{s.key_head_dim}x{s.value_head_dim} fp32 + conv state "
        f"{s.conv_dim}x{s.conv_kernel - 1} bf16) = {state / 2**20:.2f} MiB per sequence, "
        f"independent of its length; KV of its {cfg.num_layers - sum(cfg.linear_layers)} "
        f"full-attention layers {kv / 2**10:.0f} KiB per position "
        f"(state = KV of {state / kv:.0f} positions; at 4096 positions KV "
        f"{4096 * kv / 2**20:.0f} MiB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path("~/.cache/hybridmoe/bench-qwen35moe").expanduser(),
    )
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    report_state_bytes()
    torch.set_num_threads(args.threads)
    directory = ensure_checkpoint(args.checkpoint_dir)
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    hf.eval()
    # every expert resident (the cpu device standing in for the accelerator), as transformers
    # keeps them: the comparison is of the layers' math, not of expert placement
    offload = OffloadConfig(decode_target="resident")
    config = EngineConfig(
        dtype="bfloat16", threads=args.threads, max_batch=4, max_seq_len=512, offload=offload
    )
    with Engine.from_pretrained(directory, config) as engine:
        for batch in (1, 4):
            prompts = [[100 + 7 * b + i for i in range(32)] for b in range(batch)]
            best_ours = best_hf = float("inf")
            for _ in range(args.repeats):
                t_ours, ours = time_ours(engine, prompts, args.tokens)
                t_hf, theirs = time_hf(hf, prompts, args.tokens)
                best_ours, best_hf = min(best_ours, t_ours), min(best_hf, t_hf)
            tokens = batch * (args.tokens - 1)
            same = sum(a == b for a, b in zip(ours, theirs, strict=True))
            print(
                f"batch {batch}: hybridmoe {tokens / best_ours:.1f} tok/s, transformers "
                f"{tokens / best_hf:.1f} tok/s, ratio {best_hf / best_ours:.2f}x; "
                f"{same}/{batch} sequences with identical tokens"
            )


if __name__ == "__main__":
    main()
