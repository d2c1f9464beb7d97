"""The simulator against the real OffloadMoeCache (identical counts), LRU against a brute-force
model, and Belady's bound against every policy and an exhaustive search."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.moe.cache_stats import ExpertCacheStats
from hybridmoe.moe.fetch_policy import AutoFetch, FetchCosts
from hybridmoe.moe.offload_cache import OffloadMoeCache
from hybridmoe.planning.policies import LruPolicy
from hybridmoe.planning.simulator import POLICIES, belady, create_policy, simulate
from hybridmoe.planning.trace import RoutingTrace
from hybridmoe.quant.bank import ExpertBank
from planning.traces import random_trace

SHIPPED_TRACE = Path(__file__).parents[1] / "data" / "demo_trace.npz"
H, I = 4, 2  # noqa: E741  (tiny experts: only the cache's bookkeeping matters)


def real_cache_stats(trace: RoutingTrace, slots: int, max_fetch) -> dict[int, ExpertCacheStats]:
    """Replay `trace` through OffloadMoeCache on the cpu device: hybrid (or offload for None)."""
    bank = ExpertBank(
        gate_up=torch.zeros(trace.num_experts, 2 * I, H), down=torch.zeros(trace.num_experts, H, I)
    )
    cache = OffloadMoeCache([bank] * trace.num_layers, slots, 0 if max_fetch is None else max_fetch)
    for layer, ids in trace.calls():
        ids_t = torch.from_numpy(ids.astype("int64"))
        if max_fetch is None:
            cache.ensure_experts(layer, ids_t)
        else:
            cache.ensure_experts_hybrid(layer, ids_t)
        cache.copy_missing()
    stats_by_layer = cache.stats_by_layer  # a snapshot
    for stats in stats_by_layer.values():
        stats.bytes_copied = 0  # the simulator counts experts; bytes are fetched * nbytes
    return stats_by_layer


def auto_policy() -> AutoFetch:
    return AutoFetch(FetchCosts(fetch_s=2.0, accel_expert_s=1.0, cpu_expert_s=3.0))


CAPS = [0, 1, 2, None, "auto"]


def cap_value(cap):
    return auto_policy() if cap == "auto" else cap


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    layers=st.integers(1, 3),
    experts=st.integers(2, 6),
    top_k=st.integers(1, 2),
    rows=st.integers(1, 2),
    slots=st.integers(1, 12),
    cap=st.sampled_from(CAPS),
)
def test_lru_replay_equals_the_real_cache(seed, layers, experts, top_k, rows, slots, cap):
    slots = min(slots, layers * experts)
    if cap is None:  # offload: one call's distinct experts must fit
        slots = max(slots, min(rows * top_k, experts))
    trace = random_trace(seed, layers, experts, top_k, steps=12, rows=rows)
    simulated = simulate(trace, LruPolicy(slots), cap_value(cap)).stats_by_layer
    assert simulated == real_cache_stats(trace, slots, cap_value(cap))


@pytest.mark.skipif(not SHIPPED_TRACE.exists(), reason="tests/data/demo_trace.npz not built")
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("share", [0.1, 0.25, 0.5])
def test_shipped_trace_replay_equals_the_real_cache(cap, share):
    trace = RoutingTrace.load(SHIPPED_TRACE).head(600)
    slots = max(trace.top_k, round(share * trace.num_layers * trace.num_experts))
    simulated = simulate(trace, LruPolicy(slots), cap_value(cap)).stats_by_layer
    assert simulated == real_cache_stats(trace, slots, cap_value(cap))


def brute_force_lru_hits(trace: RoutingTrace, slots: int) -> int:
    """LRU with every miss fetched, as a list (most recent last), one call at a time: T=1."""
    order: list[int] = []
    hits = 0
    for layer, ids in trace.calls():
        wanted = [layer * trace.num_experts + int(e) for e in ids.reshape(-1)]
        hit = [f for f in wanted if f in order]
        hits += len(hit)
        for f in hit:
            order.remove(f)
            order.append(f)
        for f in wanted:
            if f not in order:
                if len(order) == slots:
                    order.pop(0)  # the call's own experts are at the end: never evicted
                order.append(f)
    return hits


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), experts=st.integers(2, 6), slots=st.integers(2, 10))
def test_lru_equals_a_brute_force_model(seed, experts, slots):
    trace = random_trace(seed, 2, experts, 2, steps=20)
    slots = min(slots, 2 * experts)
    result = simulate(trace, LruPolicy(slots), None)
    assert result.total.hits == brute_force_lru_hits(trace, slots)


def misses(stats: ExpertCacheStats) -> int:
    return stats.routes - stats.hits


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    layers=st.integers(1, 3),
    experts=st.integers(2, 8),
    top_k=st.integers(1, 2),
    rows=st.integers(1, 2),
    slots=st.integers(1, 16),
    skew=st.sampled_from([0.0, 1.0, 2.0]),
)
def test_belady_misses_no_more_than_any_policy(seed, layers, experts, top_k, rows, slots, skew):
    slots = min(slots, layers * experts)
    trace = random_trace(seed, layers, experts, top_k, steps=15, rows=rows, skew=skew)
    cold, warm = (misses(belady(trace, slots, w).total) for w in (False, True))
    assert warm <= cold
    for name in POLICIES:
        # static placement is made before decode: compared with the warm-start bound
        bound = warm if name == "static" else cold
        for cap in CAPS:
            if cap is None and slots < min(rows * top_k, experts):
                continue
            result = simulate(trace, create_policy(name, trace, slots), cap_value(cap))
            assert bound <= misses(result.total), (name, cap)


def exhaustive_min_misses(requests: tuple[int, ...], slots: int, warm: bool = False) -> int:
    """The fewest misses over every admit/bypass/evict choice (and with `warm`, every initial
    placement): a search over cache states."""

    @functools.cache
    def best(i: int, cached: frozenset[int]) -> int:
        if i == len(requests):
            return 0
        item = requests[i]
        if item in cached:
            return best(i + 1, cached)
        options = [best(i + 1, cached)]  # bypass
        if len(cached) < slots:
            options.append(best(i + 1, cached | {item}))
        else:
            options += [best(i + 1, (cached - {v}) | {item}) for v in cached]
        return 1 + min(options)

    if not warm:
        return best(0, frozenset())
    items = sorted(set(requests))
    starts = itertools.combinations(items, min(slots, len(items)))
    return min(best(0, frozenset(start)) for start in starts)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    experts=st.integers(2, 5),
    slots=st.integers(1, 4),
    warm=st.booleans(),
)
def test_belady_is_optimal(seed, experts, slots, warm):
    trace = random_trace(seed, 1, experts, 1, steps=14, skew=0.5)
    requests = tuple(int(e) for e in trace.expert_ids.reshape(-1))
    found = misses(belady(trace, slots, warm).total)
    assert found == exhaustive_min_misses(requests, slots, warm)


def test_counts_add_up_per_policy():
    trace = random_trace(3, 3, 8, 2, steps=40)
    for name in POLICIES:
        stats = simulate(trace, create_policy(name, trace, 6), 1).total
        assert stats.hits + stats.fetched_routes + stats.cpu_routes == stats.routes == 240
    static = simulate(trace, create_policy("static", trace, 6), 2).total
    assert static.fetched == 0
