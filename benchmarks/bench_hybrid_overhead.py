"""HybridDecodeExecutor's own orchestration cost per MoE layer call at decode (T=1), on the CPU.

    python benchmarks/bench_hybrid_overhead.py [--layers 48] [--experts 128] [--top-k 8]
        [--steps 200] [--slots-ratio 0.25] [--max-fetch 1] [--threads 1] [--profile]
    # one realistic layer (1.2 GB of bf16 experts):
    python benchmarks/bench_hybrid_overhead.py --layers 1 --hidden 2048 --inter 768 \
        --dtype bfloat16 --steps 300

Everything is real except the expert math: ExpertBanks, an OffloadMoeCache (global LRU,
capped fetch) and a CpuMoeExecutor with its worker thread. Routing replays a seeded, skewed
(Zipf) and sticky trace, so hits, fetches and CPU routes all occur. Every layer call times
`executor.decode(request, gpu_runner)`; the request is built outside the timed region.

What "orchestration" means here:
  noop math  both sides return preallocated zeros [T, H], so total == orchestration (cache
             policy, route split, the hand-off to the worker and back, copy_missing, stats).
  real math  bank_moe on both sides. Overlap on: total - max(accelerator math, CPU math), the
             cost outside the longer side's math. Overlap off: total - (accelerator + CPU).
             Under overlap both sides' math is timed in wall time while the other thread
             contends for the GIL and the cores, so each may be inflated and the estimate is
             a lower bound; the noop figure is the one to hold against the target.
A second, instrumented pass wraps each phase in perf_counter_ns (its own cost is printed) and
splits the per-call time into phases; `--profile` adds a cProfile of the main thread.

The figures depend on the machine as much as on the code: every call hands a job to the worker
thread and back, so the line "this machine" prints the floors measured in the same run (one
small torch op, one bare SimpleQueue + Event round trip, and one round trip polled as
CpuMoeExecutor's hand-off polls). On a VM whose idle vCPUs halt, the blocking round trip alone
can cost 10x what it costs on busy or bare-metal cores. --spin-us 0 turns the executor's
polling off.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import queue
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from hybridmoe.kernels.spin_wait import SPIN_SUPPORTED, spin_until, store_then_spin
from hybridmoe.moe import hybrid_decode
from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.cpu_experts import bank_moe
from hybridmoe.moe.handoff import SpinHandoff
from hybridmoe.moe.hybrid_decode import HybridDecodeExecutor, HybridDecodeRequest
from hybridmoe.moe.offload_cache import OffloadMoeCache
from hybridmoe.quant.bank import ExpertBank

TARGET_US = 50.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PHASES = (
    "cache policy (ensure_experts_hybrid)",
    "split_routes",
    "submit hand-off (decode_submit)",
    "copy_missing",
    "accelerator math (gpu_runner)",
    "sync: blocked on worker",
    "sync: wake-up + bookkeeping",
    "inline in decode (clone, masks, stats, add)",
)


@dataclass(frozen=True)
class Trace:
    ids: torch.Tensor  # [S, L, T, K] int64 expert ids
    weights: torch.Tensor  # [S, L, T, K] router weights
    hidden: torch.Tensor  # [L, T, H] one fixed input per layer


def make_banks(args: argparse.Namespace) -> list[ExpertBank]:
    g = torch.Generator().manual_seed(args.seed)
    dtype, e, h, i = DTYPES[args.dtype], args.experts, args.hidden, args.inter

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    layers = tqdm(range(args.layers), desc="banks", unit="layer", leave=False)
    return [ExpertBank(gate_up=rand(e, 2 * i, h), down=rand(e, h, i)) for _ in layers]


def sticky_trace(args: argparse.Namespace, steps: int) -> Trace:
    """Per layer a Zipf popularity over a shuffled expert order; each step keeps each of the
    token's previous experts with probability `stickiness` and draws the rest from it."""
    g = torch.Generator().manual_seed(args.seed + 1)
    shape = (steps, args.layers, args.tokens, args.top_k)
    ids = torch.empty(shape, dtype=torch.int64)
    ranks = torch.arange(1, args.experts + 1, dtype=torch.float64)
    for layer in tqdm(range(args.layers), desc="routing trace", unit="layer", leave=False):
        popularity = (ranks**-args.skew)[torch.randperm(args.experts, generator=g)]  # [E]
        for t in range(args.tokens):
            prev: list[int] = []
            for s in range(steps):
                prev = _next_experts(prev, popularity, args, g)
                ids[s, layer, t] = torch.tensor(prev)
    logits = torch.randn(shape, generator=g)
    weights = torch.softmax(logits, dim=-1).to(DTYPES[args.dtype])  # [S, L, T, K]
    hidden = torch.randn(args.layers, args.tokens, args.hidden, generator=g).to(DTYPES[args.dtype])
    return Trace(ids, weights, hidden)


