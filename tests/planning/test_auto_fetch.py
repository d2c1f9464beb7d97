"""`--max-fetch auto`: the balanced count against a brute-force search, the online CPU cost,
the cache honouring the policy, and exact tokens against every fixed max_fetch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.moe.cpu_executor import CpuLayerStats
from hybridmoe.moe.fetch_policy import AutoFetch, FetchCosts, balanced_fetch_count
from hybridmoe.moe.offload_cache import OffloadMoeCache
from hybridmoe.quant.bank import ExpertBank

costs_st = st.builds(
    FetchCosts,
    fetch_s=st.floats(0, 10),
    accel_expert_s=st.floats(0, 10),
    cpu_expert_s=st.floats(0, 10),
    cpu_job_s=st.floats(0, 5),
)


@settings(max_examples=200, deadline=None)
@given(hits=st.integers(0, 8), misses=st.integers(0, 8), costs=costs_st, overlap=st.booleans())
def test_balanced_count_is_the_best_split(hits, misses, costs, overlap):
    f = balanced_fetch_count(hits, misses, costs, overlap)
    assert 0 <= f <= misses
    times = [costs.step_s(hits, g, misses - g, overlap) for g in range(misses + 1)]
    assert times[f] == min(times)
    # never slower than either pure split
    assert times[f] <= times[0] and times[f] <= times[misses]


def test_balance_point():
    costs = FetchCosts(fetch_s=2.0, accel_expert_s=1.0, cpu_expert_s=3.0)
    # f fetched: accel (2 + f) + 2 f, cpu 3 (6 - f): f = 2 -> max(8, 12); 3 -> max(11, 9)
    assert balanced_fetch_count(2, 6, costs) == 3
    assert balanced_fetch_count(0, 4, FetchCosts(100.0, 1.0, 1.0)) == 0  # fetching too slow
    assert balanced_fetch_count(0, 4, FetchCosts(0.0, 0.0, 1.0)) == 4  # the accelerator is free


def test_cpu_cost_follows_the_executor_stats():
    policy = AutoFetch(FetchCosts(fetch_s=1.0, accel_expert_s=1.0, cpu_expert_s=1.0), ema=0.5)
    stats = {0: CpuLayerStats()}
    policy.attach(stats)
    stats[0].routes, stats[0].busy_s = 4, 40.0  # measured: 10 s per route
    policy.fetch_count(0, 0, 2)
    assert policy.costs.cpu_expert_s == pytest.approx(5.5)
    stats.clear()  # the runtime's reset_stats: a new baseline, no negative deltas
    stats[0] = CpuLayerStats(routes=1, busy_s=1.0)
    policy.fetch_count(0, 0, 2)
    assert policy.costs.cpu_expert_s == pytest.approx(3.25)


class FixedCount:
    def __init__(self, n: int):
        self.n, self.asked = n, []

    def fetch_count(self, layer_idx: int, hits: int, misses: int) -> int:
        self.asked.append((layer_idx, hits, misses))
        return self.n


def test_the_cache_asks_the_policy_with_the_calls_counts():
    bank = ExpertBank(gate_up=torch.zeros(6, 4, 4), down=torch.zeros(6, 4, 2))
    policy = FixedCount(1)
    cache = OffloadMoeCache([bank, bank], num_slots=4, max_fetch=policy)
    ids = torch.tensor([[0, 1, 2]])
    cache.ensure_experts_hybrid(0, ids)
    assert policy.asked == [(0, 0, 3)] and (ids >= 0).sum() == 1
    ids = torch.tensor([[0, 1, 2]])
    cache.ensure_experts_hybrid(0, ids)
    assert policy.asked[-1] == (0, 1, 2)


@pytest.mark.parametrize("slots", [2, 10, 30])
def test_auto_gives_the_tokens_of_every_fixed_cap(demo_checkpoint: Path, slots):
    prompt, params = [[3, 99, 512, 7]], SamplingParams(max_tokens=8, ignore_eos=True)
    tokens = {}
    for cap in (0, 1, 2, "auto"):
        offload = OffloadConfig(decode_target="hybrid", expert_cache_slots=slots, max_fetch=cap)
        with Engine.from_pretrained(demo_checkpoint, EngineConfig(offload=offload)) as engine:
            tokens[cap] = engine.generate_ids(prompt, params)
    assert tokens["auto"] == tokens[0] == tokens[1] == tokens[2]


def test_bad_max_fetch_is_refused():
    with pytest.raises(ValueError, match="max_fetch must be an integer >= 0 or 'auto'"):
        OffloadConfig(max_fetch="sometimes")
