"""Quantising at load: the numba Q8_0 / Q4_0 quantisers against the torch reference, and the load
time of a ~1 GB random Qwen3-MoE checkpoint converted to --expert-format, side by side.

    python benchmarks/bench_quantize.py [--experts 8] [--rounds 3]
    python benchmarks/bench_quantize.py --load-trees BEFORE/src AFTER/src [--rounds 3]

The first form quantises one layer's worth of experts at the Qwen3-30B-A3B shape (gate_up
[2I, H] and down [H, I] per expert, H=2048, I=768) from bf16 and from float32, fast and
reference in interleaved rounds, and prints G weights/s (of wall time, and per CPU second of
all the process's threads) and the ratios. The second loads the checkpoint (written once
into --checkpoint-dir, bench_decode.py's layout, 6 layers) with
`--decode-target cpu --expert-format FORMAT` in a fresh process per round for each source tree
(PYTHONPATH=tree), interleaved, and prints the seconds Engine.from_pretrained took (imports
excluded; one warm-up load per tree first, so compiled kernels come from the cache). The load
average is printed before each round: on a busy machine compare only the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import Qwen3MoeShape, ensure_checkpoint  # noqa: E402

HIDDEN, INTER = 2048, 768
LOAD_SCRIPT = """
import sys, time, torch
from hybridmoe.engine import Engine, EngineConfig
from hybridmoe.moe.config import OffloadConfig
offload = OffloadConfig(decode_target="cpu", expert_format=sys.argv[2])
start = time.perf_counter()
engine = Engine.from_pretrained(sys.argv[1], EngineConfig(dtype="bfloat16", offload=offload))
print(time.perf_counter() - start)
"""


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def bench_quantisers(args: argparse.Namespace) -> None:
    from hybridmoe.quant.q4_0 import quantize_q4_0, quantize_q4_0_reference
    from hybridmoe.quant.q8_0 import quantize_q8_0, quantize_q8_0_reference

    pairs = {
        "q8_0": (quantize_q8_0, quantize_q8_0_reference),
        "q4_0": (quantize_q4_0, quantize_q4_0_reference),
    }
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(args.experts, 2 * INTER, HIDDEN, generator=g) * 0.02
    down = torch.randn(args.experts, HIDDEN, INTER, generator=g) * 0.02
    weights = gate_up.numel() + down.numel()
    print(f"{weights / 1e6:.0f} M weights a round; torch threads {torch.get_num_threads()}")
    print("G weights/s of wall time, and per CPU second (all threads: holds on a busy machine)")
    for dtype in (torch.bfloat16, torch.float32):
        tensors = (gate_up.to(dtype), down.to(dtype))
        for name, (fast, reference) in pairs.items():
            fast(tensors[1][:1])  # compile (or load from the cache)
            times: dict[str, list[tuple[float, float]]] = {"numba": [], "torch reference": []}
            for _ in range(args.rounds):
                print(f"  load average {load_average()}", flush=True)
                for label, fn in (("numba", fast), ("torch reference", reference)):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    for t in tensors:
                        fn(t)
                    elapsed = time.perf_counter() - start, time.process_time() - start_cpu
                    times[label].append(elapsed)
            rates = {  # label -> (wall, CPU) G weights/s of the median round
                label: tuple(weights / statistics.median(c) / 1e9 for c in zip(*ts, strict=True))
                for label, ts in times.items()
            }
            (fast_wall, fast_cpu), (ref_wall, ref_cpu) = rates["numba"], rates["torch reference"]
            print(
                f"{name} from {str(dtype).removeprefix('torch.'):8}: numba "
                f"{fast_wall:6.3f} G/s ({fast_cpu:6.3f} G/CPU-s), torch reference "
                f"{ref_wall:6.3f} G/s ({ref_cpu:6.3f} G/CPU-s), ratio "
                f"{fast_wall / ref_wall:5.1f}x wall, {fast_cpu / ref_cpu:5.1f}x CPU",
                flush=True,
            )


def bench_load(args: argparse.Namespace) -> None:
    shape = Qwen3MoeShape(num_hidden_layers=6)
    directory = ensure_checkpoint(shape, args.checkpoint_dir)
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    print(f"checkpoint {directory}: {size / 2**30:.2f} GiB, expert format {args.format}")
    trees = [str(Path(tree).resolve()) for tree in args.load_trees]
    seconds: dict[str, list[float]] = {tree: [] for tree in trees}
    for round_ in range(args.rounds + 1):  # round 0 warms the kernel caches
        print(f"  round {round_} load average {load_average()}", flush=True)
        for tree in trees:
            env = {**os.environ, "PYTHONPATH": tree}
            cmd = [sys.executable, "-c", LOAD_SCRIPT, str(directory), args.format]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            if round_:
                seconds[tree].append(float(out.stdout.split()[-1]))
                print(f"    {tree}: {seconds[tree][-1]:.1f} s", flush=True)
    first = statistics.median(seconds[trees[0]])
    for tree in trees:
        median = statistics.median(seconds[tree])
        print(f"{tree}: median {median:.1f} s ({first / median:.2f}x the first tree's speed)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=8, help="experts quantised per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load-trees", nargs="+", help="source trees to compare load time of")
    parser.add_argument("--format", default="q4_0", help="--expert-format of the load")
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path("~/.cache/hybridmoe/bench-qwen3moe-6layer").expanduser(),
    )
    args = parser.parse_args()
    if args.load_trees:
        bench_load(args)
    else:
        bench_quantisers(args)


if __name__ == "__main__":
    main()
