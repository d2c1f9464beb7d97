"""Decode tokens/s at batch 1: hybridmoe against Hugging Face `transformers` on the same ~1B-
parameter random Qwen3-MoE checkpoint, and against the memory-bandwidth limit measured in the
same run.

    python benchmarks/bench_decode.py [--dtype bfloat16|float32] [--tokens 32] [--threads 2]

The checkpoint is written once (bf16, hub layout: per-expert tensors, sharded, hub-spelled
config.json) into --checkpoint-dir and reused. Both engines decode the same prompt greedily;
decode time is t(prompt + N tokens) - t(prompt + 1 token), so prefill and the first token are
excluded the same way for both; the engines and the bandwidth probe run in interleaved rounds
(--repeats), reported as best and median.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file
from tqdm import tqdm

DEFAULT_CHECKPOINT_DIR = Path("~/.cache/hybridmoe/bench-qwen3moe-1b").expanduser()
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Qwen3MoeShape:
    vocab_size: int = 32000
    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 64
    num_experts: int = 64
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 384

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: dims for shard in self.shards() for name, dims in shard.items()}

    @property
    def total_params(self) -> int:
        return sum(math.prod(dims) for dims in self.tensor_shapes().values())

    @property
    def active_params(self) -> int:
        """Weights one decode token reads: all but the unrouted experts and other embedding rows."""
        shapes = self.tensor_shapes()
        expert_params = sum(math.prod(d) for n, d in shapes.items() if ".experts." in n)
        unrouted = expert_params * (self.num_experts - self.num_experts_per_tok) // self.num_experts
        return self.total_params - unrouted - (self.vocab_size - 1) * self.hidden_size

    def config_json(self) -> dict:
        # The spelling of published Qwen3-MoE checkpoints (`num_experts`, `rope_theta`).
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **asdict(self),
            "intermediate_size": 3072,  # dense MLP width; unused, every layer is sparse
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "max_position_embeddings": 32768,
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "bfloat16",
        }

    def layer_tensor_shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        h, d, e = self.hidden_size, self.head_dim, self.moe_intermediate_size
        p = f"model.layers.{i}."
        shapes = {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (self.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (self.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": (self.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": (h, self.num_attention_heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate.weight": (self.num_experts, h),
        }
        for x in range(self.num_experts):
            shapes[p + f"mlp.experts.{x}.gate_proj.weight"] = (e, h)
            shapes[p + f"mlp.experts.{x}.up_proj.weight"] = (e, h)
            shapes[p + f"mlp.experts.{x}.down_proj.weight"] = (h, e)
        return shapes

    def shards(self) -> list[dict[str, tuple[int, ...]]]:
        """Tensor shapes per shard: embeddings, one shard per layer, then the head."""
        v, h = self.vocab_size, self.hidden_size
        layers = [self.layer_tensor_shapes(i) for i in range(self.num_hidden_layers)]
        head = {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
        return [{"model.embed_tokens.weight": (v, h)}, *layers, head]


def ensure_checkpoint(shape: Qwen3MoeShape, directory: Path) -> Path:
    """Reuse `directory` if it holds this shape's checkpoint; else write it (atomically)."""
    config_path = directory / "config.json"
    if config_path.exists() and json.loads(config_path.read_text()) == shape.config_json():
        return directory
    staging = directory.with_name(f"{directory.name}.{os.getpid()}.partial")  # one per run
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _write_shards(shape, staging)
    (staging / "config.json").write_text(json.dumps(shape.config_json(), indent=2))
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    return directory


