"""Where a load's CPU time goes, to the first token: Engine.from_pretrained + one greedy token
of a 16-token prompt, profiled in this process with a CPU-time clock (cProfile over
time.process_time, all threads), so the shares hold on a busy machine where wall seconds do not.

    python benchmarks/profile_load.py MODEL [--expert-format q4_0] [--runs 2] [--dump out.prof]

Run it once first (or pass --runs 2: the first run is discarded) so numba's kernels come from
its cache, as they do for a user's second load. Prints the load average, the CPU seconds of the
load (getrusage), its wall seconds, and each phase's share of the profiled CPU time. The phases
nest as listed (an indented one is part of the one above it); "numba: kernels from the cache"
cuts across them (each kernel's first call).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path

# (label, indent, (file suffix, function name)) of the phases, by cumulative CPU time
PHASES = [
    ("load_checkpoint (model + tokenizer)", 0, ("models/loading.py", "load_checkpoint")),
    ("GGUF metadata (gguf_read)", 1, ("loader/gguf_read.py", "read_gguf")),
    ("tokenizer from the GGUF", 1, ("loader/gguf_tokenizer.py", "gguf_tokenizer")),
    ("tokenizer.json", 1, ("loader/tokenizer.py", "from_dir")),
    ("dense weights (safetensors)", 1, ("loader/weights.py", "get")),
    ("dense weights (GGUF)", 1, ("loader/gguf_weights.py", "get")),
    ("Engine.__init__", 0, ("engine/engine.py", "__init__")),
    ("experts stacked / quantised", 1, ("engine/moe_runtime.py", "_expert_stores")),
    ("CPU expert kernel set up", 1, ("moe/cpu_experts.py", "create_cpu_expert_fn")),
    ("CPU expert kernels' first calls", 1, ("moe/cpu_executor.py", "_compile_kernels")),
    ("KV cache allocated", 1, ("engine/kv_cache.py", "__init__")),
    ("first token (16-token prefill)", 0, ("engine/engine.py", "generate_ids")),
    ("attention projections", 1, ("layers/attention.py", "_project")),
    ("routed experts", 1, ("moe/backends.py", "prefill")),
    ("numba: kernels from the cache", 0, ("numba/core/caching.py", "load_overload")),
    ("numba: compiling (cold cache)", 0, ("numba/core/dispatcher.py", "_compile_core")),
    ("numba: thread pool start", 0, ("kernels/numba_moe.py", "start_pool")),
]
PROMPT = [100 + i for i in range(16)]


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def profile_once(args: argparse.Namespace) -> None:
    import torch  # noqa: F401  (imported before the clock, as bench_vs_llamacpp's worker does)

    start_cpu, start_wall = cpu_s(), time.perf_counter()
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    from hybridmoe.engine import Engine, EngineConfig, SamplingParams
    from hybridmoe.moe.config import OffloadConfig

    import_cpu = cpu_s() - start_cpu

    offload = OffloadConfig(decode_target="cpu", expert_format=args.expert_format)
    config = EngineConfig(dtype="bfloat16", prefix_cache_tokens=0, offload=offload)
    engine = Engine.from_pretrained(args.model, config)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate_ids([PROMPT], params)
    profiler.disable()
    total_cpu, wall_s = cpu_s() - start_cpu, time.perf_counter() - start_wall
    faults = resource.getrusage(resource.RUSAGE_SELF)
    print(
        f"load average {load_average()}; load to the first token {total_cpu:.2f} CPU s, "
        f"{wall_s:.2f} wall s (profiled: slower than a plain run)"
    )
    print(f"  page faults: {faults.ru_minflt} minor, {faults.ru_majflt} major")
    if args.dump:
        profiler.dump_stats(args.dump)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    profiled = sum(tt for _, _, tt, _, _ in stats.values())
    for label, indent, (suffix, name) in PHASES:
        seconds = sum(
            ct
            for (file, _, func), (_, _, _, ct, _) in stats.items()
            if file.endswith(suffix) and func == name
        )
        if seconds:
            print(f"  {'  ' * indent}{label:<40} {100 * seconds / profiled:5.1f} %")
    print(f"  import hybridmoe.engine: {import_cpu:.2f} CPU s (in the profile, in no phase)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF file or a Hugging Face checkpoint directory")
    parser.add_argument("--expert-format", default=None)
    parser.add_argument(
        "--runs", type=int, default=1, help="fresh processes; all but the last warm"
    )
    parser.add_argument("--dump", default=None, help="write the last run's cProfile stats here")
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        profile_once(args)
        return
    command = [sys.executable, __file__, args.model, "--once"]
    command += ["--expert-format", args.expert_format] if args.expert_format else []
    for run in range(args.runs):
        last = run == args.runs - 1
        extra = ["--dump", args.dump] if last and args.dump else []
        done = subprocess.run(command + extra, capture_output=not last, text=True)
        if done.returncode:
            raise SystemExit(done.stderr or f"run {run} failed")


if __name__ == "__main__":
    main()
