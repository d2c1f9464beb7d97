"""The expert cache's slot policy (OffloadMoeCache's): one global LRU over every layer's experts,
keyed by the flat id `layer * E + expert`, deciding per call which routes hit a slot, which
misses are fetched (at most the cap; most routes first, ties in first-appearance order) and
which go to the CPU.

Two implementations of the same decisions: LruSlots, one numba call a layer call
(kernels/numba_lru.py), and LruSlotsReference, dicts and an OrderedDict, kept as the reference
the tests compare it with call by call (slots, plans, stats).

`ensure(layer, ids, cap)` rewrites the int64 host array `ids` [n] in place: a slot that holds
the expert once the planned copies are made, or -1 (a CPU route, or an input id < 0, left at
-1 and counted nowhere); duplicates of an expert share its slot; a slot the call uses (a hit
or one of its fetches) is never evicted by that same call. Victims: the lowest free slot
first, else the least recently used slot. Hits are touched in order of first appearance, then
fetches. Returns the routes (ids >= 0) given to the CPU. `cap`: an int, None (fetch every miss,
ValueError and nothing changed when the call's distinct experts outnumber the slots), or a
FetchPolicy asked with the call's distinct hits and misses. ValueError, nothing changed, for
an id >= E.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import fields

import numpy as np

from hybridmoe.kernels import numba_lru
from hybridmoe.moe.cache_stats import ExpertCacheStats
from hybridmoe.moe.fetch_policy import FetchPolicy

FetchCap = int | None | FetchPolicy
_COUNTED = [f.name for f in fields(ExpertCacheStats)][: numba_lru.STATS]  # bytes_copied aside


class LruSlots:
    """The policy on numba arrays (kernels/numba_lru.py)."""

    def __init__(self, layers: int, experts: int, slots: int) -> None:
        self.layers, self.experts, self.slots = layers, experts, slots
        self.reset()

    def reset(self) -> None:
        """Nothing resident, nothing planned, stats zero."""
        self._state = numba_lru.new_state(self.slots, self.layers * self.experts)
        self._state_at = self._state.ctypes.data
        _, self._flat_of_slot_at, _, _, self._pending_flat_at, self._pending_slots_at, _ = (
            numba_lru.sections(self.slots, self.layers * self.experts)
        )
        self._info = np.zeros(4, dtype=np.int64)
        self._info_at = self._info.ctypes.data
        self._stats = np.zeros((self.layers, numba_lru.STATS), dtype=np.int64)
        self._stats_at = self._stats.ctypes.data

    def reset_stats(self) -> None:
        self._stats[:] = 0

    def ensure(self, layer_idx: int, ids: np.ndarray, cap: FetchCap) -> int:
        return self.ensure_at(layer_idx, ids.ctypes.data, ids.size, cap)

    def ensure_at(self, layer_idx: int, ids_at: int, n: int, cap: FetchCap) -> int:
        """ensure() on the n int64 ids at address `ids_at` (contiguous host memory)."""
        if cap is None:
            cap = numba_lru.UNLIMITED
        elif not isinstance(cap, int):  # a policy: ask it with the call's counts
            if self._call(layer_idx, ids_at, n, numba_lru.COUNT_ONLY) == 0:
                asked = cap.fetch_count(layer_idx, int(self._info[1]), int(self._info[2]))
                cap = max(int(asked), 0)  # the kernel reads a negative cap as a mode
            else:  # an id out of range: the call below raises before asking
                cap = 0
        cpu_routes = self._call(layer_idx, ids_at, n, cap)
        if cpu_routes == numba_lru.OUT_OF_RANGE:
            raise ValueError(out_of_range(layer_idx, int(self._info[3]), self.experts))
        if cpu_routes == numba_lru.OVER_CAPACITY:
            raise ValueError(over_capacity(layer_idx, int(self._info[0]), self.slots))
        return cpu_routes

    def pending(self) -> list[tuple[int, int]]:
        """(slot, flat id) of every planned copy, in the order first planned."""
        planned = int(self._state[1])
        if not planned:
            return []
        state, flat_at, slots_at = self._state, self._pending_flat_at, self._pending_slots_at
        slots = state[slots_at : slots_at + planned].tolist()
        return [(slot, int(state[flat_at + slot])) for slot in slots]

    def clear_pending(self) -> None:
        state, flat_at, slots_at = self._state, self._pending_flat_at, self._pending_slots_at
        for slot in state[slots_at : slots_at + int(state[1])].tolist():
            state[flat_at + slot] = -1
        state[1] = 0

    def resident(self) -> dict[int, int]:
        """slot -> flat id of every occupied slot (planned copies included)."""
        start, claimed = self._flat_of_slot_at, int(self._state[0])
        return dict(enumerate(self._state[start : start + claimed].tolist()))

    def stats(self, layer_idx: int) -> ExpertCacheStats:
        """The layer's counts (bytes_copied 0: the cache knows an expert's bytes)."""
        counts = self._stats[layer_idx].tolist()
        return ExpertCacheStats(**dict(zip(_COUNTED, counts, strict=True)))

    def _call(self, layer_idx: int, ids_at: int, n: int, cap: int) -> int:
        return numba_lru.lru_ensure(
            self._state_at,
            self.slots,
            self.layers * self.experts,
            ids_at,
            n,
            layer_idx * self.experts,
            self.experts,
            cap,
            self._info_at,
            self._stats_at + layer_idx * numba_lru.STATS * 8,
        )


class LruSlotsReference:
    """The policy on dicts: the reference LruSlots is tested against."""

    def __init__(self, layers: int, experts: int, slots: int) -> None:
        self.layers, self.experts, self.slots = layers, experts, slots
        self.reset()

    def reset(self) -> None:
        self._lru: OrderedDict[int, int] = OrderedDict()  # slot -> flat id, least recent first
        self._slot_of_flat: dict[int, int] = {}
        self._free_slots = list(range(self.slots - 1, -1, -1))  # pop() gives the lowest
        self._pending: dict[int, int] = {}  # slot -> flat id to copy in
        self.reset_stats()

    def reset_stats(self) -> None:
        self._stats = [ExpertCacheStats() for _ in range(self.layers)]

    def ensure(self, layer_idx: int, ids: np.ndarray, cap: FetchCap) -> int:
        flat_ids = ids.tolist()
        counts = self._count_routes(layer_idx, flat_ids)  # expert -> routes, first-seen order
        if cap is None and len(counts) > self.slots:
            raise ValueError(over_capacity(layer_idx, len(counts), self.slots))
        base = layer_idx * self.experts
        slot_of_expert = self._touch_hits(base, counts)
        hits = list(slot_of_expert)  # in first-seen order, as counts
        fetched = self._fetch_misses(layer_idx, counts, slot_of_expert, cap)
        cpu_routes = self._record(layer_idx, counts, hits, fetched)
        ids[:] = [slot_of_expert.get(e, -1) for e in flat_ids]  # ids < 0 are never keys
        return cpu_routes

    def pending(self) -> list[tuple[int, int]]:
        return list(self._pending.items())

    def clear_pending(self) -> None:
        self._pending.clear()

    def resident(self) -> dict[int, int]:
        return dict(self._lru)

    def stats(self, layer_idx: int) -> ExpertCacheStats:
        return ExpertCacheStats.merged([self._stats[layer_idx]])

    def _count_routes(self, layer_idx: int, flat_ids: list[int]) -> dict[int, int]:
        counts: dict[int, int] = {}
        for e in flat_ids:
            if e >= 0:
                counts[e] = counts.get(e, 0) + 1
        if counts and max(counts) >= self.experts:
            raise ValueError(out_of_range(layer_idx, max(counts), self.experts))
        return counts

    def _touch_hits(self, base: int, counts: dict[int, int]) -> dict[int, int]:
        slot_of_expert = {}
        for expert in counts:
            slot = self._slot_of_flat.get(base + expert)
            if slot is not None:
                self._lru.move_to_end(slot)
                slot_of_expert[expert] = slot
        return slot_of_expert

    def _fetch_misses(
        self, layer_idx: int, counts: dict[int, int], slot_of_expert: dict[int, int], cap: FetchCap
    ) -> list[int]:
        misses = [e for e in counts if e not in slot_of_expert]
        misses.sort(key=lambda e: -counts[e])  # stable: ties keep first-appearance order
        if cap is not None and not isinstance(cap, int):
            cap = cap.fetch_count(layer_idx, len(slot_of_expert), len(misses))
        protected = set(slot_of_expert.values())
        fetched = []
        for expert in misses[:cap]:
            slot = self._claim_slot(protected, self._stats[layer_idx])
            if slot is None:
                break  # every slot is used by this call; the remaining misses go to the CPU
            flat = layer_idx * self.experts + expert
            self._lru[slot] = flat
            self._slot_of_flat[flat] = slot
            self._pending[slot] = flat
            slot_of_expert[expert] = slot
            protected.add(slot)
            fetched.append(expert)
        return fetched

    def _claim_slot(self, protected: set[int], stats: ExpertCacheStats) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        # The slots this call used were all touched after every other slot, so they are the
        # tail of the LRU order: the head is evictable unless every slot is protected.
        slot = next(iter(self._lru))
        if slot in protected:
            return None
        _, victim = self._lru.popitem(last=False)
        del self._slot_of_flat[victim]
        stats.evictions += 1
        return slot

    def _record(
        self, layer_idx: int, counts: dict[int, int], hits: list[int], fetched: list[int]
    ) -> int:
        stats = self._stats[layer_idx]
        routes, hit_routes = sum(counts.values()), sum(counts[e] for e in hits)
        fetched_routes = sum(counts[e] for e in fetched)  # fetched: misses, none a hit
        cpu_routes = routes - hit_routes - fetched_routes
        stats.routes += routes
        stats.hits += hit_routes
        stats.fetched_routes += fetched_routes
        stats.cpu_routes += cpu_routes
        stats.fetched += len(fetched)
        return cpu_routes


def out_of_range(layer_idx: int, expert: int, experts: int) -> str:
    return f"layer {layer_idx}: expert id {expert} out of range (the layer has {experts} experts)"


def over_capacity(layer_idx: int, distinct: int, slots: int) -> str:
    return (
        f"this decode step needs {distinct} expert slots (layer {layer_idx} routes to "
        f"{distinct} distinct experts) but expert_cache_slots is {slots}"
    )
