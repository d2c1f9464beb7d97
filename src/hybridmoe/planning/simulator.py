"""Replay a routing trace through a cache policy: hit rate, CPU routes, fetches, bytes moved.

`simulate` replays with the hybrid rules of OffloadMoeCache, for any SlotPolicy: per call, the
experts already resident are hits (touched in order of first appearance), then at most the
fetch cap of the misses (most routes first, ties in first-appearance order) are admitted, the
rest are CPU routes. With LruPolicy its counts are OffloadMoeCache's exactly (tested).
`belady` is the offline bound (see its docstring). Both count into ExpertCacheStats per layer.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from hybridmoe.moe.cache_stats import ExpertCacheStats
from hybridmoe.moe.fetch_policy import FetchPolicy
from hybridmoe.planning.policies import (
    LfuPolicy,
    LruPolicy,
    PerLayerLruPolicy,
    SlotPolicy,
    StaticPolicy,
)
from hybridmoe.planning.trace import RoutingTrace

# a fixed cap, None (the offload target: fetch every miss), or a policy deciding per call
FetchCap = int | None | FetchPolicy


@dataclass
class SimResult:
    stats_by_layer: dict[int, ExpertCacheStats]
    tokens: int  # decoded rows replayed
    # per cache call, distinct experts: [calls] each (for the cost model)
    call_hits: list[int] = field(default_factory=list)
    call_fetched: list[int] = field(default_factory=list)
    call_cpu: list[int] = field(default_factory=list)

    @property
    def total(self) -> ExpertCacheStats:
        return ExpertCacheStats.merged(list(self.stats_by_layer.values()))

    def per_token(self, expert_nbytes: int) -> dict[str, float]:
        t, tokens = self.total, max(self.tokens, 1)
        return {
            "hit_rate": t.hit_rate,
            "cpu_share": t.cpu_routes / t.routes if t.routes else 0.0,
            "fetched_per_token": t.fetched / tokens,
            "bytes_per_token": t.fetched * expert_nbytes / tokens,
        }


def simulate(trace: RoutingTrace, policy: SlotPolicy, max_fetch: FetchCap) -> SimResult:
    """Replay every decode call of `trace` through `policy` (fresh: nothing resident)."""
    result = SimResult({layer: ExpertCacheStats() for layer in range(trace.num_layers)}, 0)
    num_experts = trace.num_experts
    for layer, ids in trace.calls():
        if layer == 0:
            result.tokens += ids.shape[0]
        counts = Counter(ids.reshape(-1).tolist())  # expert -> routes, first-seen order
        _replay_call(policy, layer * num_experts, counts, max_fetch, layer, result)
    return result


def _replay_call(
    policy: SlotPolicy,
    base: int,
    counts: Counter[int],
    max_fetch: FetchCap,
    layer: int,
    result: SimResult,
) -> None:
    stats = result.stats_by_layer[layer]
    hits, misses = [], []
    for expert, routes in counts.items():
        policy.seen(base + expert, routes)
        (hits if policy.resident(base + expert) else misses).append(expert)
    for expert in hits:
        policy.touch(base + expert)
    misses.sort(key=lambda e: -counts[e])  # stable: ties keep first-appearance order
    cap = max_fetch
    if cap is not None and not isinstance(cap, int):
        cap = cap.fetch_count(layer, len(hits), len(misses))
    protected = {base + e for e in hits}
    fetched = []
    for expert in misses[:cap]:
        evicted = policy.admit(base + expert, protected)
        if evicted is None:
            break
        stats.evictions += evicted
        protected.add(base + expert)
        fetched.append(expert)
    stats.routes += sum(counts.values())
    stats.hits += sum(counts[e] for e in hits)
    stats.fetched_routes += sum(counts[e] for e in fetched)
    stats.cpu_routes += sum(counts[e] for e in misses[len(fetched) :])
    stats.fetched += len(fetched)
    result.call_hits.append(len(hits))
    result.call_fetched.append(len(fetched))
    result.call_cpu.append(len(misses) - len(fetched))


def popular_experts(trace: RoutingTrace, num_slots: int) -> set[int]:
    """The `num_slots` flat ids with the most routes in `trace` (ties: lower id)."""
    flat = trace.expert_ids.astype(np.int64) + np.arange(trace.num_layers)[:, None] * (
        trace.num_experts
    )  # [R, L, K]
    counts = np.bincount(flat.reshape(-1), minlength=trace.num_layers * trace.num_experts)
    order = np.lexsort((np.arange(counts.size), -counts))
    return set(order[:num_slots].tolist())


POLICIES = ("lru", "lfu", "per_layer_lru", "static")


def create_policy(name: str, trace: RoutingTrace, num_slots: int) -> SlotPolicy:
    """A fresh policy of `name` (POLICIES) for `num_slots` slots; `static` places the trace's
    own most routed experts (an oracle profile, the best a static placement can do)."""
    if name == "lru":
        return LruPolicy(num_slots)
    if name == "lfu":
        return LfuPolicy(num_slots)
    if name == "per_layer_lru":
        return PerLayerLruPolicy(num_slots, trace.num_layers, trace.num_experts)
    if name == "static":
        return StaticPolicy(popular_experts(trace, num_slots))
    raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}")


def belady(trace: RoutingTrace, num_slots: int, warm: bool = False) -> SimResult:
    """Belady's MIN with bypass: the fewest misses any cache of `num_slots` slots can have.

    The bound is over a relaxed cache: it sees the whole future, may fetch any number of
    experts per call (no max_fetch cap) and may bypass a miss (compute it on the CPU), and
    serves a call's routes one by one in row-major order. Every policy above is one such cache
    (a cap or a protected slot only removes choices, and a route of an expert fetched earlier
    in the same call is a hit here), so hits here >= hits of every policy at every max_fetch,
    including `offload`. It bounds misses (1 - hit rate), not bytes moved or time. On a miss
    the expert is admitted if its next use comes before the farthest next use of a resident
    expert (evicting that one, or into a free slot), else bypassed. CPU routes are its
    bypasses; fetched_routes its admissions.

    Cold (the default) starts empty, as the online policies do. `warm` lets the cache start
    with any experts placed for free before decode (what `static` does): then filling a free
    slot counts as a hit, which gives the optimum over every initial placement too (the
    optimal placement holds the experts used first).
    """
    flat = _flat_routes(trace)  # [N] row-major over calls
    nxt = _next_use(flat)
    result = SimResult({layer: ExpertCacheStats() for layer in range(trace.num_layers)}, 0)
    result.tokens = trace.num_rows
    layers = (flat // trace.num_experts).tolist()
    resident: dict[int, int] = {}  # flat -> its next use
    farthest: list[tuple[int, int]] = []  # max-heap of (-next use, flat), lazily pruned
    for i, (item, nxt_i) in enumerate(zip(flat.tolist(), nxt.tolist(), strict=True)):
        stats = result.stats_by_layer[layers[i]]
        stats.routes += 1
        if item in resident:
            stats.hits += 1
        elif len(resident) < num_slots:
            if warm:
                stats.hits += 1  # placed before decode
            else:
                stats.fetched_routes += 1
                stats.fetched += 1
        else:
            while -farthest[0][0] != resident.get(farthest[0][1]):
                heapq.heappop(farthest)
            far_next, far_item = -farthest[0][0], farthest[0][1]
            if nxt_i >= far_next:
                stats.cpu_routes += 1
                continue
            heapq.heappop(farthest)
            del resident[far_item]
            stats.fetched_routes += 1
            stats.fetched += 1
            stats.evictions += 1
        resident[item] = nxt_i
        heapq.heappush(farthest, (-nxt_i, item))
    return result


def _flat_routes(trace: RoutingTrace) -> np.ndarray:
    """Every route's flat id `layer * E + expert`, in replay order: [N] int64."""
    parts = [
        ids.reshape(-1).astype(np.int64) + layer * trace.num_experts for layer, ids in trace.calls()
    ]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _next_use(flat: np.ndarray) -> np.ndarray:
    """For each position, the next position requesting the same item (len(flat) if none)."""
    nxt = np.full(flat.size, flat.size, dtype=np.int64)
    last: dict[int, int] = {}
    for i in range(flat.size - 1, -1, -1):
        item = int(flat[i])
        nxt[i] = last.get(item, flat.size)
        last[item] = i
    return nxt
