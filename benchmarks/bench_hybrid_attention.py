"""Hybrid linear attention (Qwen3.5-MoE): decode tok/s at batch 1 and 4, hybridmoe against
Hugging Face `transformers` (its torch fallbacks: no fla / causal-conv1d) on the same random
Qwen3.5-MoE-shaped checkpoint, side by side in one run; and the recurrent-state bytes per
sequence of the checkpoint's shape and of Qwen3.5-35B-A3B's real shape beside its KV bytes.

    python benchmarks/bench_hybrid_attention.py [--shape small|2gb|tiny] [--tokens 24]
        [--threads 2] [--repeats 2]

The checkpoint (bf16, written by transformers) goes to --checkpoint-dir (default: one per
shape under ~/.cache/hybridmoe) and is reused. Decode time is t(prompt + N tokens) -
t(prompt + 1 token) for both engines, best of --repeats interleaved rounds, in wall time and
in this process's CPU time (getrusage: less sensitive to other processes on a shared
machine); both decode greedily and their tokens are compared. hybridmoe runs the `resident`
decode target (every expert in memory, as transformers has them). The load average is
printed before and after: on a busy machine read the ratios, not the tok/s.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

import torch
import transformers

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.kv_cache import kv_bytes_per_position, state_bytes
from hybridmoe.models.registry import MODEL_REGISTRY
from hybridmoe.moe.config import AUTO_TARGET, DECODE_TARGETS, OffloadConfig

_COMMON = dict(num_key_value_heads=2, max_position_embeddings=4096)
SHAPES = {  # Qwen3.5-MoE's structure (every 4th layer full attention) at three sizes
    # ~0.4B parameters, ~0.8 GB bf16: small enough for a shared CPU
    "small": dict(
        vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8,
        head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
        linear_key_head_dim=64, linear_value_head_dim=64, num_experts=32,
        num_experts_per_tok=8, moe_intermediate_size=384, shared_expert_intermediate_size=384,
    ),
    # ~1.0B parameters, ~2.1 GB bf16: Qwen3.5-35B-A3B's layer widths (hidden 2048, 16/32
    # linear heads of 128, experts of 512, top-8) with 8 layers and 24 experts
    "2gb": dict(
        vocab_size=32000, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, num_experts=24,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    ),
    # a few MB: the smoke test's
    "tiny": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    ),
}  # fmt: skip
# Qwen3.5-35B-A3B (transformers' Qwen3_5MoeTextConfig defaults, documented as that checkpoint's):
# 40 layers, every 4th full attention (10), 30 Gated DeltaNet layers with 16 key heads and 32
# value heads of 128 dims, conv kernel 4; full attention with 2 KV heads of 256 dims.
REAL_SHAPE = dict(
    num_hidden_layers=40, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    vocab_size=248320, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
)  # fmt: skip


def ensure_checkpoint(shape: str, directory: Path) -> Path:
    """The random bf16 checkpoint of SHAPES[shape] in `directory` (written once, reused)."""
    if (directory / "config.json").exists():
        return directory
    print(f"building the random {shape} checkpoint in {directory} ...", flush=True)
    start = time.perf_counter()
    config = transformers.Qwen3_5MoeTextConfig(**_COMMON, **SHAPES[shape])
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    print(f"  {params / 1e9:.2f}B parameters initialised in {time.perf_counter() - start:.0f} s")
    model.save_pretrained(directory)
    print(f"  written ({time.perf_counter() - start:.0f} s)", flush=True)
    return directory


def cpu_s() -> float:
    """This process's user + system CPU seconds so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(run, tokens: int) -> tuple[float, float, list]:
    wall, cpu = time.perf_counter(), cpu_s()
    out = run(tokens)
    return time.perf_counter() - wall, cpu_s() - cpu, out


def time_ours(engine: Engine, prompts: list[list[int]], n: int) -> tuple[float, float, list]:
    """(decode wall s, decode CPU s, tokens) of greedy N tokens minus 1 token."""

    def run(tokens: int) -> list:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        return engine.generate_ids(prompts, params)

    w1, c1, _ = _timed(run, 1)
    wn, cn, out = _timed(run, n)
    return wn - w1, cn - c1, out


@torch.no_grad()
def time_hf(model, prompts: list[list[int]], n: int) -> tuple[float, float, list]:
    """time_ours for a transformers model (generate, greedy, its own cache)."""
    ids = torch.tensor(prompts)

    def run(tokens: int) -> list:
        out = model.generate(
            ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, use_cache=True
        )
        return out[:, ids.shape[1] :].tolist()

    w1, c1, _ = _timed(run, 1)
    wn, cn, out = _timed(run, n)
    return wn - w1, cn - c1, out


def load_average() -> str:
    return "load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


