"""End to end: decode tok/s of the `cpu` target on the 1B benchmark checkpoint of bench_decode.py,
numba CPU expert kernels against the torch reference kernel, measured side by side.

    python benchmarks/bench_cpu_decode.py [--dtype float32] [--tokens 24] [--threads 2]

Every run decodes the same prompt greedily in one process; the first row (the torch reference
on experts in the model's dtype) is the baseline of the ratios. Rows in another expert format
quantise the experts at load; their tokens are compared with the baseline's (a quantised
model may legitimately diverge after a few tokens, so differing tokens are reported, not
failed).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from bench_decode import Qwen3MoeShape, ensure_checkpoint

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe.config import OffloadConfig

RUNS = (  # (cpu kernel, expert format; None: the model's dtype)
    ("torch", None),
    ("numba", None),
    ("torch", "bf16"),
    ("numba", "bf16"),
    ("numba", "q8_0"),
    ("numba", "q4_0"),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--checkpoint-dir", type=Path, default=Path.home() / ".cache/hybridmoe/bench-qwen3moe-1b"
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2, help="torch and kernel threads")
    return parser.parse_args()


def run(directory: Path, args: argparse.Namespace, kernel: str, fmt: str | None):
    offload = OffloadConfig(
        decode_target="cpu", cpu_kernel=kernel, expert_format=fmt, cpu_threads=args.threads
    )
    config = EngineConfig(dtype=args.dtype, threads=args.threads, offload=offload)
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
    directory = ensure_checkpoint(Qwen3MoeShape(), args.checkpoint_dir)
    print(f"cpu target, model {args.dtype}, {args.threads} threads, {args.tokens} tokens")
    base_tokens = base_rate = None
    for kernel, fmt in RUNS:
        tokens, stats = run(directory, args, kernel, fmt)
        rate = stats.decode_tok_per_s
        if base_rate is None:
            base_tokens, base_rate = tokens, rate
        same = next(
            (i for i, (a, b) in enumerate(zip(tokens, base_tokens, strict=True)) if a != b), None
        )
        agree = "same tokens" if same is None else f"first differs at token {same}"
        label = f"{kernel:5s} experts {fmt or 'model dtype':11s}"
        print(f"{label} {rate:7.2f} tok/s  {rate / base_rate:5.2f}x  {agree}", flush=True)


if __name__ == "__main__":
    main()
