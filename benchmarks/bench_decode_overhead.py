"""The `cpu` decode target's per-token overhead in load-independent counters, before vs after
the thread/allocation changes of issue 14, side by side in one run.

    python benchmarks/bench_decode_overhead.py --model /tmp/bench-llamacpp/1gb/model-q8_0.gguf \\
        [--threads 2] [--tokens 32] [--dtype bfloat16]
    python benchmarks/bench_decode_overhead.py --quick   # a tiny random checkpoint, a few tokens

On a shared machine wall time says nothing; these counters do not depend on the load. Each
variant runs in its own process (its own numba pool, its own rusage), with the debug switches
of hybridmoe/env.py that restore the old paths ("before") or not ("after", the defaults);
--variants picks others: "passive" / "inline_passive" (OMP_WAIT_POLICY=PASSIVE for the whole
process, the inline CPU executor, the default since stop 25), "worker" (the worker thread).
Per decoded token (counted around each decode step only, steps.decode): the process's CPU time
(user+sys), voluntary and involuntary context switches, minor page faults, the share of CPU
time the busiest thread had and how many threads did work; then, in a second pass with
counting hooks (so not in the timed pass): parallel numba launches, aten ops and Python
function calls (a pass of its own: not under the aten-op counting mode). Also the calling
thread's CPU time split into the dense and expert kernel launches and the rest (the glue
issue 14 wants under 5 % of the step). "base" runs another source tree (--baseline-src: a
code change's before/after); --rounds alternates the variants, the table shows medians.
Both variants must decode the same tokens (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

OLD = {"HYBRIDMOE_SERIAL_TORCH": "0", "HYBRIDMOE_CPU_INLINE": "0"}
VARIANTS = {  # name -> the environment of its process
    "before": OLD,  # the old paths: torch's threads in decode, the worker thread
    "after": {},  # the defaults: torch's ops serial in a CPU decode step, the inline executor
    # every OpenMP pool passive (torch's libgomp, which numba's kernels use too, spins ~3 ms)
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "HYBRIDMOE_CPU_INLINE": "0"},
    "inline_passive": {"OMP_WAIT_POLICY": "PASSIVE", "HYBRIDMOE_CPU_INLINE": "1"},
    "worker": {"HYBRIDMOE_CPU_INLINE": "0"},  # serial torch, the worker thread
    # the attention's parts one call each instead of the attention block's one call
    "parts": {"HYBRIDMOE_ATTENTION_BLOCK": "0"},
}
COUNTERS = (  # key, label, format
    ("cpu_ms", "CPU time ms/token (user+sys)", "{:.2f}"),
    ("csw", "context switches/token", "{:.1f}"),
    ("nivcsw", "  of which involuntary", "{:.1f}"),
    ("minflt", "minor page faults/token", "{:.1f}"),
    ("busiest_share", "busiest thread's share of CPU", "{:.2f}"),
    ("busy_threads", "threads with >5% of CPU", "{:.0f}"),
    ("main_ms", "calling thread CPU ms/token", "{:.2f}"),
    ("dense_ms", "  in dense kernel launches", "{:.2f}"),
    ("moe_ms", "  in expert kernel launches", "{:.2f}"),
    ("rest_ms", "  the rest (glue: torch, Python)", "{:.2f}"),
    ("rest_share", "  the rest's share", "{:.3f}"),
    ("launches", "parallel numba launches/token", "{:.1f}"),
    ("aten_ops", "aten ops/token", "{:.0f}"),
    ("py_calls", "Python calls/token", "{:.0f}"),
    ("wall_ms", "wall ms/token (load-dependent!)", "{:.2f}"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint (a GGUF file or a directory)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens measured")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="tiny random checkpoint, 4 tokens")
    parser.add_argument("--variants", default="before,after", help=f"of {','.join(VARIANTS)}")
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="a source tree (its src/ folder) run as the variant 'base', e.g. an earlier "
        "commit's `git archive` (before/after a code change, side by side)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of variants")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _thread_cpu_ticks() -> dict[int, int]:
    """tid -> utime + stime in clock ticks, for every thread of this process."""
    ticks = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        ticks[int(task.name)] = int(fields[11]) + int(fields[12])
    return ticks


def _snapshot() -> dict:
    import time

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "cpu_ms": (usage.ru_utime + usage.ru_stime) * 1e3,
        "nvcsw": usage.ru_nvcsw,
        "nivcsw": usage.ru_nivcsw,
        "minflt": usage.ru_minflt,
        "wall_ms": time.perf_counter() * 1e3,
        "threads": _thread_cpu_ticks(),
    }


def _add_delta(total: dict, after: dict, before: dict) -> None:
    for key in ("cpu_ms", "nvcsw", "nivcsw", "minflt", "wall_ms"):
        total[key] = total.get(key, 0) + after[key] - before[key]
    ticks = total.setdefault("ticks", {})
    for tid, value in after["threads"].items():
        ticks[tid] = ticks.get(tid, 0) + value - before["threads"].get(tid, 0)


def _generate(engine, tokens: int) -> list[int]:
    from hybridmoe.engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return engine.generate_ids([list(range(5, 21))], params)[0]


@contextmanager
def _around_decode_steps(enter, leave):
    """Calls enter() before and leave(entered) after every decode step (steps.decode, which
    the scheduler looks up at each call), nothing around prefill or sampling setup."""
    from hybridmoe.engine import steps

    real = steps.decode

    def decode(*args, **kwargs):
        entered = enter()
        try:
            return real(*args, **kwargs)
        finally:
            leave(entered)

    steps.decode = decode
    try:
        yield
    finally:
        steps.decode = real


@contextmanager
def _kernel_clock(total: dict):
    """Adds the calling thread's CPU ns inside each dense / expert kernel launch to
    total["dense_ns"] / total["moe_ns"] (thread CPU time: a preempted thread's wait is not
    counted, so at 1 thread it barely depends on the load). The attention block's launches
    (its q/k/v and o projections, norms and attention: kernels/attention_block.py) count as
    dense."""
    import time

    from hybridmoe.kernels import numba_attention_block, numba_dense, numba_moe

    real_launch = numba_moe.launch
    dense = {id(kernel) for kernel in numba_dense.DENSE.values()}

    def timed_launch(kernel, threads, *args):
        start = time.thread_time_ns()
        try:
            return real_launch(kernel, threads, *args)
        finally:
            elapsed = time.thread_time_ns() - start
            made = [*numba_attention_block._BLOCKS.values(), *_dense_q8_entries()]
            is_dense = id(kernel) in dense or any(kernel is entry for entry in made)
            key = "dense_ns" if is_dense else "moe_ns"
            total[key] = total.get(key, 0) + elapsed

    numba_moe.launch = numba_dense.launch = timed_launch
    try:
        yield
    finally:
        numba_moe.launch = numba_dense.launch = real_launch


def _dense_q8_entries() -> list:
    """The q8 dense kernel's entries made so far (dense launches too); none in a source tree
    from before it (--baseline-src)."""
    try:
        from hybridmoe.kernels import numba_dense_q8
    except ImportError:
        return []
    return numba_dense_q8._ENTRIES.values()


def _measured(engine, tokens: int) -> tuple[dict, list[int]]:
    """The counters of the decode steps of one generation, per step (= per token)."""
    import time

    total: dict = {}

    def enter():
        return _snapshot(), time.thread_time_ns()

    def leave(entered):
        _add_delta(total, _snapshot(), entered[0])
        total["main_ns"] = total.get("main_ns", 0) + time.thread_time_ns() - entered[1]

    with _kernel_clock(total), _around_decode_steps(enter, leave):
        ids = _generate(engine, tokens + 1)  # the first token is prefill's
    per = {k: total[k] / tokens for k in ("cpu_ms", "nivcsw", "minflt", "wall_ms")}
    per["csw"] = (total["nvcsw"] + total["nivcsw"]) / tokens
    ticks = total["ticks"]
    all_ticks = max(1, sum(ticks.values()))
    per["busiest_share"] = max(ticks.values()) / all_ticks
    per["busy_threads"] = sum(1 for v in ticks.values() if v > 0.05 * all_ticks)
    for key in ("main", "dense", "moe"):
        per[f"{key}_ms"] = total.get(f"{key}_ns", 0) / 1e6 / tokens
    per["rest_ms"] = per["main_ms"] - per["dense_ms"] - per["moe_ms"]
    per["rest_share"] = per["rest_ms"] / per["main_ms"]
    return per, ids


def _counted(engine, tokens: int) -> dict:
    """Parallel launches, aten ops and Python calls per decode step, by hooks. The aten ops
    and Python calls are the calling thread's only (dispatch modes and sys.setprofile are per
    thread): a worker thread's are not counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybridmoe.kernels import numba_dense, numba_moe

    counts = {"launches": 0, "aten_ops": 0, "py_calls": 0}
    real_launch = numba_moe.launch

    def counting_launch(kernel, threads, *args):
        counts["launches"] += 1
        return real_launch(kernel, threads, *args)

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts["aten_ops"] += 1
            return func(*args, **(kwargs or {}))

    def profile(frame, event, arg):
        if event == "call":
            counts["py_calls"] += 1

    def enter():
        numba_moe.launch = numba_dense.launch = counting_launch
        mode = Counting()
        mode.__enter__()
        return mode

    def leave(mode):
        mode.__exit__(None, None, None)
        numba_moe.launch = numba_dense.launch = real_launch

    with _around_decode_steps(enter, leave):
        _generate(engine, tokens + 1)
    # the Python calls in a pass of their own: under the dispatch mode every aten op is a few
    # Python calls of torch's (the mode's __torch_dispatch__ and what it calls)
    with _around_decode_steps(lambda: sys.setprofile(profile), lambda _: sys.setprofile(None)):
        _generate(engine, tokens + 1)
    return {k: v / tokens for k, v in counts.items()}


