"""A decode step's dense projections on the CPU: the numba kernel (kernels/numba_dense.py)
against torch's F.linear and the DRAM read rate, measured side by side in one run.

    python benchmarks/bench_dense.py [--models small qwen3-30b-a3b] [--formats bf16 f32 q8_0 q4_0]
        [--threads 1 2] [--tokens 1 4] [--reps 3] [--projections q_proj ... lm_head]
        [--baseline old_numba_dense.py] [--crossover]

Shapes: each model's attention q, k/v, o, its router and lm_head: `small` is the ~1 GB
checkpoint of bench_vs_llamacpp.py (hidden 1024, 16 heads of 64, 4 KV heads, 64 experts, vocab
4096), `qwen3-30b-a3b` Qwen3-30B-A3B's (hidden 2048: q 2048 -> 4096, k/v 2048 -> 512, o 4096
-> 2048, router 2048 -> 128, lm_head 2048 -> 151936). Weights are random (the k-quants, which
have no quantiser, as seeded random blocks: quant/random_blocks.py); each is copied until
the copies hold WORKING_SET_BYTES (more than the last-level cache) and the calls go round the
copies, so the weights come from DRAM, as in a decode step.

Columns: median µs per call (wall clock; at 1 thread also the calling thread's CPU time,
`cpu`, which another process on the core does not inflate: on a shared machine compare those),
GB/s = bytes of the stored weight / time, % DRAM = that / the DRAM read rate measured at the
same thread count in the same row (torch.sum over 1 GiB, best of 3), x torch = torch's time /
the kernel's; `q8` (formats with integer dot products: q8_0, q4_0, the k-quants) the
kernel with q8 activations (kernels/numba_dense_q8.py), `q8 x ours` ours' time / its. torch
runs on the weight in the activation dtype (bf16, f32: as stored; q8_0 and q4_0: dequantised
to float32 outside the timing, so it reads 3.8-7x the bytes: it is slower by format, not
only by code). --baseline FILE adds a column for another version's numba_dense.py
(e.g. `git show REV:src/hybridmoe/kernels/numba_dense.py > old.py`: before/after in one run).
--crossover adds T = 8, 16, 32, 64 on the q shape (kernels/projection.py DECODE_MAX_TOKENS).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch
import torch.nn.functional as F

from hybridmoe.kernels import numba_dense, numba_dense_q8
from hybridmoe.quant.formats import weight_format
from hybridmoe.quant.random_blocks import random_stored

WORKING_SET_BYTES = 512 << 20
MODELS = {  # name -> {projection: (rows, columns)}
    "small": {
        "q_proj": (1024, 1024),
        "kv_proj": (256, 1024),
        "o_proj": (1024, 1024),
        "router": (64, 1024),
        "lm_head": (4096, 1024),
    },
    "qwen3-30b-a3b": {
        "q_proj": (4096, 2048),
        "kv_proj": (512, 2048),
        "o_proj": (2048, 4096),
        "router": (128, 2048),
        "lm_head": (151936, 2048),
    },
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--formats", nargs="+", default=["bf16", "f32", "q8_0", "q4_0"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--reps", type=int, default=3, help="passes over the copies")
    names = list(MODELS["small"])
    parser.add_argument("--projections", nargs="+", default=names, choices=names)
    parser.add_argument("--baseline", help="another numba_dense.py to time beside this one")
    parser.add_argument("--crossover", action="store_true")
    return parser.parse_args()


def load_baseline(path: str | None):
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location("baseline_numba_dense", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Dram:
    """The DRAM read rate by plain torch reads (torch.sum over 1 GiB)."""

    def __init__(self) -> None:
        self.buffer = torch.ones(2**30 // 4)

    def read_gbps(self) -> tuple[float, float]:
        """(GB/s by wall clock, by the calling thread's CPU time), best of 3."""
        walls, cpus = [], []
        for _ in range(3):
            wall, cpu = time.perf_counter(), time.thread_time()
            self.buffer.sum()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.thread_time() - cpu)
        return self.buffer.nbytes / min(walls) / 1e9, self.buffer.nbytes / min(cpus) / 1e9