def _write_shards(shape: Qwen3MoeShape, directory: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    shards = shape.shards()
    weight_map, total_bytes = {}, 0
    for n, shard in enumerate(tqdm(shards, desc="writing checkpoint", unit="shard"), start=1):
        filename = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _random_weight(name, dims, generator) for name, dims in shard.items()}
        save_file(tensors, directory / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _random_weight(name: str, dims: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(dims, dtype=torch.bfloat16)
    return (0.02 * torch.randn(dims, generator=generator)).to(torch.bfloat16)


class BandwidthProbe:
    """Read bandwidth of this process: one torch.sum over 1 GiB of float32."""

    def __init__(self) -> None:
        self._x = torch.ones(2**28, dtype=torch.float32)

    def gbps(self) -> float:
        return self._x.nbytes / _timed(self._x.sum) / 1e9


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class DecodeTimings:
    """Per round: time of prompt + 1 token and of prompt + N tokens; their difference is decode."""

    first_s: list[float] = field(default_factory=list)
    full_s: list[float] = field(default_factory=list)
    own_tok_s: list[float] = field(default_factory=list)  # as the engine reports it, if it does
    tokens: list[int] = field(default_factory=list)

    def best_tok_s(self, n_tokens: int) -> float:
        return _tok_s(n_tokens - 1, min(self.full_s) - min(self.first_s))

    def median_tok_s(self, n_tokens: int) -> float:
        pairs = zip(self.full_s, self.first_s, strict=True)
        return _tok_s(n_tokens - 1, statistics.median(full - first for full, first in pairs))


def _tok_s(n_tokens: int, seconds: float) -> float:
    return n_tokens / seconds if seconds > 0 else float("nan")  # nan: noise exceeded decode time


class Runner(NamedTuple):
    generate: Callable[[list[int], int], list[int]]  # (prompt ids, n tokens) -> greedy ids
    close: Callable[[], None]
    # The engine's own decode tok/s for its last generate call, where it reports one.
    own_decode_tok_s: Callable[[], float] | None = None


def load_hybridmoe(directory: Path, dtype: str) -> Runner:
    from hybridmoe.engine import Engine, EngineConfig, SamplingParams

    engine = Engine.from_pretrained(directory, EngineConfig(dtype=dtype))

    def generate(prompt: list[int], n: int) -> list[int]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return engine.generate_ids([prompt], params)[0]

    return Runner(generate, engine.close, lambda: engine.stats.decode_tok_per_s)


def load_transformers(directory: Path, dtype: str, experts_implementation: str | None) -> Runner:
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory,
        dtype=DTYPES[dtype],
        experts_implementation=experts_implementation,
        output_loading_info=True,
    )
    problems = {kind: keys for kind, keys in info.items() if keys}
    if problems:
        raise RuntimeError(f"transformers did not load {directory} cleanly: {problems}")
    model.eval()
    config = model.config
    print(f"  attention {config._attn_implementation}, experts {config._experts_implementation}")

    @torch.no_grad()
    def generate(prompt: list[int], n: int) -> list[int]:
        # A manual greedy loop over HF's KV cache: no EOS handling, no logits processors.
        cache = transformers.DynamicCache(config=config)
        ids = torch.tensor([prompt])
        out: list[int] = []
        for _ in range(n):
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits  # [1, T, V]
            out.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
        return out

    return Runner(generate, lambda: None)


def time_rounds(
    runners: dict[str, Runner], args: argparse.Namespace, prompt: list[int]
) -> tuple[dict[str, DecodeTimings], list[float]]:
    """Interleave the engines and the bandwidth probe round by round, so that a slow spell of a
    shared machine hits all of them rather than one."""
    probe = BandwidthProbe()
    timings = {name: DecodeTimings() for name in runners}
    bandwidths_gbps = []
    for _ in tqdm(range(args.repeats), desc="timing", unit="round"):
        bandwidths_gbps.append(probe.gbps())
        for name, runner in runners.items():
            t = timings[name]
            t.first_s.append(_timed(partial(runner.generate, prompt, 1)))
            start = time.perf_counter()
            t.tokens = runner.generate(prompt, args.tokens)
            t.full_s.append(time.perf_counter() - start)
            if runner.own_decode_tok_s is not None:
                t.own_tok_s.append(runner.own_decode_tok_s())
    return timings, bandwidths_gbps


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", type=Path, default=DEFAULT_CHECKPOINT_DIR)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--tokens", type=int, default=32, help="generated tokens per run")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before timing")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds; best and median")
    parser.add_argument("--only", choices=["hybridmoe", "transformers"], default=None)
    parser.add_argument(
        "--hf-experts-implementation",
        choices=["eager", "grouped_mm", "batched_mm"],
        default=None,
        help="transformers' MoE kernel; default: its own choice",
    )
    args = parser.parse_args()
    if args.tokens < 2:
        parser.error("--tokens must be at least 2: decode starts after the first token")
    return args


