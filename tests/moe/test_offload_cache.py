"""OffloadMoeCache: slot rewriting, global LRU, fetch cap, stats, validation; property tests
against a naive reference LRU; hybrid wiring checked against `moe_reference`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.layers.moe import moe_reference
from hybridmoe.moe.cache_stats import ExpertCacheStats
from hybridmoe.moe.hybrid_decode import HybridDecodeExecutor, HybridDecodeRequest
from hybridmoe.moe.offload_cache import OffloadMoeCache
from hybridmoe.quant.bank import ExpertBank, ExpertWeights

LAYERS, E, H, I = 3, 6, 8, 4  # noqa: E741


def resident(cache: OffloadMoeCache) -> list[tuple[int, int]]:
    """(layer, expert) of every occupied slot, in slot order."""
    slots = cache.resident()
    return [divmod(slots[slot], cache.num_experts) for slot in sorted(slots)]


def slot_of(cache: OffloadMoeCache, layer: int, expert: int) -> int | None:
    """The slot holding (or planned to hold) the expert, None if not resident."""
    flat = layer * cache.num_experts + expert
    return next((slot for slot, held in cache.resident().items() if held == flat), None)


def make_banks(layers: int = LAYERS, dtype: torch.dtype = torch.float32) -> list[ExpertBank]:
    g = torch.Generator().manual_seed(0)
    return [
        ExpertBank(
            gate_up=torch.randn(E, 2 * I, H, generator=g).to(dtype),
            down=torch.randn(E, H, I, generator=g).to(dtype),
        )
        for _ in range(layers)
    ]


BANKS = make_banks()
EXPERT_NBYTES = BANKS[0].expert_nbytes


def make_cache(num_slots: int, max_fetch: int = LAYERS * E) -> OffloadMoeCache:
    return OffloadMoeCache(BANKS, num_slots=num_slots, max_fetch=max_fetch)


def hybrid(cache: OffloadMoeCache, layer: int, rows: list[list[int]]) -> list[list[int]]:
    ids = torch.tensor(rows, dtype=torch.int64)
    cache.ensure_experts_hybrid(layer, ids)
    return ids.tolist()


def offload(cache: OffloadMoeCache, layer: int, rows: list[list[int]]) -> list[list[int]]:
    ids = torch.tensor(rows, dtype=torch.int64)
    cache.ensure_experts(layer, ids)
    return ids.tolist()


def test_misses_fill_free_slots_lowest_first_and_hits_keep_their_slot():
    cache = make_cache(num_slots=4)
    assert hybrid(cache, 0, [[0, 1]]) == [[0, 1]]
    assert hybrid(cache, 0, [[2, 0]]) == [[2, 0]]
    assert resident(cache) == [(0, 0), (0, 1), (0, 2)]
    s = cache.stats_by_layer[0]
    assert (s.routes, s.hits, s.fetched, s.fetched_routes, s.cpu_routes) == (4, 1, 3, 3, 0)
    assert s.evictions == 0 and s.hit_rate == 0.25


def test_lru_evicts_the_least_recently_used_slot():
    cache = make_cache(num_slots=3, max_fetch=1)
    assert [hybrid(cache, 0, [[e]]) for e in (0, 1, 2)] == [[[0]], [[1]], [[2]]]
    assert hybrid(cache, 0, [[0]]) == [[0]]  # hit: LRU order now slots 1, 2, 0
    assert hybrid(cache, 0, [[3]]) == [[1]]  # evicts expert 1 from slot 1
    assert resident(cache) == [(0, 0), (0, 3), (0, 2)]
    assert hybrid(cache, 0, [[1]]) == [[2]]  # order was 2, 0, 1: evicts expert 2
    assert slot_of(cache, 0, 2) is None and slot_of(cache, 0, 1) == 2
    assert cache.stats_by_layer[0].evictions == 2


def test_max_fetch_zero_sends_every_miss_to_the_cpu_but_keeps_hits():
    cache = make_cache(num_slots=4, max_fetch=0)
    assert hybrid(cache, 0, [[0, 1], [2, 0]]) == [[-1, -1], [-1, -1]]
    assert resident(cache) == []
    assert offload(cache, 0, [[3]]) == [[0]]  # offload ignores the cap
    assert hybrid(cache, 0, [[3, 4]]) == [[0, -1]]
    s = cache.stats_by_layer[0]
    assert (s.routes, s.hits, s.cpu_routes, s.fetched) == (7, 1, 5, 1)


def test_max_fetch_one_fetches_the_most_frequent_miss():
    cache = make_cache(num_slots=4, max_fetch=1)
    assert hybrid(cache, 0, [[1, 2], [2, 3], [3, 2]]) == [[-1, 0], [0, -1], [-1, 0]]
    assert cache.stats_by_layer[0].fetched == 1


def test_fetch_ties_are_broken_by_first_appearance():
    cache = make_cache(num_slots=4, max_fetch=1)
    assert hybrid(cache, 1, [[5, 4], [4, 5]]) == [[0, -1], [-1, 0]]


def test_a_slot_used_by_this_call_is_never_evicted():
    cache = make_cache(num_slots=2, max_fetch=3)
    assert hybrid(cache, 0, [[0, 1, 2]]) == [[0, 1, -1]]  # no free or evictable slot for 2
    assert hybrid(cache, 0, [[0, 2, 3]]) == [[0, 1, -1]]  # 2 evicts 1; 0 and 2 are protected
    s = cache.stats_by_layer[0]
    assert (s.hits, s.fetched, s.cpu_routes, s.evictions) == (1, 3, 2, 1)


def test_the_slot_pool_is_shared_across_layers():
    cache = make_cache(num_slots=2, max_fetch=2)
    hybrid(cache, 0, [[0]])
    hybrid(cache, 0, [[1]])
    assert hybrid(cache, 1, [[0]]) == [[0]]  # evicts layer 0's least recently used expert 0
    assert slot_of(cache, 0, 0) is None and slot_of(cache, 1, 0) == 0
    assert resident(cache) == [(1, 0), (0, 1)]
    assert cache.stats_by_layer[1].evictions == 1 and cache.stats_by_layer[0].evictions == 0


def test_duplicates_share_a_slot_and_negative_ids_stay_minus_one():
    cache = make_cache(num_slots=3, max_fetch=1)
    assert hybrid(cache, 0, [[3, 3], [3, 5], [-1, 5], [-1, -1]]) == [
        [0, 0],
        [0, -1],
        [-1, -1],
        [-1, -1],
    ]
    s = cache.stats_by_layer[0]
    assert (s.routes, s.fetched, s.fetched_routes, s.cpu_routes) == (5, 1, 3, 2)


def test_copy_missing_loads_the_bank_weights_into_the_slots():
    cache = make_cache(num_slots=4)
    hybrid(cache, 0, [[1, 4]])
    hybrid(cache, 2, [[5, 1]])
    cache.copy_missing()
    for layer, expert in resident(cache):
        slot = slot_of(cache, layer, expert)
        assert torch.equal(cache.gate_up_slots[slot], BANKS[layer].gate_up[expert])
        assert torch.equal(cache.down_slots[slot], BANKS[layer].down[expert])
    cache.gate_up_slots.zero_()
    cache.copy_missing()  # the plan was cleared: nothing is copied again
    assert not cache.gate_up_slots.any()


def test_stats_per_layer_and_total():
    cache = make_cache(num_slots=3, max_fetch=1)
    hybrid(cache, 0, [[0, 1]])  # fetch 0, 1 -> cpu
    hybrid(cache, 1, [[2, 0]])  # fetch 2, 0 -> cpu
    hybrid(cache, 0, [[0, 1]])  # hit 0, fetch 1
    hybrid(cache, 1, [[3]])  # evicts layer 0 expert 0
    expected = {
        0: ExpertCacheStats(4, 1, 2, 1, 2, 0, 2 * EXPERT_NBYTES),
        1: ExpertCacheStats(3, 0, 2, 1, 2, 1, 2 * EXPERT_NBYTES),
        2: ExpertCacheStats(),
    }
    assert cache.stats_by_layer == expected
    total = cache.total_stats()
    assert total == ExpertCacheStats(7, 1, 4, 2, 4, 1, 4 * EXPERT_NBYTES)
    assert total.bytes_copied == total.fetched * EXPERT_NBYTES
    assert total.hit_rate == pytest.approx(1 / 7) and ExpertCacheStats().hit_rate == 0.0


def test_reset_stats_keeps_residency_and_reset_drops_it():
    cache = make_cache(num_slots=2)
    hybrid(cache, 0, [[0, 1]])
    cache.reset_stats()
    assert cache.total_stats() == ExpertCacheStats()
    assert hybrid(cache, 0, [[1]]) == [[1]] and cache.stats_by_layer[0].hits == 1
    cache.reset()
    assert resident(cache) == [] and cache.total_stats() == ExpertCacheStats()
    assert hybrid(cache, 0, [[1]]) == [[0]]  # a miss again, into the lowest free slot


def test_ids_are_rewritten_in_place_through_views():
    cache = make_cache(num_slots=4)
    ids = torch.tensor([[2, 3], [3, -1]])
    storage = ids.data_ptr()
    assert cache.ensure_experts_hybrid(0, ids) == 0  # every valid route has a slot
    assert ids.data_ptr() == storage and ids.tolist() == [[1, 0], [0, -1]]  # 3 is fetched first
    base = torch.tensor([[4, 9, 5], [5, 9, 4]])
    cache.ensure_experts(1, base[:, ::2])  # a strided view: the base tensor changes
    assert base.tolist() == [[2, 9, 3], [3, 9, 2]]


@pytest.mark.parametrize(
    "num_slots, max_fetch, match",
    [(0, 1, "num_slots"), (LAYERS * E + 1, 1, "num_slots"), (2, -1, "max_fetch")],
)
def test_bad_sizes_are_rejected(num_slots, max_fetch, match):
    with pytest.raises(ValueError, match=match):
        OffloadMoeCache(BANKS, num_slots=num_slots, max_fetch=max_fetch)


def test_mismatched_banks_are_rejected_naming_the_layer():
    bad_shape = ExpertBank(torch.zeros(E, 2 * I, H + 1), torch.zeros(E, H + 1, I))
    with pytest.raises(ValueError, match="layer 2.*shapes"):
        OffloadMoeCache([*BANKS[:2], bad_shape], num_slots=2, max_fetch=1)
    other_format = make_banks(layers=1, dtype=torch.bfloat16)[0]  # accepted: slots fit both
    cache = OffloadMoeCache([BANKS[0], other_format], num_slots=2, max_fetch=1)
    ids = torch.tensor([[3]])
    cache.ensure_experts(1, ids)
    cache.copy_missing()
    assert torch.equal(cache.slot_bank_for(1).down[ids[0, 0]], other_format.down[3])
    with pytest.raises(ValueError, match="ExpertBank"):
        OffloadMoeCache([], num_slots=1, max_fetch=1)


def test_offload_step_needing_more_slots_than_exist_is_rejected_unchanged():
    cache = make_cache(num_slots=2)
    ids = torch.tensor([[0, 1], [2, 1]])
    with pytest.raises(ValueError, match="needs 3 expert slots.*expert_cache_slots is 2"):
        cache.ensure_experts(0, ids)
    assert ids.tolist() == [[0, 1], [2, 1]] and resident(cache) == []
    assert OffloadMoeCache.min_slots(top_k=2, tokens=2) == 4
    assert OffloadMoeCache.min_slots(top_k=4, tokens=8, num_experts=E) == E


def test_out_of_range_layer_or_expert_is_rejected():
    cache = make_cache(num_slots=2)
    with pytest.raises(IndexError, match="layer_idx 3"):
        cache.ensure_experts_hybrid(3, torch.tensor([[0]]))
    with pytest.raises(ValueError, match="expert id 6"):
        cache.ensure_experts_hybrid(0, torch.tensor([[6]]))


class FakeCpuExecutor:
    """Computes the CPU routes synchronously with the reference math on the host banks."""

    def __init__(self) -> None:
        self.pending: dict[int, torch.Tensor] = {}

    def decode_submit(self, layer_idx, hidden_states, cpu_expert_ids, topk_weights, routes=None):
        assert routes == int((cpu_expert_ids >= 0).sum())  # the cache's count, on the host
        experts = bank_experts(BANKS[layer_idx])
        self.pending[layer_idx] = moe_reference(
            hidden_states, cpu_expert_ids, topk_weights, experts
        )

    def decode_sync(self, layer_idx):
        return self.pending.pop(layer_idx)


def bank_experts(bank: ExpertBank) -> ExpertWeights:
    return bank.views()


def slot_runner(cache: OffloadMoeCache):
    def run(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate_up = torch.einsum("th,tkih->tki", x, cache.gate_up_slots[slots])  # [T, K, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, cache.down_slots[slots])
        return torch.einsum("tkh,tk->th", y, weights)

    return run


@pytest.mark.parametrize("overlap", [True, False])
def test_a_hybrid_executor_over_the_cache_decodes_exactly(overlap):
    cache = make_cache(num_slots=3, max_fetch=1)
    fake = FakeCpuExecutor()
    executor = HybridDecodeExecutor(cache, fake, overlap)
    assert not hasattr(cache, "hybrid_executor") and not hasattr(cache, "cpu_executor")
    g = torch.Generator().manual_seed(1)
    for layer, rows in [(0, [[1, 2], [2, 3]]), (1, [[1, 2], [2, 3]]), (0, [[2, 4], [5, 1]])]:
        ids = torch.tensor(rows)
        x, weights = torch.randn(2, H, generator=g), torch.rand(2, 2, generator=g)
        expected = moe_reference(x, ids, weights, bank_experts(BANKS[layer]))
        out = executor.decode(HybridDecodeRequest(layer, x, ids, weights), slot_runner(cache))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert cache.total_stats().cpu_routes > 0 and cache.total_stats().fetched > 0


class NaiveLru:
    """The policy written as plainly as possible: lists, linear scans, sorting by keys."""

    def __init__(self, num_slots: int) -> None:
        self.slots: list[tuple[int, int] | None] = [None] * num_slots
        self.order: list[int] = []  # occupied slots, least recently used first

    def call(self, layer: int, rows: list[list[int]], cap: int | None) -> list[list[int]]:
        flat = [e for row in rows for e in row if e >= 0]
        distinct = sorted(set(flat), key=lambda e: (-flat.count(e), flat.index(e)))
        used = {}
        for e in sorted(distinct, key=flat.index):  # hits, touched in first-seen order
            if (layer, e) in self.slots:
                used[e] = self._touch(self.slots.index((layer, e)))
        misses = [e for e in distinct if e not in used]
        for e in misses if cap is None else misses[:cap]:
            free = [s for s, held in enumerate(self.slots) if held is None]
            victims = [s for s in self.order if s not in used.values()]
            if not free and not victims:
                break
            slot = free[0] if free else victims[0]
            self.slots[slot] = (layer, e)
            used[e] = self._touch(slot)
        return [[used.get(e, -1) for e in row] for row in rows]

    def _touch(self, slot: int) -> int:
        if slot in self.order:
            self.order.remove(slot)
        self.order.append(slot)
        return slot


calls_strategy = st.lists(
    st.tuples(
        st.integers(0, LAYERS - 1),
        st.integers(1, 3).flatmap(
            lambda k: st.lists(
                st.lists(st.integers(-1, E - 1), min_size=k, max_size=k), min_size=1, max_size=3
            )
        ),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, LAYERS * E), st.integers(0, 5), calls_strategy)
def test_hybrid_routes_are_slots_holding_the_expert_or_cpu(num_slots, max_fetch, calls):
    cache, naive = make_cache(num_slots, max_fetch), NaiveLru(num_slots)
    for layer, rows in calls:
        before = {e: slot_of(cache, layer, e) for e in range(E)}
        stats_before = ExpertCacheStats.merged([cache.stats_by_layer[layer]])
        free_before = num_slots - len(resident(cache))
        ids = torch.tensor(rows)
        cpu_routes = cache.ensure_experts_hybrid(layer, ids)
        cache.copy_missing()
        out = ids.tolist()
        assert out == naive.call(layer, rows, max_fetch)
        flat = [
            (e, slot)
            for row, slots in zip(rows, out, strict=True)
            for e, slot in zip(row, slots, strict=True)
        ]
        assert cpu_routes == sum(e >= 0 and slot < 0 for e, slot in flat)
        assert resident(cache) == [held for held in naive.slots if held is not None]
        fetched = check_routes(cache, layer, rows, out, before)
        assert len(fetched) <= max_fetch
        check_stats_delta(cache, layer, rows, out, before, fetched, stats_before)
        evictions = cache.stats_by_layer[layer].evictions - stats_before.evictions
        assert evictions == max(0, len(fetched) - free_before)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, LAYERS * E), calls_strategy)
def test_offload_routes_always_land_in_slots(num_slots, calls):
    cache, naive = make_cache(num_slots, max_fetch=0), NaiveLru(num_slots)
    for layer, rows in calls:
        ids = torch.tensor(rows)
        if len({e for row in rows for e in row if e >= 0}) > num_slots:
            with pytest.raises(ValueError, match="expert_cache_slots"):
                cache.ensure_experts(layer, ids)
            assert ids.tolist() == rows
            continue
        before = {e: slot_of(cache, layer, e) for e in range(E)}
        cache.ensure_experts(layer, ids)
        cache.copy_missing()
        assert ids.tolist() == naive.call(layer, rows, None)
        check_routes(cache, layer, rows, ids.tolist(), before)
        original = torch.tensor(rows)
        valid = original >= 0
        assert ((ids >= 0) == valid).all()
        slots, experts = ids.clamp(min=0), original.clamp(min=0)
        assert torch.equal(cache.gate_up_slots[slots][valid], BANKS[layer].gate_up[experts][valid])
        assert torch.equal(cache.down_slots[slots][valid], BANKS[layer].down[experts][valid])


def check_routes(cache, layer, rows, out, before) -> set[int]:
    """Every route is -1 or a slot holding exactly its expert; one expert per slot; resident
    experts stay hits. Returns the experts fetched by the call."""
    expert_in_slot: dict[int, int] = {}
    fetched = set()
    for expert, slot in zip(sum(rows, []), sum(out, []), strict=True):
        if expert < 0 or slot < 0:
            assert slot == -1 and before.get(expert) is None
            continue
        assert 0 <= slot < cache.num_slots and slot_of(cache, layer, expert) == slot
        assert expert_in_slot.setdefault(slot, expert) == expert
        assert torch.equal(cache.gate_up_slots[slot], BANKS[layer].gate_up[expert])
        assert torch.equal(cache.down_slots[slot], BANKS[layer].down[expert])
        if before[expert] is None:
            fetched.add(expert)
        else:
            assert before[expert] == slot
    return fetched


def check_stats_delta(cache, layer, rows, out, before, fetched, stats_before) -> None:
    routes = [(e, s) for e, s in zip(sum(rows, []), sum(out, []), strict=True) if e >= 0]
    s = cache.stats_by_layer[layer]
    d = {f: getattr(s, f) - getattr(stats_before, f) for f in vars(s)}
    assert d["routes"] == len(routes)
    assert d["hits"] == sum(before[e] is not None for e, _ in routes)
    assert d["cpu_routes"] == sum(slot < 0 for _, slot in routes)
    assert d["fetched"] == len(fetched) and d["fetched_routes"] == sum(
        e in fetched for e, _ in routes
    )
    assert d["hits"] + d["fetched_routes"] + d["cpu_routes"] == d["routes"]
    assert d["bytes_copied"] == d["fetched"] * EXPERT_NBYTES