def worker(args: argparse.Namespace) -> None:
    from hybridmoe.engine import Engine, EngineConfig
    from hybridmoe.moe.config import OffloadConfig

    offload = OffloadConfig(decode_target="cpu", cpu_threads=args.threads)
    config = EngineConfig(
        dtype=args.dtype, threads=args.threads, prefix_cache_tokens=0, offload=offload
    )
    with Engine.from_pretrained(args.model, config) as engine:
        _generate(engine, 4)  # warm: compiled kernels, pages of the weights
        per, ids = _measured(engine, args.tokens)
        per.update(_counted(engine, min(args.tokens, 8)))
    print(json.dumps({"counters": per, "ids": ids}))


def run_variant(name: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, **VARIANTS.get(name, {})}
    if name == "base":  # the same counters of another source tree (--baseline-src)
        env["PYTHONPATH"] = str(args.baseline_src)
    command = [sys.executable, __file__, "--worker", "--model", str(args.model)]
    command += ["--threads", str(args.threads), "--tokens", str(args.tokens)]
    command += ["--dtype", args.dtype]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"variant {name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict[str, dict]) -> str:
    names = list(results)
    lines = [f"{'counter':34}" + "".join(f"{n:>12}" for n in names) + "   last/first"]
    for key, label, fmt in COUNTERS:
        values = [results[n]["counters"][key] for n in names]
        ratio = values[-1] / values[0] if values[0] else float("nan")
        cells = "".join(f"{fmt.format(v):>12}" for v in values)
        lines.append(f"{label:34}{cells}   {ratio:.2f}")
    return "\n".join(lines)


