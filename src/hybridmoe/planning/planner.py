"""The planner: for each decode target and cache size, the predicted decode tok/s (batch 1),
its bottleneck and the flags that give it, from a model's shape and a hardware profile.

How a cache of S slots splits each call into hits, fetches and CPU experts comes from a
routing trace of the model when one is given (replayed through the simulator's LRU, which is
OffloadMoeCache's policy), else from independent uniform routing: each of the K experts of a
call is resident with probability S / (layers x experts) once the cache has filled (any
policy's hit rate under uniform routing), binomially. Real routing is skewed and sticky, so
without a trace the hit rates are pessimistic.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from hybridmoe.moe.fetch_policy import AutoFetch, balanced_fetch_count
from hybridmoe.planning.cost_model import CallMix, CostModel, StepCost
from hybridmoe.planning.policies import LruPolicy
from hybridmoe.planning.simulator import simulate
from hybridmoe.planning.trace import RoutingTrace

RESIDENCIES = (0.05, 0.1, 0.25, 0.5, 0.75)  # shares of all routed experts held in the cache
KV_POSITIONS = 4096  # the KV cache a memory budget must leave room for (one sequence)


@dataclass(frozen=True)
class CacheOutcome:
    mix: CallMix
    hit_rate: float
    cpu_share: float
    fetched_per_token: float


@dataclass(frozen=True)
class PlanRow:
    target: str
    slots: int
    max_fetch: int | str | None  # hybrid's best; None for targets without a cap
    cost: StepCost
    outcome: CacheOutcome

    def residency(self, total: int) -> float:
        return self.slots / total

    def flags(self, expert_format: str | None) -> str:
        out = f"--decode-target {self.target}"
        if self.target in ("offload", "hybrid"):
            out += f" --expert-cache-slots {self.slots}"
        if self.target == "hybrid":
            out += f" --max-fetch {self.max_fetch}"
        return out + (f" --expert-format {expert_format}" if expert_format else "")


def fetch_caps(top_k: int) -> list[int | str]:
    return sorted({0, 1, 2, 4, top_k} - {c for c in (2, 4) if c > top_k}) + ["auto"]


def outcome_from_trace(trace: RoutingTrace, slots: int, cap, model: CostModel) -> CacheOutcome:
    policy = AutoFetch(model.fetch_costs(), model.overlapped) if cap == "auto" else cap
    result = simulate(trace, LruPolicy(slots), policy)
    calls = Counter(zip(result.call_hits, result.call_fetched, result.call_cpu, strict=True))
    n = len(result.call_hits)
    mix = CallMix(tuple((count / n, h, f, c) for (h, f, c), count in calls.items()))
    stats = result.total
    return CacheOutcome(
        mix, stats.hit_rate, stats.cpu_routes / stats.routes, stats.fetched / result.tokens
    )


def outcome_uniform(slots: int, cap, model: CostModel) -> CacheOutcome:
    """Binomial hits under uniform routing; `cap` None fetches every miss (offload)."""
    k, shape = model.shape.top_k, model.shape.moe_layers
    p = 0.0 if cap == 0 else slots / model.shape.total_experts
    costs = model.fetch_costs()
    calls, cpu, fetched = [], 0.0, 0.0
    for h in range(k + 1):
        share = math.comb(k, h) * p**h * (1 - p) ** (k - h)
        m = k - h
        if cap is None:
            f = m
        elif cap == "auto":
            f = balanced_fetch_count(h, m, costs, model.overlapped)
        else:
            f = min(cap, m)
        calls.append((share, h, f, m - f))
        cpu, fetched = cpu + share * (m - f), fetched + share * f
    return CacheOutcome(CallMix(tuple(calls)), p, cpu / k, fetched * shape)


def max_slots(model: CostModel, gpu_memory_gib: float | None, kv_bytes: int) -> int:
    """Slots that fit beside the dense weights and the KV cache (all experts without a budget)."""
    total = model.shape.total_experts
    if gpu_memory_gib is None:
        return total
    dense = model.shape.dense_params * model.dense_bytes_per_param
    free = gpu_memory_gib * 2**30 - dense - kv_bytes
    return max(0, min(total, int(free // model.shape.expert_nbytes(model.expert_format))))


def plan(
    model: CostModel,
    gpu_memory_gib: float | None = None,
    trace: RoutingTrace | None = None,
    kv_bytes: int = 0,
) -> list[PlanRow]:
    """Every target at every cache size that fits (hybrid with its best max_fetch)."""
    shape = model.shape
    if trace is not None:
        check_trace_matches(trace, model)
    fits = max_slots(model, gpu_memory_gib, kv_bytes)

    def outcome(slots, cap):
        if trace is not None:
            return outcome_from_trace(trace, slots, cap, model)
        return outcome_uniform(slots, cap, model)

    rows = [
        PlanRow(
            "cpu",
            0,
            None,
            model.step("cpu", CallMix(((1.0, 0, 0, shape.top_k),))),
            CacheOutcome(CallMix(()), 0.0, 1.0, 0.0),
        )
    ]
    if fits >= shape.total_experts:
        full = CallMix(((1.0, shape.top_k, 0, 0),))
        rows.append(
            PlanRow(
                "resident",
                fits,
                None,
                model.step("resident", full),
                CacheOutcome(full, 1.0, 0.0, 0.0),
            )
        )
    sizes = sorted({min(fits, max(1, round(r * shape.total_experts))) for r in RESIDENCIES})
    for slots in [s for s in sizes if s >= 1]:
        if slots >= shape.top_k:
            done = outcome(slots, None)
            rows.append(PlanRow("offload", slots, None, model.step("offload", done.mix), done))
        options = [(cap, outcome(slots, cap)) for cap in fetch_caps(shape.top_k)]
        scored = [(model.step("hybrid", o.mix), cap, o) for cap, o in options]
        cost, cap, done = min(scored, key=lambda item: item[0].seconds)
        rows.append(PlanRow("hybrid", slots, cap, cost, done))
    return rows


def check_trace_matches(trace: RoutingTrace, model: CostModel) -> None:
    shape = model.shape
    got = (trace.num_layers, trace.num_experts, trace.top_k)
    want = (shape.moe_layers, shape.num_experts, shape.top_k)
    if got != want:
        raise ValueError(
            f"--trace has {got[0]} MoE layers x {got[1]} experts, top-{got[2]}; the model "
            f"{shape.name} has {want[0]} x {want[1]}, top-{want[2]}: record a trace of this model"
        )


def format_table(rows: list[PlanRow], model: CostModel, expert_format: str | None) -> str:
    total = model.shape.total_experts
    lines = [
        f"{'target':8} {'cache':>13} {'tok/s':>8} {'hit':>6} {'CPU':>6} {'fetch/tok':>9}"
        f"  {'bottleneck':13} flags"
    ]
    for row in rows:
        o = row.outcome
        cache = f"{row.slots} ({row.residency(total):.0%})" if row.target != "cpu" else "-"
        lines.append(
            f"{row.target:8} {cache:>13} {row.cost.tok_per_s:8.2f} {o.hit_rate:6.1%} "
            f"{o.cpu_share:6.1%} {o.fetched_per_token:9.2f}  {row.cost.bottleneck:13} "
            f"{row.flags(expert_format)}"
        )
    return "\n".join(lines)