def _next_experts(
    prev: list[int], popularity: torch.Tensor, args: argparse.Namespace, g: torch.Generator
) -> list[int]:
    keep = torch.rand(len(prev), generator=g) < args.stickiness
    kept = [e for e, k in zip(prev, keep.tolist(), strict=True) if k]
    if len(kept) == args.top_k:
        return kept
    probs = popularity.clone()
    probs[kept] = 0.0
    drawn = torch.multinomial(probs, args.top_k - len(kept), replacement=False, generator=g)
    return kept + drawn.tolist()


@dataclass
class CallClock:
    """The current call's ns per phase, filled by the wrappers of `instrument` and the timed
    math; the worker thread stamps its kernel's start and end."""

    current: dict[str, int] = field(default_factory=dict)
    worker_start_ns: int = 0
    worker_end_ns: int = 0

    def wrap(self, name: str, fn: Callable) -> Callable:
        current = self.current

        def timed(*args: object) -> object:
            start = time.perf_counter_ns()
            try:
                return fn(*args)
            finally:
                current[name] = current.get(name, 0) + time.perf_counter_ns() - start

        return timed


def timed_gpu_runner(clock: CallClock, bank: ExpertBank, zeros: torch.Tensor, real: bool):
    """The accelerator side, as HybridExperts.run_on_slots (moe/backends.py), timed per call."""

    def run(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter_ns()
        out = bank_moe(x, slots, weights, bank) if real else zeros  # [T, H]
        clock.current["gpu_math"] = time.perf_counter_ns() - start
        return out

    return run


def timed_cpu_fn(clock: CallClock, zeros: torch.Tensor, real: bool):
    """The CPU expert kernel; runs on the worker thread, which stamps its start and end."""

    def run(x, ids, weights, bank):
        clock.worker_start_ns = time.perf_counter_ns()
        out = bank_moe(x, ids, weights, bank) if real else zeros  # [T, H]
        clock.worker_end_ns = time.perf_counter_ns()
        return out

    return run


def instrument(hybrid: HybridDecodeExecutor, clock: CallClock) -> Callable[[], None]:
    """Wrap each phase the executor calls (instance attributes, and the module-level
    split_routes that decode() looks up); returns the undo for split_routes."""
    cache, cpu = hybrid.cache, hybrid.cpu_executor
    cache.ensure_experts_hybrid = clock.wrap(PHASES[0], cache.ensure_experts_hybrid)
    original_split = hybrid_decode.split_routes
    hybrid_decode.split_routes = clock.wrap(PHASES[1], original_split)
    cache.copy_missing = clock.wrap(PHASES[3], cache.copy_missing)
    cpu.decode_submit = _stamped(clock, "submit", cpu.decode_submit)
    cpu.decode_sync = _stamped(clock, "sync", cpu.decode_sync)

    def undo() -> None:
        hybrid_decode.split_routes = original_split

    return undo


def _stamped(clock: CallClock, name: str, fn: Callable) -> Callable:
    """Records the entry and exit ns of `fn` as `<name>_entry` / `<name>_exit`."""

    def stamped(*args: object) -> object:
        clock.current[f"{name}_entry"] = time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            clock.current[f"{name}_exit"] = time.perf_counter_ns()

    return stamped


@dataclass
class Pass:
    overlap: bool
    real: bool
    instrumented: bool = False
    totals_ns: list[int] = field(default_factory=list)
    gpu_ns: list[int] = field(default_factory=list)  # accelerator math per call
    cpu_ns: list[int] = field(default_factory=list)  # CPU expert math per call (worker)
    phases_ns: dict[str, list[int]] = field(default_factory=dict)
    cache_mix: dict[str, float] = field(default_factory=dict)
    busy_s: float = 0.0  # CpuMoeExecutor's own stats[layer].busy_s, summed over layers

    @property
    def name(self) -> str:
        overlap, math = ("on " if self.overlap else "off"), ("real" if self.real else "noop")
        return f"overlap {overlap} | {math} math"

    def orchestration_ns(self) -> list[int]:
        """noop: total; real: total - max(gpu, cpu) with overlap, total - (gpu + cpu) without."""
        rows = zip(self.totals_ns, self.gpu_ns, self.cpu_ns, strict=True)
        if not self.real:
            return list(self.totals_ns)
        if self.overlap:
            return [t - max(g, c) for t, g, c in rows]
        return [t - g - c for t, g, c in rows]


def run_pass(
    args: argparse.Namespace,
    banks: list[ExpertBank],
    trace: Trace,
    result: Pass,
    profiler: cProfile.Profile | None = None,
) -> Pass:
    clock = CallClock()
    zeros = torch.zeros(args.tokens, args.hidden, dtype=DTYPES[args.dtype])  # [T, H]
    num_slots = max(1, round(args.slots_ratio * args.layers * args.experts))
    cache = OffloadMoeCache(banks, num_slots, args.max_fetch)
    cpu_fn = timed_cpu_fn(clock, zeros, result.real)
    cpu = CpuMoeExecutor(banks, threads=args.workers, expert_fn=cpu_fn, spin_us=args.spin_us)
    hybrid = HybridDecodeExecutor(cache, cpu, result.overlap)
    gpu_runner = timed_gpu_runner(clock, cache.slot_bank, zeros, result.real)
    undo = instrument(hybrid, clock) if result.instrumented else (lambda: None)
    try:
        _replay(args, trace, hybrid, gpu_runner, clock, result, profiler)
    finally:
        undo()
        cpu.close()
    calls = args.steps * args.layers
    stats = cache.total_stats()
    result.cache_mix = {
        "hit routes": stats.hits / calls,
        "fetched routes": stats.fetched_routes / calls,
        "CPU routes": stats.cpu_routes / calls,
        "experts fetched": stats.fetched / calls,
    }
    result.busy_s = sum(s.busy_s for s in cpu.stats.values())
    return result


def _replay(
    args: argparse.Namespace,
    trace: Trace,
    hybrid: HybridDecodeExecutor,
    gpu_runner: Callable,
    clock: CallClock,
    result: Pass,
    profiler: cProfile.Profile | None,
) -> None:
    desc = result.name + (" | phases" if result.instrumented else "")
    for step in tqdm(range(args.warmup + args.steps), desc=desc, unit="step", leave=False):
        if step == args.warmup:  # statistics cover the timed steps only
            hybrid.cache.reset_stats()
            hybrid.cpu_executor.stats.clear()
            if profiler is not None:
                profiler.enable()
        for layer in range(args.layers):
            ids = trace.ids[step, layer].clone()  # [T, K]; decode rewrites it in place
            weights = trace.weights[step, layer]  # [T, K]
            request = HybridDecodeRequest(layer, trace.hidden[layer], ids, weights)
            start = time.perf_counter_ns()
            hybrid.decode(request, gpu_runner)
            total_ns = time.perf_counter_ns() - start
            if step >= args.warmup:
                _record_call(result, clock, total_ns)
            clock.current.clear()
    if profiler is not None:
        profiler.disable()


def _record_call(result: Pass, clock: CallClock, total_ns: int) -> None:
    cur = clock.current
    gpu_ns = cur.pop("gpu_math", 0)
    result.totals_ns.append(total_ns)
    result.gpu_ns.append(gpu_ns)
    result.cpu_ns.append(clock.worker_end_ns - clock.worker_start_ns)
    if not result.instrumented:
        return
    submit_entry, submit_exit = cur.pop("submit_entry"), cur.pop("submit_exit")
    sync_entry, sync_exit = cur.pop("sync_entry"), cur.pop("sync_exit")
    blocked = max(0, clock.worker_end_ns - sync_entry)  # the worker had not finished yet
    phases = cur | {
        PHASES[2]: submit_exit - submit_entry,
        PHASES[4]: gpu_ns,
        PHASES[5]: blocked,
        PHASES[6]: sync_exit - sync_entry - blocked,
    }
    phases[PHASES[7]] = total_ns - sum(phases.values())
    # not a phase of the caller: how long after decode_submit returned the worker's math began
    phases["(worker) start after submit returned"] = clock.worker_start_ns - submit_exit
    # and from the end of the worker's math to decode_sync returning (blocked case only)
    if blocked:
        phases["(worker) math end -> sync returned"] = sync_exit - clock.worker_end_ns
    for name, ns in phases.items():
        result.phases_ns.setdefault(name, []).append(ns)


def calibrate(repeats: int = 2000) -> dict[str, float]:
    """Floors of this machine, median µs: one small torch op, and one bare hand-off to a worker
    thread and back (SimpleQueue.put + Event), the primitive CpuMoeExecutor is built on."""
    ids = torch.zeros(1, 8, dtype=torch.int64)  # [T, K]
    jobs: queue.SimpleQueue[threading.Event | None] = queue.SimpleQueue()

    def echo() -> None:
        while (done := jobs.get()) is not None:
            done.set()

    worker = threading.Thread(target=echo, daemon=True)
    worker.start()

    def round_trip() -> None:
        done = threading.Event()
        jobs.put(done)
        done.wait(10.0)

    floors = {"small torch op (clone)": _median_us(ids.clone, repeats)}
    floors["worker round trip"] = _median_us(round_trip, repeats)
    jobs.put(None)
    worker.join()
    if SPIN_SUPPORTED:
        floors["polled round trip"] = _polled_round_trip_us(repeats)
    return floors


def _polled_round_trip_us(repeats: int) -> float:
    """The same round trip with both threads polling a word (kernels/spin_wait.py, the GIL
    released while they poll), as SpinHandoff does: the floor of the polled hand-off."""
    words = np.zeros(2, dtype=np.int64)  # [0]: requests sent, [1]: answered
    limit_ns = 10**9

    sent_at, answered_at = words.ctypes.data, words.ctypes.data + 8

    def echo() -> None:
        spin_until(sent_at, 1, limit_ns)
        for seq in range(1, repeats + 1):  # answer seq, then poll for the next
            store_then_spin(answered_at, seq, sent_at, seq + 1, 0 if seq == repeats else limit_ns)

    worker = threading.Thread(target=echo, daemon=True)
    worker.start()
    times_ns = []
    for seq in range(1, repeats + 1):
        start = time.perf_counter_ns()
        store_then_spin(sent_at, seq, answered_at, seq, limit_ns)
        times_ns.append(time.perf_counter_ns() - start)
    worker.join()
    return statistics.median(times_ns) / 1000.0


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    times_ns = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        times_ns.append(time.perf_counter_ns() - start)
    return statistics.median(times_ns) / 1000.0


# -- report -------------------------------------------------------------------------------


def _us(ns: float) -> float:
    return ns / 1000.0


def _p(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_setup(args: argparse.Namespace) -> None:
    slots = max(1, round(args.slots_ratio * args.layers * args.experts))
    itemsize = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    expert_kib = 3 * args.hidden * args.inter * itemsize / 1024  # gate, up, down
    floors = ", ".join(f"{name} {us:.1f} µs" for name, us in calibrate().items())
    print(
        f"\nsetup: {args.layers} MoE layers x E={args.experts}, top-k {args.top_k}, "
        f"T={args.tokens}, H={args.hidden}, I={args.inter}, {args.dtype} "
        f"({expert_kib:.0f} KiB per expert)\n"
        f"       cache {slots} slots ({args.slots_ratio:.0%} of all experts), max_fetch "
        f"{args.max_fetch}; CpuMoeExecutor workers {args.workers}, hand-off polling "
        f"{_spin_us(args)} µs; torch threads {torch.get_num_threads()}\n"
        f"       trace: Zipf skew {args.skew}, stickiness {args.stickiness}, seed {args.seed}; "
        f"{args.warmup} warm-up + {args.steps} timed steps = {args.steps * args.layers} timed "
        f"calls per pass\n"
        f"       this machine, median: {floors}"
    )


def _spin_us(args: argparse.Namespace) -> float:
    """The hand-off's polling time the executors get (what --spin-us resolves to)."""
    return SpinHandoff(1, args.spin_us).spin_us


def _med_p90(values: list[int]) -> str:
    return f"{_us(statistics.median(values)):>7.1f} {_us(_p(values, 0.9)):>7.1f}"


def print_summary(passes: list[Pass]) -> None:
    print(f"\nper layer call, µs: median p90 (target: orchestration <= {TARGET_US:.0f} µs)")
    print(
        f"{'pass':<24} {'total':>15} | {'accel math':>15} | {'cpu math':>15} | "
        f"{'orchestration':>15} | x target"
    )
    for p in passes:
        orch = p.orchestration_ns()
        ratio = _us(statistics.median(orch)) / TARGET_US
        print(
            f"{p.name:<24} {_med_p90(p.totals_ns)} | {_med_p90(p.gpu_ns)} | "
            f"{_med_p90(p.cpu_ns)} | {_med_p90(orch)} | {ratio:>6.2f}x"
        )
    print("  orchestration: noop = total; real, overlap on = total - max(accel, cpu);")
    print("  real, overlap off = total - (accel + cpu). cpu math = worker wall time in the kernel")
    for p in passes:
        timed_s = sum(p.cpu_ns) / 1e9
        print(f"  {p.name}: CpuMoeExecutor busy_s {p.busy_s:.4f} s, timed kernel {timed_s:.4f} s")
    mix = passes[0].cache_mix
    print("  per call: " + ", ".join(f"{k} {v:.2f}" for k, v in mix.items()))


def print_phases(p: Pass, plain: Pass) -> None:
    total = statistics.fmean(p.totals_ns)
    print(
        f"\nphases, {p.name} (instrumented: mean total {_us(total):.1f} µs, plain "
        f"{_us(statistics.fmean(plain.totals_ns)):.1f} µs; the gap is the wrappers' own cost "
        f"plus run-to-run noise)"
    )
    print(f"{'phase':<40} {'mean':>7} {'median':>7} {'p90':>7} {'share':>6}")
    for name, values in p.phases_ns.items():
        mean = statistics.fmean(values)
        share = f"{mean / total:>6.0%}" if name in PHASES else ""
        print(
            f"{name:<40} {_us(mean):>7.1f} {_us(statistics.median(values)):>7.1f}"
            f" {_us(_p(values, 0.9)):>7.1f} {share}"
        )
    # On an accelerator copy_missing is an async host -> device DMA; here it is a host memcpy.
    rest = [t - c for t, c in zip(p.totals_ns, p.phases_ns[PHASES[3]], strict=True)]
    label = "total without copy_missing"
    print(f"{label:<40} {_us(statistics.fmean(rest)):>7.1f} {_med_p90(rest)}")


def print_profile(profiler: cProfile.Profile, calls: int, top: int) -> None:
    print("\ncProfile of the main thread, noop math, overlap on; tottime per layer call (µs):")
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in rows:
        where = f"{file.rsplit('/', 2)[-1]}:{line}({func})" if line else func
        print(
            f"  {tottime / calls * 1e6:>6.1f} self {cumtime / calls * 1e6:>7.1f} cum "
            f"{ncalls / calls:>5.1f} calls  {where}"
        )


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48, help="MoE layers")
    parser.add_argument("--experts", type=int, default=128, help="routed experts per layer")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1, help="T per decode call")
    parser.add_argument("--hidden", type=int, default=64, help="H")
    parser.add_argument("--inter", type=int, default=32, help="I (moe_intermediate_size)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per pass")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps before timing")
    parser.add_argument("--slots-ratio", type=float, default=0.25, help="cache share of experts")
    parser.add_argument("--max-fetch", type=int, default=1, help="fetches per layer call")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--workers", type=int, default=1, help="CpuMoeExecutor threads")
    parser.add_argument(
        "--spin-us",
        type=float,
        default=None,
        help="how long the hand-off polls before it blocks (default: CpuMoeExecutor's; 0: never)",
    )
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of popularity")
    parser.add_argument("--stickiness", type=float, default=0.6, help="P(keep an expert)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--math", choices=["both", "noop", "real"], default="both")
    parser.add_argument("--no-phases", action="store_true", help="skip the instrumented passes")
    parser.add_argument("--profile", action="store_true", help="cProfile the noop overlap pass")
    parser.add_argument("--profile-top", type=int, default=25)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Pass]:
    """The run; returns its passes (the instrumented ones after the plain)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    banks = make_banks(args)
    trace = sticky_trace(args, args.warmup + args.steps)
    print_setup(args)
    reals = {"both": (False, True), "noop": (False,), "real": (True,)}[args.math]
    passes = [Pass(overlap, real) for real in reals for overlap in (True, False)]
    for p in passes:
        run_pass(args, banks, trace, p)
    print_summary(passes)
    instrumented = []
    if not args.no_phases:
        for plain in passes:
            instrumented.append(run_pass(args, banks, trace, Pass(plain.overlap, plain.real, True)))
            print_phases(instrumented[-1], plain)
    if args.profile:
        profiler = cProfile.Profile()
        run_pass(args, banks, trace, Pass(True, False), profiler)
        print_profile(profiler, args.steps * args.layers, args.profile_top)
    return passes + instrumented


if __name__ == "__main__":
    main()