def _median_round(runs: list[dict]) -> dict:
    """One variant's rounds as one: each counter's median, the first round's tokens."""
    import statistics

    for run in runs[1:]:
        if run["ids"] != runs[0]["ids"]:
            raise SystemExit("one variant decoded different tokens in different rounds")
    keys = runs[0]["counters"]
    counters = {k: statistics.median(r["counters"][k] for r in runs) for k in keys}
    return {"counters": counters, "ids": runs[0]["ids"]}


def _quick_model(root: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llamacpp_checkpoints import ensure_files

    return ensure_files("tiny", root, ("q8_0",))["q8_0"]


def main(argv: list[str] | None = None) -> dict[str, dict]:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            args.tokens = min(args.tokens, 4)
            args.model = args.model or _quick_model(Path(tmp))
        if args.model is None:
            raise SystemExit("--model is required without --quick")
        names = args.variants.split(",")
        if "base" in names and args.baseline_src is None:
            raise SystemExit("the variant 'base' needs --baseline-src")
        unknown = [n for n in names if n not in VARIANTS and n != "base"]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}, base")
        loads, rounds = [], []
        for _ in range(args.rounds):  # alternating: each round runs every variant once
            loads.append(Path("/proc/loadavg").read_text().split()[0])
            rounds.append({name: run_variant(name, args) for name in names})
    print(f"{args.model}, {args.threads} threads, {args.tokens} tokens, {args.dtype}")
    print(f"1-minute load average before each round: {' '.join(loads)} (cores: {os.cpu_count()})")
    results = {name: _median_round([r[name] for r in rounds]) for name in names}
    print(table(results))
    first = next(iter(results.values()))["ids"]
    same = all(r["ids"] == first for r in results.values())
    print("tokens identical across variants:", same)
    if not same:
        raise SystemExit("variants decoded different tokens")
    return results


if __name__ == "__main__":
    main()
