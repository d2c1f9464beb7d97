"""End to end: decode tok/s of the `cpu` target on the 1B benchmark checkpoint of bench_decode.py,
numba CPU expert kernels against the torch reference kernel, measured side by side.

    python benchmarks/bench_cpu_decode.py [--dtype float32] [--tokens 24] [--threads 2]
        [--dense] [--shape qwen3-30b-a3b --layers 2]

Every run decodes the same prompt greedily in one process; the first row (the torch reference
on experts in the model's dtype) is the baseline of the ratios. --dense compares the dense
projections instead (numba experts throughout): torch's F.linear (HYBRIDMOE_DENSE_KERNEL=0,
the baseline), the numba dense kernel, and --dense-format q8_0 / q4_0. --shape qwen3-30b-a3b
writes a random checkpoint of Qwen3-30B-A3B's shape (hidden 2048, 32 heads of 128, 4 KV heads,
128 experts of 768, top-8, vocab 151936) with --layers layers (in its own directory).
Rows in another expert format (or dense format) quantise at load; their tokens are compared
with the baseline's (a quantised model may legitimately diverge after a few tokens, so
differing tokens are reported, not failed).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from bench_decode import Qwen3MoeShape, ensure_checkpoint

from hybridmoe import env
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe.config import OffloadConfig

RUNS = (  # (cpu kernel, expert format (None: the model's dtype), dense format, dense kernel)
    ("torch", None, "auto", True),
    ("numba", None, "auto", True),
    ("torch", "bf16", "auto", True),
    ("numba", "bf16", "auto", True),
    ("numba", "q8_0", "auto", True),
    ("numba", "q4_0", "auto", True),
)
DENSE_RUNS = (
    ("numba", None, "auto", False),
    ("numba", None, "auto", True),
    ("numba", None, "q8_0", True),
    ("numba", None, "q4_0", True),
    ("numba", "q8_0", "q8_0", True),
)
QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--checkpoint-dir", type=Path, default=Path.home() / ".cache/hybridmoe/bench-qwen3moe-1b"
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2, help="torch and kernel threads")
    parser.add_argument("--dense", action="store_true", help="compare the dense projections")
    parser.add_argument("--shape", choices=("1b", "qwen3-30b-a3b"), default="1b")
    parser.add_argument("--layers", type=int, default=2, help="layers of --shape qwen3-30b-a3b")
    return parser.parse_args()


def checkpoint(args: argparse.Namespace) -> Path:
    if args.shape == "1b":
        return ensure_checkpoint(Qwen3MoeShape(), args.checkpoint_dir)
    shape = Qwen3MoeShape(num_hidden_layers=args.layers, **QWEN3_30B_A3B)
    name = f"bench-qwen3moe-30b-a3b-{args.layers}l"
    return ensure_checkpoint(shape, args.checkpoint_dir.with_name(name))


def run(directory: Path, args: argparse.Namespace, kernel, fmt, dense_format, dense_kernel):
    offload = OffloadConfig(
        decode_target="cpu", cpu_kernel=kernel, expert_format=fmt, cpu_threads=args.threads
    )
    config = EngineConfig(
        dtype=args.dtype, threads=args.threads, dense_format=dense_format, offload=offload
    )
    os.environ["HYBRIDMOE_DENSE_KERNEL"] = "1" if dense_kernel else "0"
    env.reread_switches()  # read once: again for this run
    prompt = [list(range(100, 116))]
    with Engine.from_pretrained(directory, config) as engine:
        engine.generate_ids(prompt, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        tokens = engine.generate_ids(
            prompt, SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        )
        return tokens[0], engine.stats


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    directory = checkpoint(args)
    print(f"cpu target, model {args.dtype}, {args.threads} threads, {args.tokens} tokens")
    print(f"load average before: {Path('/proc/loadavg').read_text().strip()}")
    base_tokens = base_rate = None
    for kernel, fmt, dense_format, dense_kernel in DENSE_RUNS if args.dense else RUNS:
        tokens, stats = run(directory, args, kernel, fmt, dense_format, dense_kernel)
        rate = stats.decode_tok_per_s
        if base_rate is None:
            base_tokens, base_rate = tokens, rate
        same = next(
            (i for i, (a, b) in enumerate(zip(tokens, base_tokens, strict=True)) if a != b), None
        )
        agree = "same tokens" if same is None else f"first differs at token {same}"
        dense = f"dense {dense_format} {'numba' if dense_kernel else 'torch'}"
        label = f"{kernel:5s} experts {fmt or 'model dtype':11s} {dense:16s}"
        print(f"{label} {rate:7.2f} tok/s  {rate / base_rate:5.2f}x  {agree}", flush=True)
    print(f"load average after: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
