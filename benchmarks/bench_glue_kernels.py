"""The decode step's glue ops on the host: torch's reference vs the numba glue kernels
(kernels/numba_glue.py), µs per call measured side by side in one process, with the ratio.

    python benchmarks/bench_glue_kernels.py [--hidden 2048] [--experts 128] [--top-k 8]

Wall time on a shared machine is load-dependent: read the ratios, and say the load average.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from hybridmoe import env
from hybridmoe.layers import norm
from hybridmoe.moe import routing


def _us_per_call(fn: Callable[[], object], calls: int) -> float:
    for _ in range(calls // 10):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _cases(hidden: int, experts: int, top_k: int) -> dict[str, Callable[[], object]]:
    x, y = torch.randn(1, hidden).bfloat16(), torch.randn(1, hidden).bfloat16()
    w = (torch.rand(hidden) + 0.5).bfloat16()
    logits = torch.randn(1, experts).bfloat16()
    return {
        "rms_norm": lambda: norm.rms_norm(x, w, 1e-6),
        "add_rms_norm": lambda: norm.add_rms_norm(x, y, w, 1e-6),
        "route (softmax top-k, renorm)": lambda: routing.route(logits, top_k, True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a CPU decode step runs torch's ops serially
    cases = _cases(args.hidden, args.experts, args.top_k)
    print(f"load average {os.getloadavg()[0]:.2f}; µs per call")
    print(f"{'op':34s} {'torch':>8s} {'numba':>8s} {'ratio':>6s}")
    for name, fn in cases.items():
        os.environ["HYBRIDMOE_GLUE_KERNELS"] = "0"
        env.reread_switches()
        torch_us = _us_per_call(fn, args.calls)
        os.environ["HYBRIDMOE_GLUE_KERNELS"] = "1"
        env.reread_switches()
        numba_us = _us_per_call(fn, args.calls)
        print(f"{name:34s} {torch_us:8.2f} {numba_us:8.2f} {torch_us / numba_us:6.2f}")


if __name__ == "__main__":
    main()
