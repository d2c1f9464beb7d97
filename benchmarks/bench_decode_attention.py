"""A decode step's attention of one layer on the CPU: the numba kernel (kernels/
numba_attention.py: the KV write and the attention in one call) against the torch path it
replaces (KVCache.update's two index_put_, then torch's SDPA), side by side in one run.

    python benchmarks/bench_decode_attention.py [--dtypes bf16 f32] [--head-dims 128 64]
        [--lengths 16 64 256 1024 4096] [--heads 16] [--kv-heads 4] [--batch 1] [--threads 1]

torch runs serial (torch.set_num_threads(1)), as a decode step runs it (kernels/threads.
serial_torch_ops); the kernel at --threads (1: the calling thread alone). Columns: the calling
thread's CPU time per call in µs (time.thread_time over many calls, best of 3 rounds: another
process on the core does not inflate it), and torch's over the kernel's. The load average is
printed before and after.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hybridmoe.kernels import numba_attention

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=[128])
    parser.add_argument("--lengths", nargs="+", type=int, default=[16, 64, 256, 1024, 4096])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1, help="sequences, each at the length")
    parser.add_argument("--threads", type=int, default=1, help="the kernel's threads")
    return parser.parse_args(argv)


def cpu_us(fn, calls: int, rounds: int = 3) -> float:
    """The calling thread's CPU time per call of fn, best of `rounds`."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls * 1e6)
    return best


def measure(args, dtype: torch.dtype, D: int, S: int) -> tuple[float, float]:
    """(torch µs, kernel µs) of a step whose every sequence attends over S keys."""
    B, H, KVH = args.batch, args.heads, args.kv_heads
    slots = max(args.lengths)
    k_cache, v_cache = (torch.randn(B, KVH, slots, D).to(dtype) for _ in "kv")
    q = torch.randn(B, 1, H, D).to(dtype)
    k, v = (torch.randn(B, 1, KVH, D).to(dtype) for _ in "kv")
    rows, positions = torch.arange(B), torch.full((B, 1), S - 1)
    host = tuple(numba_attention.cache_array(c) for c in (k_cache, v_cache))
    rows_np, positions_np = rows.numpy(), positions[:, 0].numpy()

    def reference() -> None:
        k_cache[rows[:, None], :, positions] = k
        v_cache[rows[:, None], :, positions] = v
        keys, values = k_cache[:, :, :S], v_cache[:, :, :S]
        F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, enable_gqa=True)

    def kernel() -> None:
        numba_attention.decode_attention(
            q, k, v, host, slots, rows_np, positions_np, S, None, None, threads=args.threads
        )

    calls = max(20, 100_000 // S)
    return cpu_us(reference, calls), cpu_us(kernel, calls)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    print("load average:", open("/proc/loadavg").read().strip())
    print(f"{args.heads} heads, {args.kv_heads} kv heads, batch {args.batch}")
    print(f"{'dtype':>5} {'D':>4} {'S':>6} {'torch us':>10} {'kernel us':>10} {'x torch':>8}")
    with torch.inference_mode():
        for name in args.dtypes:
            for D in args.head_dims:
                for S in args.lengths:
                    ref, fast = measure(args, DTYPES[name], D, S)
                    print(f"{name:>5} {D:>4} {S:>6} {ref:>10.1f} {fast:>10.1f} {ref / fast:>8.2f}")
    print("load average:", open("/proc/loadavg").read().strip())


if __name__ == "__main__":
    main()