def compare(engine: Engine, hf, args: argparse.Namespace, label: str = "") -> None:
    """Batch 1 and 4 (prompts of 32 tokens), hybridmoe beside transformers round by round
    after one untimed warm-up each:
    best of args.repeats in wall and CPU time, the ratio transformers / hybridmoe (> 1: we
    are faster), and how many sequences have identical tokens."""
    for batch in (1, 4):
        prompts = [[100 + 7 * b + i for i in range(32)] for b in range(batch)]
        time_ours(engine, prompts, 2), time_hf(hf, prompts, 2)  # warm-up: first-use costs
        ours_s, hf_s = [float("inf")] * 2, [float("inf")] * 2  # (wall, cpu)
        for _ in range(args.repeats):
            *t_ours, ours = time_ours(engine, prompts, args.tokens)
            *t_hf, theirs = time_hf(hf, prompts, args.tokens)
            ours_s = [min(a, b) for a, b in zip(ours_s, t_ours, strict=True)]
            hf_s = [min(a, b) for a, b in zip(hf_s, t_hf, strict=True)]
        tokens = batch * (args.tokens - 1)
        same = sum(a == b for a, b in zip(ours, theirs, strict=True))
        print(
            f"{label}batch {batch}: hybridmoe {tokens / ours_s[0]:.1f} tok/s, transformers "
            f"{tokens / hf_s[0]:.1f} tok/s, ratio {hf_s[0] / ours_s[0]:.2f}x (CPU time "
            f"{1e3 * ours_s[1] / tokens:.0f} vs {1e3 * hf_s[1] / tokens:.0f} ms/token, ratio "
            f"{hf_s[1] / ours_s[1]:.2f}x); {same}/{batch} sequences with identical tokens; "
            f"{load_average()}",
            flush=True,
        )


def add_common_args(parser: argparse.ArgumentParser, shapes, cache_name: str) -> None:
    """--shape, --checkpoint-dir (default ~/.cache/hybridmoe/<cache_name>-<shape>), --tokens,
    --threads, --repeats, --decode-target: the flags the e2e comparisons against transformers
    share."""
    parser.add_argument("--shape", choices=sorted(shapes), default=next(iter(shapes)))
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    # auto: what a user gets with no flags (cpu on a machine without an accelerator)
    parser.add_argument("--decode-target", choices=DECODE_TARGETS, default=AUTO_TARGET)
    parser.set_defaults(cache_name=cache_name)


def checkpoint_dir(args: argparse.Namespace) -> Path:
    if args.checkpoint_dir is not None:
        return args.checkpoint_dir
    return Path(f"~/.cache/hybridmoe/{args.cache_name}-{args.shape}").expanduser()


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine a user gets with `--decode-target` (default auto: the fast CPU kernels on
    a machine without an accelerator; `resident` puts every expert on the cpu device as
    transformers keeps them, through the accelerator's torch path)."""
    offload = OffloadConfig(decode_target=args.decode_target)
    return EngineConfig(
        dtype="bfloat16", threads=args.threads, max_batch=4, max_seq_len=512, offload=offload
    )


def report_state_bytes(shape: dict, name: str) -> None:
    family = MODEL_REGISTRY["Qwen3_5MoeForCausalLM"]
    raw = {**_COMMON, **shape, "architectures": ["Qwen3_5MoeForCausalLM"]}
    cfg = family.config_from(raw)
    state = state_bytes(cfg, torch.bfloat16)
    kv = kv_bytes_per_position(cfg, torch.bfloat16)
    s = cfg.linear_attention
    print(
        f"{name}, bf16: {sum(cfg.linear_layers)} linear layers x (delta state "
        f"{s.num_value_heads}x{s.key_head_dim}x{s.value_head_dim} fp32 + conv state "
        f"{s.conv_dim}x{s.conv_kernel - 1} bf16) = {state / 2**20:.2f} MiB per sequence, "
        f"independent of its length; KV of its {cfg.num_layers - sum(cfg.linear_layers)} "
        f"full-attention layers {kv / 2**10:.0f} KiB per position "
        f"(state = KV of {state / kv:.0f} positions; at 4096 positions KV "
        f"{4096 * kv / 2**20:.0f} MiB)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser, SHAPES, "bench-qwen35moe")
    args = parser.parse_args(argv)
    report_state_bytes(REAL_SHAPE, "Qwen3.5-35B-A3B shape")
    report_state_bytes(SHAPES[args.shape], f"this {args.shape} checkpoint")
    torch.set_num_threads(args.threads)
    directory = ensure_checkpoint(args.shape, checkpoint_dir(args))
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    hf.eval()
    print(load_average())
    with Engine.from_pretrained(directory, engine_config(args)) as engine:
        compare(engine, hf, args)


if __name__ == "__main__":
    main()
