"""Decode tok/s of every decode target on the accelerator, for a synthetic Qwen3-MoE model whose
routed experts far outnumber the expert cache's slots; printed as ratios to `offload`, with the
cache hit rate and whether each target's greedy tokens are `offload`'s.

    python benchmarks/bench_gpu_decode.py [--device auto|cpu|cuda[:N]] [--tokens 64]
        [--cache-ratio 0.125 | --gpu-memory GIB] [--max-fetch 1] [--batch 1]
    python benchmarks/bench_gpu_decode.py --device cpu --small --tokens 8   # a smoke test

The checkpoint (bench_decode.py's ~1B-parameter shape, bf16; `--small`: a tiny one) is written
once into --checkpoint-dir and reused. The cache holds --cache-ratio of all routed experts, or
as many as --gpu-memory leaves room for. `gpu` (every expert resident) runs when it fits. Each
target loads its own engine, decodes once to warm up, then --repeats times; the best decode
tok/s (the engine's own figure: prefill excluded) is kept, with the cache figures of the last
run (the cache's contents carry over from run to run). In bf16 the CPU and the accelerator
round differently, so random weights' greedy tokens may part after a while; tests/gpu checks
exactness in fp32 (--dtype float32 makes the comparison here exact too).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_decode import DEFAULT_CHECKPOINT_DIR, Qwen3MoeShape, ensure_checkpoint
from tqdm import tqdm

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.stats import GenerationStats
from hybridmoe.errors import DeviceMemoryError
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.platform.base import DEVICE_HELP, resolve_device

SMALL_SHAPE = Qwen3MoeShape(
    vocab_size=2048,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=64,
)
# label -> OffloadConfig fields besides the cache size, fetch cap and CPU kernel settings
TARGETS: dict[str, dict] = {
    "resident": dict(decode_target="resident"),
    "offload": dict(decode_target="offload"),
    "cpu": dict(decode_target="cpu"),
    "hybrid": dict(decode_target="hybrid", overlap=True),
    "hybrid-serial": dict(decode_target="hybrid", overlap=False),
}
BASELINE = "offload"


@dataclass
class Outcome:
    label: str
    tokens: list[list[int]] | None = None  # greedy tokens per prompt
    decode_tok_s: float = 0.0  # the best of the timed runs
    stats: GenerationStats | None = None  # of the last run: the cache's state carries over
    # from run to run, so the figures of the fastest one would depend on timing noise
    slots: int | None = None  # expert cache slots; None without a cache
    refused: str | None = None  # why the target did not run (it does not fit)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--small", action="store_true", help="a tiny model: a smoke test")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--expert-format", choices=("bf16", "q8_0", "q4_0"), default=None)
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per run")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per target; best")
    parser.add_argument("--cache-ratio", type=float, default=0.125, help="slots / all experts")
    parser.add_argument("--gpu-memory", type=float, default=None, help="GiB; sets the slots")
    parser.add_argument("--max-fetch", type=int, default=1)
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS))
    args = parser.parse_args()
    if args.tokens < 2:
        parser.error("--tokens must be at least 2: decode starts after the first token")
    if BASELINE not in args.targets:
        parser.error(f"--targets must include {BASELINE}, the baseline of the ratios")
    return args


def make_prompts(shape: Qwen3MoeShape, args: argparse.Namespace) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, shape.vocab_size, (args.batch, args.prompt_tokens), generator=gen)
    return ids.tolist()


def engine_config(shape: Qwen3MoeShape, args: argparse.Namespace, label: str) -> EngineConfig:
    total_experts = shape.num_hidden_layers * shape.num_experts
    slots = None if args.gpu_memory else max(1, round(args.cache_ratio * total_experts))
    offload = OffloadConfig(
        **TARGETS[label],
        expert_cache_slots=slots,
        max_fetch=args.max_fetch,
        cpu_threads=args.cpu_threads,
        expert_format=args.expert_format,
    )
    return EngineConfig(
        dtype=args.dtype,
        device=args.device,
        max_batch=args.batch,
        gpu_memory=args.gpu_memory,
        max_seq_len=args.prompt_tokens + args.tokens + 1,
        offload=offload,
    )


def run_target(
    directory: Path,
    config: EngineConfig,
    label: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
) -> Outcome:
    try:
        engine = Engine.from_pretrained(directory, config)
    except DeviceMemoryError as err:
        return Outcome(label, refused=str(err))
    with engine:
        cache = engine.moe_runtime.cache
        engine.generate_ids(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        outcome = Outcome(label, slots=None if cache is None else cache.num_slots)
        for _ in range(args.repeats):
            outcome.tokens = engine.generate_ids(prompts, params)
            outcome.stats = engine.stats
            outcome.decode_tok_s = max(outcome.decode_tok_s, engine.stats.decode_tok_per_s)
    return outcome


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> str:
    """'same tokens', or where the first prompt that differs parts from the reference."""
    for prompt, (ours, theirs) in enumerate(zip(tokens, reference, strict=True)):
        if ours != theirs:
            agree = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
            return f"TOKENS DIFFER: prompt {prompt} from token {agree} of {len(theirs)}"
    return "same tokens"


def print_setup(shape: Qwen3MoeShape, args: argparse.Namespace, directory: Path) -> None:
    device = resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "host memory"
    total_experts = shape.num_hidden_layers * shape.num_experts
    cache = (
        f"slots from --gpu-memory {args.gpu_memory} GiB"
        if args.gpu_memory
        else f"{args.cache_ratio:.1%} of the experts"
    )
    print(
        f"device {device} ({name}), torch {torch.__version__}, {args.dtype}, experts "
        f"{args.expert_format or 'in the model dtype'}\n"
        f"checkpoint {directory}: Qwen3-MoE {shape.total_params / 1e9:.3f} B params, "
        f"{shape.num_hidden_layers} layers x {shape.num_experts} experts ({total_experts}), "
        f"top-{shape.num_experts_per_tok}\n"
        f"expert cache: {cache}, max_fetch {args.max_fetch}; batch {args.batch}, prompt "
        f"{args.prompt_tokens} tokens, {args.tokens} generated, best of {args.repeats}"
    )


def print_results(outcomes: dict[str, Outcome]) -> None:
    base = outcomes[BASELINE]
    header = f"{'target':14s} {'tok/s':>8s} {'x offload':>9s} {'slots':>6s} {'hit rate':>8s}"
    print(f"{header} {'CPU routes':>10s} {'fetched/tok':>11s}  tokens vs offload")
    for label, outcome in outcomes.items():
        if outcome.refused:
            print(f"{label:14s} does not fit: {outcome.refused}")
            continue
        stats, experts = outcome.stats, outcome.stats.experts
        ratio = outcome.decode_tok_s / base.decode_tok_s if base.decode_tok_s else float("nan")
        slots = "-" if outcome.slots is None else str(outcome.slots)
        figures = f"{label:14s} {outcome.decode_tok_s:8.2f} {ratio:8.2f}x {slots:>6s}"
        if experts is not None and experts.routes:
            cpu_share = experts.cpu_routes / experts.routes
            fetched = experts.fetched / max(stats.decode_tokens, 1)
            figures += f" {experts.hit_rate:8.1%} {cpu_share:10.1%} {fetched:11.2f}"
        else:
            figures += f" {'-':>8s} {'-':>10s} {'-':>11s}"
        print(f"{figures}  {agreement(outcome.tokens, base.tokens)}")


def main() -> None:
    args = parse_args()
    shape = SMALL_SHAPE if args.small else Qwen3MoeShape()
    default_dir = DEFAULT_CHECKPOINT_DIR.with_name("bench-qwen3moe-small")
    directory = args.checkpoint_dir or (default_dir if args.small else DEFAULT_CHECKPOINT_DIR)
    ensure_checkpoint(shape, directory)
    print_setup(shape, args, directory)
    prompts = make_prompts(shape, args)
    outcomes = {}
    for label in tqdm(args.targets, desc="targets", unit="target"):
        config = engine_config(shape, args, label)
        outcomes[label] = run_target(directory, config, label, prompts, args)
    if outcomes[BASELINE].refused:
        raise SystemExit(f"{BASELINE} does not fit: {outcomes[BASELINE].refused}")
    print_results(outcomes)


if __name__ == "__main__":
    main()
