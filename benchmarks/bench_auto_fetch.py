"""`--max-fetch auto` against every fixed max_fetch, pure offload and pure CPU, across 5-75 %
residency, predicted with the simulator (LRU, OffloadMoeCache's policy) and the cost model.

Two cases: the demo model on its shipped routing trace, and the Qwen3-30B-A3B shape
(benchmarks/configs) on uniform routing (binomial hits; no trace of that model ships). The
hardware is a bench-hw profile (--hw) or the built-in GPU-machine assumptions. Prints predicted
tok/s per residency, whether auto is at least as fast as the `cpu` and `offload` targets and as
hybrid's own two pure ends (max_fetch 0: every miss on the CPU; max_fetch K: every miss
fetched), and auto's ratio to the best fixed max_fetch. The targets differ in orchestration
cost per layer (the profile's layer_overhead_s), which no fetch policy changes.

Run: python benchmarks/bench_auto_fetch.py [--hw hw.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridmoe.planning.cost_model import CallMix, CostModel, ModelShape
from hybridmoe.planning.hardware import HardwareProfile, default_profile
from hybridmoe.planning.planner import fetch_caps, outcome_from_trace, outcome_uniform
from hybridmoe.planning.trace import RoutingTrace

ROOT = Path(__file__).parents[1]
RESIDENCIES = (0.05, 0.1, 0.25, 0.5, 0.75)


def table(model: CostModel, trace: RoutingTrace | None) -> None:
    shape = model.shape
    caps = [c for c in fetch_caps(shape.top_k) if c != "auto"]
    cpu = model.step("cpu", CallMix(((1.0, 0, 0, shape.top_k),))).tok_per_s
    head = " ".join(f"{'mf=' + str(c):>7}" for c in caps)
    print(
        f"{'resid':>5} {'slots':>5} {'cpu':>7} {'offload':>7} {head} {'auto':>7} "
        f"{'>=cpu,offload':>13} {'>=mf=0,K':>8} {'auto/best fixed':>15}"
    )
    for share in RESIDENCIES:
        slots = max(1, round(share * shape.total_experts))

        def outcome(cap, slots=slots):
            if trace is not None:
                return outcome_from_trace(trace, slots, cap, model)
            return outcome_uniform(slots, cap, model)

        offload = model.step("offload", outcome(None).mix).tok_per_s
        fixed = {c: model.step("hybrid", outcome(c).mix).tok_per_s for c in caps}
        auto = model.step("hybrid", outcome("auto").mix).tok_per_s
        best = max(fixed, key=fixed.get)
        cells = " ".join(f"{fixed[c]:7.2f}" for c in caps)
        ok = "yes" if auto >= max(cpu, offload) else "NO"
        # the same target's two pure ends: mf=0 (all misses on the CPU), mf=K (all fetched)
        ends = "yes" if auto >= max(fixed[0], fixed[shape.top_k]) else "NO"
        print(
            f"{share:5.0%} {slots:5d} {cpu:7.2f} {offload:7.2f} {cells} {auto:7.2f} "
            f"{ok:>13} {ends:>8} {auto / fixed[best]:9.3f} (mf={best})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hw", type=Path, default=None, help="a bench-hw profile")
    args = parser.parse_args()
    hw = HardwareProfile.load(args.hw) if args.hw else default_profile()
    print(f"hardware: {args.hw or 'built-in assumptions'} ({hw.device}); predicted tok/s")
    demo = ModelShape.from_config(ROOT / "src/hybridmoe/demo/demo-qwen3moe-v2")
    print("\ndemo model (f32 experts), shipped trace tests/data/demo_trace.npz")
    table(CostModel(demo, hw, "f32"), RoutingTrace.load(ROOT / "tests/data/demo_trace.npz"))
    qwen = ModelShape.from_config(ROOT / "benchmarks/configs/qwen3-30b-a3b.json")
    print("\nQwen3-30B-A3B shape (bf16 experts), uniform routing")
    table(CostModel(qwen, hw, "bf16", "bfloat16"), None)


if __name__ == "__main__":
    main()
