"""LruSlots (the numba policy) against LruSlotsReference (dicts), call by call: the same slots,
CPU routes, planned copies, residents, stats, fetch-policy questions and errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.moe.lru_slots import LruSlots, LruSlotsReference


class RecordingCap:
    """A FetchPolicy that answers from the counts it is asked with, and records them."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int, int]] = []

    def fetch_count(self, layer_idx: int, hits: int, misses: int) -> int:
        self.asked.append((layer_idx, hits, misses))
        return (hits + 2 * misses + layer_idx) % 4


def snapshot(policy) -> tuple:
    return (
        policy.pending(),
        policy.resident(),
        [policy.stats(layer) for layer in range(policy.layers)],
    )


def call(policy, layer: int, ids: list[int], cap) -> tuple:
    """(rewritten ids, CPU routes) or the error's message."""
    array = np.array(ids, dtype=np.int64)
    try:
        cpu_routes = policy.ensure(layer, array, cap)
    except ValueError as err:
        return ("error", str(err), ids == array.tolist())  # nothing changed on an error
    return array.tolist(), cpu_routes


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    layers=st.integers(1, 3),
    experts=st.integers(1, 9),
    slots=st.integers(1, 14),
    routes=st.integers(1, 12),
    cap=st.sampled_from([0, 1, 2, 5, None, "policy"]),
)
def test_the_numba_policy_decides_as_the_reference(seed, layers, experts, slots, routes, cap):
    rng = np.random.default_rng(seed)
    slots = min(slots, layers * experts)
    fast, reference = LruSlots(layers, experts, slots), LruSlotsReference(layers, experts, slots)
    caps = (RecordingCap(), RecordingCap()) if cap == "policy" else (cap, cap)
    for _ in range(30):
        layer = int(rng.integers(layers))
        hot = int(rng.integers(1, experts + 1))  # a skewed draw: repeats and hits
        ids = rng.integers(-1, hot, size=routes).tolist()
        if rng.random() < 0.05:
            ids[int(rng.integers(routes))] = experts + int(rng.integers(3))  # out of range
        assert call(fast, layer, ids, caps[0]) == call(reference, layer, ids, caps[1])
        if rng.random() < 0.6:  # copy_missing; otherwise plans pile up across calls
            assert fast.pending() == reference.pending()
            fast.clear_pending()
            reference.clear_pending()
        assert snapshot(fast) == snapshot(reference)
        if rng.random() < 0.03:
            fast.reset_stats()
            reference.reset_stats()
    if cap == "policy":
        assert caps[0].asked == caps[1].asked


@pytest.mark.parametrize("policy", [LruSlots, LruSlotsReference])
def test_an_evicted_plan_is_replaced_by_the_later_one(policy):
    slots = policy(1, 4, 1)
    assert call(slots, 0, [2], 1) == ([0], 0)
    assert call(slots, 0, [3], 1) == ([0], 0)  # slot 0's planned copy of 2 is now one of 3
    assert slots.pending() == [(0, 3)] and slots.resident() == {0: 3}
    assert slots.stats(0).evictions == 1 and slots.stats(0).fetched == 2


@pytest.mark.parametrize("policy", [LruSlots, LruSlotsReference])
def test_errors_change_nothing(policy):
    slots = policy(2, 4, 2)
    call(slots, 1, [0, 1], 2)
    before = snapshot(slots)
    assert call(slots, 0, [1, 4], 2) == (
        "error",
        "layer 0: expert id 4 out of range (the layer has 4 experts)",
        True,
    )
    message = "needs 3 expert slots (layer 1 routes to 3 distinct experts)"
    result = call(slots, 1, [0, 1, 2], None)
    assert result[0] == "error" and message in result[1] and result[2]
    assert snapshot(slots) == before
