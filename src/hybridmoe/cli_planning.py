"""The planning commands: `hybridmoe trace` (record routing), `plan` (predict decode tok/s from a
config) and `bench-hw` (measure the hardware profile `plan` reads).

cli.py owns the parser of `trace` (it takes every engine and sampling flag `generate` takes)
and registers the parsers of `plan` and `bench-hw` from here (`add_parsers`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from hybridmoe.demo import require_demo_checkpoint
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.planning import bench_hw
from hybridmoe.planning.cost_model import CallMix, CostModel, ModelShape
from hybridmoe.planning.hardware import HardwareProfile, default_profile
from hybridmoe.planning.planner import format_table, plan
from hybridmoe.planning.plot import plot_plan, require_pyplot
from hybridmoe.planning.trace import RoutingTrace, record_routes
from hybridmoe.platform.base import create_platform
from hybridmoe.quant.formats import WEIGHT_FORMATS, weight_format


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line of a UTF-8 text file (blank lines skipped); ValueError naming the
    file when it holds none."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompt (one per line) in the file")
    return prompts


def record_trace(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, meta: dict | None = None
) -> tuple[RoutingTrace, list[list[int]]]:
    """The routing trace of decoding `prompts` (token ids) with `params`, one prompt after
    another, and the tokens generated (the same as without recording)."""
    cfg = engine.model.cfg
    with record_routes(engine.model.moe_layers, cfg.num_experts) as recorder:
        tokens = engine.generate_ids(prompts, params)
    target = engine.config.offload.decode_target
    info = {"decode_target": target, "top_k": cfg.top_k, "prompts": len(prompts)}
    return recorder.trace({**info, **(meta or {})}), tokens


def run_trace(engine: Engine, args: argparse.Namespace, params: SamplingParams) -> None:
    prompts = [engine.encode(text) for text in read_prompts(args.prompts)]
    meta = {"model": Path(engine_model_name(args)).name}
    trace, tokens = record_trace(engine, prompts, params, meta)
    trace.save(args.output)
    decoded = sum(len(t) for t in tokens)
    print(
        f"{args.output}: {trace.num_rows} decode steps x {trace.num_layers} MoE layers x "
        f"top-{trace.top_k} of {trace.num_experts} experts ({decoded} tokens generated)",
        file=sys.stderr,
    )


def engine_model_name(args: argparse.Namespace) -> str:
    return args.model or "demo"


# --- bench-hw ------------------------------------------------------------------------------


def measure_profile(
    device: str, formats: list[str], threads: int | None, repeats: int
) -> HardwareProfile:
    """Every figure of a HardwareProfile on this machine, the orchestration last (it runs the
    demo model on each decode target). `threads` sets the CPU kernel's and torch's threads."""
    from hybridmoe.kernels.numba_moe import max_threads  # numba: only when measuring

    if threads:
        torch.set_num_threads(threads)
    platform = create_platform(device)
    try:
        # through tqdm: a first run's compile counter (run_bench_hw) is redrawn below the line
        step = lambda what: tqdm.write(f"bench-hw: {what}", file=sys.stderr)  # noqa: E731
        step("DRAM read bandwidth")
        dram = bench_hw.dram_read_gbps()
        step(f"CPU expert kernel x {', '.join(formats)}")
        cpu = {f: bench_hw.cpu_expert_time(f, threads, repeats) for f in formats}
        step(f"accelerator tier ({platform.device}) expert math, dense reads, copies")
        accel = {f: bench_hw.accel_expert_time(f, platform, repeats) for f in formats}
        profile = HardwareProfile(
            device=platform.device.type,
            dram_read_gbps=dram,
            cpu_threads=threads or max_threads(),
            cpu_expert=cpu,
            cpu_job_s=bench_hw.cpu_job_s(),
            accel_expert=accel,
            dense_gbps={
                str(dt).removeprefix("torch."): bench_hw.dense_gbps(platform, dt)
                for dt in (torch.float32, torch.bfloat16)
            },
            h2d_gbps=bench_hw.h2d_gbps(platform),
        )
    finally:
        platform.close()
    step("orchestration: the demo model's decode on every target")
    return calibrate_orchestration(profile, device, threads)


CALIBRATION_TARGETS = {
    "resident": OffloadConfig(decode_target="resident"),
    "offload": OffloadConfig(decode_target="offload", expert_cache_ratio=0.5),
    "cpu": OffloadConfig(decode_target="cpu"),
    "hybrid": OffloadConfig(decode_target="hybrid", expert_cache_ratio=0.25, max_fetch=1),
}


def measured_decode(
    directory: Path,
    offload: OffloadConfig,
    device: str,
    dtype: str = "float32",
    tokens: int = 32,
    threads: int | None = None,
    runs: int = 3,
) -> tuple[float, CallMix]:
    """(seconds per decoded token, CallMix of the mean call) of greedy decode, the fastest of
    `runs` runs, with `threads` torch and CPU-kernel threads (None: their defaults)."""
    offload = dataclasses.replace(offload, cpu_threads=threads)
    config = EngineConfig(dtype=dtype, device=device, max_batch=1, offload=offload, threads=threads)
    prompt, params = [list(range(100, 116))], SamplingParams(max_tokens=tokens, ignore_eos=True)
    with Engine.from_pretrained(directory, config) as engine:
        engine.generate_ids(prompt, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        seconds = []
        for _ in range(runs):
            engine.generate_ids(prompt, params)
            seconds.append(engine.stats.decode_s / engine.stats.decode_tokens)
        stats, moe_layers, top_k = (
            engine.stats,
            len(engine.model.moe_layers),
            engine.model.cfg.top_k,
        )
    calls = stats.decode_tokens * moe_layers
    e = stats.experts
    if e is None:  # resident: every route a hit
        mix = CallMix(((1.0, top_k, 0, 0),))
    else:
        mix = CallMix(((1.0, e.hits / calls, e.fetched / calls, e.cpu_routes / calls),))
    return min(seconds), mix


def calibrate_orchestration(
    profile: HardwareProfile, device: str, threads: int | None
) -> HardwareProfile:
    """layer_overhead_s: per layer ("per_layer", from `resident`) and per MoE layer call of
    each target, the measured decode time of the demo model beyond the modelled compute."""
    directory = require_demo_checkpoint()
    shape = ModelShape.from_config(directory)
    bare = dataclasses.replace(profile, layer_overhead_s={})  # compute only: fit the rest
    model = CostModel(shape, bare, "f32")
    residual = {}
    for target, offload in CALIBRATION_TARGETS.items():
        seconds, mix = measured_decode(directory, offload, device, threads=threads)
        residual[target] = seconds - model.step(target, mix).seconds
    per_layer = residual["resident"] / shape.num_layers
    overhead = {"per_layer": per_layer}
    for target, r in residual.items():
        overhead[target] = (r - per_layer * shape.num_layers) / shape.moe_layers
    notes = "orchestration fitted on the demo model's decode (f32, batch 1)"
    return dataclasses.replace(profile, layer_overhead_s=overhead, notes=notes)


def run_bench_hw(args: argparse.Namespace) -> None:
    formats = args.formats.split(",")
    for name in formats:
        weight_format(name)  # ValueError naming the choices
    from hybridmoe.kernels.compile_progress import compile_progress  # numba: when measuring

    with compile_progress():  # a first run compiles the kernels it times (after warm-ups)
        profile = measure_profile(args.device, formats, args.threads, args.repeats)
    profile.save(args.output)
    print(
        f"{args.output}: DRAM {profile.dram_read_gbps:.1f} GB/s, copies "
        f"{profile.h2d_gbps:.1f} GB/s, CPU job {profile.cpu_job_s * 1e6:.0f} us"
    )


# --- plan ----------------------------------------------------------------------------------


def run_plan(args: argparse.Namespace) -> None:
    if args.plot:
        require_pyplot()  # before any work: a missing extra is a clear error at once
    shape = ModelShape.from_config(args.model)
    hw = HardwareProfile.load(args.hw) if args.hw else default_profile()
    fmt = args.expert_format or shape.stored_format or "bf16"  # a GGUF's own, where it has one
    if fmt not in hw.cpu_expert:
        raise ValueError(f"--hw profile has no timings for format {fmt!r}; run bench-hw with it")
    model = CostModel(shape, hw, fmt, "float32" if fmt == "f32" else "bfloat16")
    trace = RoutingTrace.load(args.trace) if args.trace else None
    rows = plan(model, args.gpu_memory, trace)
    source = f"trace {args.trace}" if trace is not None else "uniform routing (no --trace)"
    print(
        f"{shape.name}: {shape.moe_layers} MoE layers x {shape.num_experts} experts, top-"
        f"{shape.top_k}, {shape.expert_nbytes(fmt) / 2**20:.2f} MiB per {fmt} expert; "
        f"hardware: {args.hw or 'built-in defaults'} ({hw.device}); hit rates from {source}"
    )
    print(format_table(rows, model, args.expert_format))
    best = max(rows, key=lambda row: row.cost.tok_per_s)
    print(
        f"recommended: {best.flags(args.expert_format)}  ({best.cost.tok_per_s:.2f} tok/s "
        f"predicted, bound by {best.cost.bottleneck})"
    )
    if args.plot:
        plot_plan(rows, model, args.plot, source)
        print(f"plot: {args.plot}", file=sys.stderr)


def add_parsers(commands: argparse._SubParsersAction) -> None:
    """The parsers of `plan` and `bench-hw` (COMMANDS runs them)."""
    bench = commands.add_parser("bench-hw", help="measure this machine's hardware profile")
    bench.add_argument("-o", "--output", required=True, help="the JSON profile to write")
    bench.add_argument("--device", default="auto", help="the accelerator tier (auto, cpu, cuda)")
    bench.add_argument("--formats", default=",".join(WEIGHT_FORMATS), help="comma-separated")
    bench.add_argument("--threads", type=int, default=None, help="CPU kernel and torch threads")
    bench.add_argument("--repeats", type=int, default=10, help="timings per figure (best kept)")
    plan_cmd = commands.add_parser("plan", help="predict decode tok/s per target and cache size")
    plan_cmd.add_argument(
        "--model", required=True, help="checkpoint dir, its config.json, or a GGUF file"
    )
    plan_cmd.add_argument("--gpu-memory", type=float, default=None, help="GiB for the model")
    plan_cmd.add_argument("--trace", default=None, help="a routing trace of this model (.npz)")
    plan_cmd.add_argument("--hw", default=None, help="a profile from bench-hw (JSON)")
    plan_cmd.add_argument("--expert-format", default=None, choices=tuple(WEIGHT_FORMATS))
    plan_cmd.add_argument("--plot", default=None, help="write tok/s and hit rate plots (PNG)")


COMMANDS = {"bench-hw": run_bench_hw, "plan": run_plan}
