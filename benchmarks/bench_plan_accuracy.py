"""The planner's prediction error on this machine: predicted against measured decode tok/s of
the demo model (f32) and a ~1 GB synthetic Qwen3-MoE (bf16, random weights), on every decode
target (the offload and hybrid targets at 25 % residency).

Predictions use only what `hybridmoe plan` uses: the model's config.json, the bench-hw profile
(--hw) and, for the demo, its shipped routing trace (the synthetic model's random routers route
near-uniformly: uniform routing). Measured: greedy decode of `--tokens` tokens after a warm-up,
batch 1, on the cpu device, with the profile's thread count. The profile's orchestration
costs were fitted on the demo model, so the demo's errors are in-sample; the synthetic
model's are not.

Run: python -m hybridmoe bench-hw -o hw.json --device cpu [--threads 1]
     python benchmarks/bench_plan_accuracy.py --hw hw.json
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bench_decode import Qwen3MoeShape, ensure_checkpoint

from hybridmoe.cli_planning import calibrate_orchestration, measured_decode
from hybridmoe.demo import require_demo_checkpoint
from hybridmoe.env import cache_dir
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.planning.cost_model import CallMix, CostModel, ModelShape
from hybridmoe.planning.hardware import HardwareProfile
from hybridmoe.planning.planner import outcome_from_trace, outcome_uniform
from hybridmoe.planning.trace import RoutingTrace

ROOT = Path(__file__).parents[1]
RATIO = 0.25
CASES = {  # label -> (target, max_fetch)
    "resident": ("resident", None),
    "cpu": ("cpu", None),
    "offload 25%": ("offload", None),
    "hybrid 25% mf=1": ("hybrid", 1),
    "hybrid 25% auto": ("hybrid", "auto"),
}


def predicted_s(model: CostModel, target: str, cap, trace: RoutingTrace | None) -> float:
    shape = model.shape
    if target == "resident":
        return model.step(target, CallMix(((1.0, shape.top_k, 0, 0),))).seconds
    if target == "cpu":
        return model.step(target, CallMix(((1.0, 0, 0, shape.top_k),))).seconds
    slots = max(1, round(RATIO * shape.total_experts))
    if trace is not None:
        return model.step(target, outcome_from_trace(trace, slots, cap, model).mix).seconds
    return model.step(target, outcome_uniform(slots, cap, model).mix).seconds


def compare(directory: Path, fmt: str, dtype: str, trace, hw, tokens: int) -> list[float]:
    model = CostModel(ModelShape.from_config(directory), hw, fmt, dtype)
    errors = []
    for label, (target, cap) in CASES.items():
        cache_cap = 1 if cap is None else cap
        offload = OffloadConfig(decode_target=target, expert_cache_ratio=RATIO, max_fetch=cache_cap)
        if target in ("resident", "cpu"):
            offload = OffloadConfig(decode_target=target)
        measured, _ = measured_decode(directory, offload, "cpu", dtype, tokens, hw.cpu_threads)
        predicted = predicted_s(model, target, cap, trace)
        error = (1 / predicted - 1 / measured) / (1 / measured)
        errors.append(abs(error))
        print(
            f"  {label:17s} measured {1 / measured:8.2f} tok/s  predicted "
            f"{1 / predicted:8.2f} tok/s  error {error:+6.1%}"
        )
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hw", type=Path, required=True, help="a bench-hw profile (cpu device)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="refit the profile's orchestration on the demo now (a busy machine drifts)",
    )
    args = parser.parse_args()
    hw = HardwareProfile.load(args.hw)
    if args.recalibrate:
        hw = calibrate_orchestration(hw, "cpu", hw.cpu_threads)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    trace = RoutingTrace.load(ROOT / "tests/data/demo_trace.npz")
    print("demo model (f32, shipped trace):")
    demo = compare(require_demo_checkpoint(), "f32", "float32", trace, hw, args.tokens)
    synthetic = ensure_checkpoint(Qwen3MoeShape(num_hidden_layers=6), cache_dir() / "plan-1gb")
    print("synthetic ~1 GB Qwen3-MoE (bf16, uniform routing):")
    big = compare(synthetic, "bf16", "bfloat16", None, hw, args.tokens)
    for name, errors in (("demo", demo), ("1 GB", big)):
        print(f"{name}: mean |error| {sum(errors) / len(errors):.1%}, max {max(errors):.1%}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