def print_setup(shape: Qwen3MoeShape, args: argparse.Namespace) -> None:
    print(
        f"checkpoint {args.checkpoint_dir}: Qwen3-MoE, {shape.total_params / 1e9:.3f} B params, "
        f"{shape.num_hidden_layers} layers x {shape.num_experts} experts, "
        f"top-{shape.num_experts_per_tok}"
    )
    print(
        f"dtype {args.dtype}, {args.threads} threads, prompt {args.prompt_tokens} tokens, "
        f"{args.tokens - 1} decode tokens timed, best and median of {args.repeats} rounds"
    )


def print_results(
    shape: Qwen3MoeShape, args: argparse.Namespace, timings: dict[str, DecodeTimings], gbps: float
) -> None:
    bytes_per_token = shape.active_params * DTYPES[args.dtype].itemsize
    limit_tok_s = gbps * 1e9 / bytes_per_token
    print(
        f"active params/token {shape.active_params / 1e6:.1f} M: "
        f"{bytes_per_token / 1e6:.0f} MB of weights read per token"
    )
    print(f"memory bandwidth (best torch.sum over 1 GiB): {gbps:.1f} GB/s")
    print(f"  bandwidth limit: {limit_tok_s:.1f} tok/s")
    for name, t in timings.items():
        best, median = t.best_tok_s(args.tokens), t.median_tok_s(args.tokens)
        print(
            f"{name:>12}: decode {best:7.2f} tok/s (median {median:7.2f}), "
            f"{best / limit_tok_s:.1%} of the limit"
        )
        if t.own_tok_s:
            print(f"{'':>12}  its own stats: {max(t.own_tok_s):7.2f} tok/s (best)")
    if len(timings) == 2:
        ours, theirs = timings["hybridmoe"], timings["transformers"]
        ratio = ours.best_tok_s(args.tokens) / theirs.best_tok_s(args.tokens)
        median_ratio = ours.median_tok_s(args.tokens) / theirs.median_tok_s(args.tokens)
        print(f"ratio hybridmoe / transformers: {ratio:.2f}x (medians: {median_ratio:.2f}x)")
        pairs = enumerate(zip(ours.tokens, theirs.tokens, strict=True))
        agree = next((i for i, (a, b) in pairs if a != b), args.tokens)
        print(f"greedy tokens agree for the first {agree} of {args.tokens}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    shape = Qwen3MoeShape()
    directory = ensure_checkpoint(shape, args.checkpoint_dir)
    print_setup(shape, args)
    prompt_gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, shape.vocab_size, (args.prompt_tokens,), generator=prompt_gen)

    loaders = {
        "hybridmoe": lambda: load_hybridmoe(directory, args.dtype),
        "transformers": lambda: load_transformers(
            directory, args.dtype, args.hf_experts_implementation
        ),
    }
    runners: dict[str, Runner] = {}
    try:
        for name, load in loaders.items():
            if args.only in (None, name):
                print(f"loading {name}")
                runners[name] = load()
        for runner in runners.values():
            for _ in range(args.warmup):
                runner.generate(prompt.tolist(), min(4, args.tokens))
        timings, bandwidths_gbps = time_rounds(runners, args, prompt.tolist())
    finally:
        for runner in runners.values():
            runner.close()
    print_results(shape, args, timings, max(bandwidths_gbps))


if __name__ == "__main__":
    main()