def time_calls(call, copies: list, reps: int) -> tuple[float, float]:
    """Median (wall s, thread CPU s) of call(copy) going round the copies `reps` times."""
    walls, cpus = [], []
    for _ in range(reps):
        for copy in copies:
            wall, cpu = time.perf_counter(), time.thread_time()
            call(copy)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.thread_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def make_copies(stored: torch.Tensor) -> list[torch.Tensor]:
    nbytes = stored.numel() * stored.element_size()
    return [stored] + [stored.clone() for _ in range(WORKING_SET_BYTES // nbytes)]


def compare(label, shape, fmt_name, tokens, threads, args, dram, baseline) -> None:
    rows, cols = shape
    fmt = weight_format(fmt_name)
    w = torch.randn(rows, cols) * 0.02
    act = torch.float32 if fmt_name == "f32" else torch.bfloat16
    if fmt.can_quantize:
        stored = fmt.quantize(w.to(act) if fmt_name in ("bf16", "f32") else w.bfloat16())
    else:  # the k-quants: seeded random blocks (quant/random_blocks.py)
        stored = random_stored(fmt, (rows, cols), torch.Generator().manual_seed(0), 0.08)
    w_torch = stored if not fmt.is_quantized else fmt.dequantize(stored, torch.float32)
    x = torch.randn(tokens, cols).to(act)
    x_torch = x if not fmt.is_quantized else x.float()
    copies = [numba_dense.weight_bytes(s) for s in make_copies(stored)]
    torch_copies = make_copies(w_torch)
    torch.set_num_threads(threads)
    kernels = {"ours": numba_dense} | ({"before": baseline} if baseline else {})
    calls = {
        name: (lambda wb, m=module: m.dense_linear(fmt, wb, rows, x, threads=threads), copies)
        for name, module in kernels.items()
    }
    if fmt.has_integer_dots:  # the q8 contract's kernel (--activation-quant q8)
        calls["q8"] = (
            lambda wb: numba_dense_q8.dense_linear_q8(fmt, wb, rows, x, threads=threads),
            copies,
        )
    calls["torch"] = (lambda wt: F.linear(x_torch, wt), torch_copies)
    for call, some in calls.values():
        call(some[0])  # compile, warm up
    times = {name: time_calls(call, some, args.reps) for name, (call, some) in calls.items()}
    wall_gbps, cpu_gbps = dram.read_gbps()
    gb = copies[0].shape[0] / 1e9
    line = f"{label:22s} {fmt_name:5s} T={tokens} thr={threads} DRAM {wall_gbps:5.1f} GB/s"
    if threads == 1:
        line += f" (cpu {cpu_gbps:5.1f})"
    for name, (wall, cpu) in times.items():
        line += f" | {name} {wall * 1e6:7.0f} µs {gb / wall:5.1f} GB/s {gb / wall / wall_gbps:4.0%}"
        if threads == 1:
            line += f" cpu {cpu * 1e6:7.0f} µs {gb / cpu / cpu_gbps:4.0%}"
    ours_wall, ours_cpu = times["ours"]
    line += f" | {times['torch'][0] / ours_wall:5.2f}x torch"
    if "q8" in times:
        line += f" | q8 {ours_wall / times['q8'][0]:5.2f}x ours"
    if baseline:
        before = times["before"][1 if threads == 1 else 0]
        line += f" {before / (ours_cpu if threads == 1 else ours_wall):5.2f}x before"
    print(line, flush=True)


def main() -> None:
    args = parse_args()
    baseline = load_baseline(args.baseline)
    dram = Dram()
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().strip()}")
    for threads in args.threads:
        for model in args.models:
            for fmt_name in args.formats:
                for name in args.projections:
                    shape = MODELS[model][name]
                    for tokens in args.tokens:
                        label = f"{model}.{name}"
                        compare(label, shape, fmt_name, tokens, threads, args, dram, baseline)
    if args.crossover:
        for tokens in (8, 16, 32, 64):
            shape = MODELS["qwen3-30b-a3b"]["q_proj"]
            compare("qwen3.q_proj", shape, "bf16", tokens, max(args.threads), args, dram, baseline)
    with open("/proc/loadavg") as f:
        print(f"load average after: {f.read().strip()}")


if __name__ == "__main__":
    main()
