"""A decode step's dense projections on the CPU: the numba kernel (kernels/numba_dense.py)
against torch's F.linear, measured side by side, in GB/s of weight bytes read.

    python benchmarks/bench_dense.py [--reps 9] [--threads 1 2] [--tokens 1 4]
        [--formats bf16 q8_0] [--crossover]

Shapes: Qwen3-30B-A3B's attention (hidden 2048: q 4096 x 2048, k/v 512 x 2048, o 2048 x 4096)
and its lm_head (151936 x 2048). Weights are random. Before every timed call a 256 MiB buffer
is read, so the weights come from DRAM as in a decode step. torch runs on the weight in the
activation dtype (bf16: as stored; a quantised format: dequantised to float32 once, outside
the timing, which flatters torch by the bytes it reads: it reads 2-4x more). Columns: median
µs per call, GB/s = bytes of the stored weight / time, x torch = torch's time / the kernel's.
--crossover adds T = 8, 16, 32, 64 on the q shape: where torch's GEMM overtakes the kernel
(kernels/projection.py DECODE_MAX_TOKENS).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hybridmoe.kernels.numba_dense import dense_linear, weight_bytes
from hybridmoe.quant.formats import weight_format

SHAPES = {  # name -> (rows, columns)
    "q_proj": (4096, 2048),
    "kv_proj": (512, 2048),
    "o_proj": (2048, 4096),
    "lm_head": (151936, 2048),
}
FLUSH = torch.ones(64 * 2**20)  # 256 MiB


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--formats", nargs="+", default=["bf16", "q8_0"])
    parser.add_argument("--crossover", action="store_true")
    return parser.parse_args()


def median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        FLUSH.sum()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(name: str, fmt_name: str, tokens: int, threads: int, reps: int) -> None:
    rows, cols = SHAPES[name]
    fmt = weight_format(fmt_name)
    w = (torch.randn(rows, cols) * 0.02).bfloat16()
    stored = w if fmt_name == "bf16" else fmt.quantize(w)
    w_torch = w if fmt_name == "bf16" else fmt.dequantize(stored, torch.float32)
    x = torch.randn(tokens, cols).bfloat16()
    x_torch = x if fmt_name == "bf16" else x.float()
    w_bytes = weight_bytes(stored)
    torch.set_num_threads(threads)

    def ours():
        return dense_linear(fmt, w_bytes, rows, x, threads=threads)

    def theirs():
        return F.linear(x_torch, w_torch)

    ours(), theirs()  # compile, warm up
    t_ours, t_torch = 0.0, 0.0
    for _ in range(2):  # interleaved halves: load changes hit both alike
        t_ours += median_s(ours, reps) / 2
        t_torch += median_s(theirs, reps) / 2
    gb = stored.numel() * stored.element_size() / 1e9
    print(
        f"{name:8s} {fmt_name:5s} T={tokens:<3d} threads={threads}  "
        f"ours {t_ours * 1e6:8.0f} µs {gb / t_ours:6.1f} GB/s   "
        f"torch {t_torch * 1e6:8.0f} µs {gb / t_torch:6.1f} GB/s   {t_torch / t_ours:5.2f}x torch",
        flush=True,
    )


def main() -> None:
    args = parse_args()
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().strip()}")
    for threads in args.threads:
        for fmt_name in args.formats:
            for name in SHAPES:
                for tokens in args.tokens:
                    compare(name, fmt_name, tokens, threads, args.reps)
    if args.crossover:
        for tokens in (8, 16, 32, 64):
            compare("q_proj", "bf16", tokens, max(args.threads), args.reps)
    with open("/proc/loadavg") as f:
        print(f"load average after: {f.read().strip()}")


if __name__ == "__main__":
    main()
