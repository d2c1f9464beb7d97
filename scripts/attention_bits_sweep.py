"""How often the CPU decode-attention kernel's bfloat16 output is not torch's SDPA's over each row's
own keys (the sequence decoding alone), bit for bit, over random decode steps: batches of 1-3 rows
at positions up to --max-keys, grouped-query ratios 1-8, head sizes 32-128, a random scale of the
values. Prints each step that differs and a summary line; exits 1 where any does. For a machine the
kernel may not reproduce (another CPU vendor or instruction set, another torch build): run it
before trusting `--attention-kernel auto`'s one-step check (numba_attention.gives_sdpa_bits)
further.

    python scripts/attention_bits_sweep.py [--seconds 60] [--seed 7] [--max-keys 1600]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np
import torch

from hybridmoe.kernels import numba_attention


def random_step(rng: random.Random, max_keys: int) -> tuple[dict, int, int]:
    """One random step: (its shape, mismatching elements, elements)."""
    kv_heads, group = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3, 4, 6, 8])
    heads, dim, rows = kv_heads * group, rng.choice([32, 64, 80, 96, 128]), rng.choice([1, 1, 2, 3])
    positions = [rng.randrange(0, max_keys) for _ in range(rows)]
    kv_len = max(positions) + 1
    slots, scale = kv_len + rng.randrange(0, 40), rng.choice([0.5, 1.0, 2.0, 4.0])
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).bfloat16()

    caches = [randn(rows, kv_heads, slots, dim) for _ in "kv"]
    q, k, v = (
        randn(rows, 1, heads, dim),
        randn(rows, 1, kv_heads, dim),
        randn(rows, 1, kv_heads, dim),
    )
    host = tuple(numba_attention.cache_array(c) for c in caches)
    at = np.array(positions)
    out = numba_attention.decode_attention(
        q, k, v, host, slots, np.arange(rows), at, kv_len, None, None, threads=1
    )
    reference = numba_attention.sdpa_alone(q, caches, positions)
    shape = dict(heads=heads, kv_heads=kv_heads, dim=dim, positions=positions, scale=scale)
    return shape, int((out != reference).sum()), out.numel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--max-keys", type=int, default=1600)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # SDPA's GEMMs as a decode step runs them
    rng, start = random.Random(args.seed), time.monotonic()
    steps = bad_steps = bad = total = 0
    while time.monotonic() - start < args.seconds:
        shape, wrong, count = random_step(rng, args.max_keys)
        steps, total = steps + 1, total + count
        if wrong:
            bad_steps, bad = bad_steps + 1, bad + wrong
            print(f"differs: {shape}: {wrong} of {count} elements", flush=True)
    print(f"{steps} steps, {total} elements: {bad_steps} steps, {bad} elements differ from SDPA")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
