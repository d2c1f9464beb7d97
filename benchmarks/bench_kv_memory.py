"""KV-cache bytes of a model's shape, sliding-window layers as rings of `sliding_window`
positions (what the engine allocates) and keeping every position (as before the ring): bytes
per token, fixed bytes per sequence, and one sequence's row at a few context lengths. Computed
by engine/kv_cache.kv_footprint from the parsed config; nothing is allocated.

    python benchmarks/bench_kv_memory.py [--config benchmarks/configs/gpt-oss-120b.json]
                                         [--dtype bfloat16] [--lengths 4096 32768 131072]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hybridmoe.engine.kv_cache import kv_footprint
from hybridmoe.models.registry import family_for

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", type=Path, default=ROOT / "benchmarks/configs/gpt-oss-120b.json"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072])
    args = parser.parse_args()
    raw = json.loads(args.config.read_text())
    cfg = family_for(raw, str(args.config)).config_from(raw, str(args.config))
    dtype = getattr(torch, args.dtype)
    sliding = sum(cfg.layer_window(i) is not None for i in range(cfg.num_layers))
    print(
        f"{args.config.name}: {cfg.num_layers} layers ({sliding} sliding, window "
        f"{cfg.sliding_window}), {cfg.num_kv_heads} KV heads x head_dim {cfg.head_dim}, {dtype}"
    )
    print(
        f"{'':>12} {'B/token':>9} {'fixed/seq':>12} " + " ".join(f"{n:>11}" for n in args.lengths)
    )
    for ring in (False, True):
        longest = max(args.lengths)  # a ring needs window < max_len; every length here is
        per = kv_footprint(cfg, longest, dtype, ring)
        rows = [kv_footprint(cfg, n, dtype, ring).row_bytes(n) / MIB for n in args.lengths]
        print(
            f"{'ring' if ring else 'every pos.':>12} {per.bytes_per_token:>9,} "
            f"{per.fixed_bytes:>10,} B " + " ".join(f"{r:>7.1f} MiB" for r in rows)
        )


if __name__ == "__main__":
    main()
