"""Hit rates of every cache policy on a routing trace, with Belady's bound beside them.

For each residency (share of all routed experts the cache holds) and max_fetch, the simulator
replays the trace (default: the shipped demo trace) through each policy; `belady` is the
fewest misses any cache of that size can have (cold: starting empty, as the online policies
do; warm: any placement before decode for free, the bound for `static`). Also prints the
simulation time per policy.

Run: python benchmarks/bench_cache_policies.py [--trace T] [--max-fetch N]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hybridmoe.moe.config import parse_max_fetch
from hybridmoe.planning.simulator import POLICIES, belady, create_policy, simulate
from hybridmoe.planning.trace import RoutingTrace

TRACE = Path(__file__).parents[1] / "tests/data/demo_trace.npz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--max-fetch", type=parse_max_fetch, default=1)
    parser.add_argument("--residency", type=float, nargs="*", default=[0.1, 0.25, 0.5])
    args = parser.parse_args()
    trace = RoutingTrace.load(args.trace)
    total = trace.num_layers * trace.num_experts
    print(
        f"{args.trace.name}: {trace.num_rows} tokens x {trace.num_layers} MoE layers, top-"
        f"{trace.top_k} of {trace.num_experts}; hybrid max_fetch {args.max_fetch}"
    )
    print(
        f"{'resident':>9} {'slots':>5} "
        + " ".join(f"{p:>13}" for p in POLICIES)
        + f" {'belady cold':>11} {'belady warm':>11}"
    )
    seconds = dict.fromkeys(POLICIES, 0.0)
    for share in args.residency:
        slots = max(1, round(share * total))
        cells = []
        for name in POLICIES:
            start = time.perf_counter()
            result = simulate(trace, create_policy(name, trace, slots), args.max_fetch)
            seconds[name] = max(seconds[name], time.perf_counter() - start)
            cells.append(f"{result.total.hit_rate:13.1%}")
        cold, warm = (belady(trace, slots, w).total.hit_rate for w in (False, True))
        print(f"{share:9.0%} {slots:5d} " + " ".join(cells) + f" {cold:11.1%} {warm:11.1%}")
    print(
        "slowest simulation per policy: " + ", ".join(f"{n} {s:.2f} s" for n, s in seconds.items())
    )


if __name__ == "__main__":
    main()
