"""Decode tok/s of each decode target on the 1B benchmark checkpoint of bench_decode.py,
printed as ratios to the `resident` target measured in the same run, with the expert-cache stats.

On a machine without an accelerator the accelerator tier is the CPU itself, so this shows the
cost of the hybrid machinery rather than a speed-up; on a GPU machine it is the real comparison.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from bench_decode import Qwen3MoeShape, ensure_checkpoint
from tqdm import tqdm

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe.config import DECODE_TARGETS, OffloadConfig


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--checkpoint-dir", type=Path, default=Path.home() / ".cache/hybridmoe/bench-qwen3moe-1b"
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ratio", type=float, default=0.25, help="expert cache share")
    parser.add_argument("--max-fetch", type=int, default=1)
    return parser.parse_args()


def run_target(directory: Path, args: argparse.Namespace, target: str) -> tuple[list, object]:
    offload = OffloadConfig(
        decode_target=target, expert_cache_ratio=args.ratio, max_fetch=args.max_fetch
    )
    prompt = [list(range(100, 116))]
    with Engine.from_pretrained(directory, EngineConfig(dtype=args.dtype, offload=offload)) as e:
        e.generate_ids(prompt, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        tokens = e.generate_ids(prompt, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
        return tokens, e.stats


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    directory = ensure_checkpoint(Qwen3MoeShape(), args.checkpoint_dir)
    results = {t: run_target(directory, args, t) for t in tqdm(DECODE_TARGETS, desc="targets")}
    base_tokens, base = results["resident"]
    setup = f"cache ratio {args.ratio}, max_fetch {args.max_fetch}, {args.threads} threads"
    print(f"{args.dtype}, {setup}")
    for target, (tokens, stats) in results.items():
        same = "same tokens" if tokens == base_tokens else "TOKENS DIFFER"
        ratio = stats.decode_tok_per_s / base.decode_tok_per_s
        print(f"{target:8s} {ratio:5.2f}x of resident  {same}  {stats.summary()}")


if __name__ == "__main__":
    main()
