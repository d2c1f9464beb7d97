"""The expert cache's global LRU (moe/lru_slots.py) as one serial numba call per decode call:
the same decisions as LruSlotsReference's dicts, on int64 arrays addressed by pointer (an int
argument is typed in nanoseconds; the Python policy cost ~20 µs a layer call).

State, one int64 array (its parts where `sections(S, F)` says) for S slots and F = layers *
experts flat ids:
  [0] slots ever claimed (free slots are those from here up: the lowest is taken first)
  [1] planned copies (pending slots listed)
  slot_of_flat [F]   slot of a resident (or planned) expert, -1 if none
  flat_of_slot [S]   the expert in a slot
  prev, next [S + 1] the LRU order as a doubly linked list through slot S (a sentinel):
                     next[S] is the least recently used slot, prev[S] the most recent
  pending_flat [S]   the expert copy_missing copies into a slot, -1 if none
  pending_slots [S]  the slots planned, in the order first planned
"""

from __future__ import annotations

import numba
import numpy as np

from hybridmoe import env
from hybridmoe.kernels import llvm_ir
from hybridmoe.kernels.llvm_ir import address_pointer
from hybridmoe.kernels.numba_cache import cached_njit

_previous_cache_dir = numba.config.CACHE_DIR
numba.config.CACHE_DIR = str(env.kernel_cache_dir(__file__, llvm_ir.__file__))

HEADER = 2
# `cap` values besides a count: fetch every miss (the offload target), or only count
UNLIMITED, COUNT_ONLY = -1, -2
# return codes besides a count of CPU routes (info says more)
OUT_OF_RANGE, OVER_CAPACITY = -1, -2
# stats row fields, as ExpertCacheStats's first six
ROUTES, HITS, FETCHED_ROUTES, CPU_ROUTES, FETCHED, EVICTIONS = range(6)
STATS = 6


def sections(slots: int, flats: int) -> tuple[int, int, int, int, int, int, int]:
    """Where each part of the state starts: (slot_of_flat, flat_of_slot, prev, next,
    pending_flat, pending_slots, the state's size). The kernel's views and the Python
    side's reads both come from here (compiled for the kernel as _sections)."""
    slot_of_flat = HEADER
    flat_of_slot = slot_of_flat + flats
    prev = flat_of_slot + slots
    nxt = prev + slots + 1
    pending_flat = nxt + slots + 1
    pending_slots = pending_flat + slots
    return slot_of_flat, flat_of_slot, prev, nxt, pending_flat, pending_slots, pending_slots + slots


_sections = numba.njit(nogil=True, inline="always")(sections)


def new_state(slots: int, flats: int) -> np.ndarray:
    """An empty cache: nothing resident, nothing planned."""
    *_, prev, _, _, _, size = sections(slots, flats)
    state = np.full(size, -1, dtype=np.int64)
    state[:HEADER] = 0
    state[prev : prev + 2 * (slots + 1)] = slots  # the list: only the sentinel, to itself
    return state


@numba.njit(nogil=True, inline="always")
def _parts(state_at, slots, flats):
    slot_of_flat, flat_of_slot, prev, nxt, pending_flat, pending_slots, size = _sections(
        slots, flats
    )
    state = numba.carray(address_pointer(state_at), size, np.int64)
    return (
        state,
        state[slot_of_flat:flat_of_slot],
        state[flat_of_slot:prev],
        state[prev:nxt],
        state[nxt:pending_flat],
        state[pending_flat:pending_slots],
        state[pending_slots:size],
    )


@numba.njit(nogil=True, inline="always")
def _unlink(prev, nxt, slot):
    nxt[prev[slot]] = nxt[slot]
    prev[nxt[slot]] = prev[slot]


@numba.njit(nogil=True, inline="always")
def _append(prev, nxt, slot, sentinel):
    last = prev[sentinel]
    nxt[last], prev[slot] = slot, last
    nxt[slot], prev[sentinel] = sentinel, slot


@cached_njit(nogil=True)
def lru_ensure(state_at, slots, flats, ids_at, n, base, experts, cap, info_at, stats_at):
    """Rewrite the n int64 expert ids at `ids_at` (layer base // experts) to slots / -1 and
    plan the copies; returns the routes given to the CPU, or OUT_OF_RANGE / OVER_CAPACITY
    (nothing changed). info [4]: distinct experts, distinct hits, distinct misses, the largest
    id. cap: misses to fetch at most, UNLIMITED, or COUNT_ONLY (info only, nothing changed).
    stats [STATS]: the layer's counters, added to."""
    state, slot_of_flat, flat_of_slot, prev, nxt, pending_flat, pending_slots = _parts(
        state_at, slots, flats
    )
    ids = numba.carray(address_pointer(ids_at), n, np.int64)
    info = numba.carray(address_pointer(info_at), 4, np.int64)
    stats = numba.carray(address_pointer(stats_at), STATS, np.int64)
    # the call's distinct experts in first-seen order, with their routes
    index_of = np.full(experts, -1, dtype=np.int64)
    distinct = np.empty(n, dtype=np.int64)
    counts = np.zeros(n, dtype=np.int64)
    slot_of = np.full(n, -1, dtype=np.int64)
    found, largest, hits = 0, -1, 0
    for i in range(n):
        e = ids[i]
        largest = max(largest, e)
        if e < 0 or e >= experts:
            continue
        if index_of[e] < 0:
            index_of[e], distinct[found] = found, e
            slot_of[found] = slot_of_flat[base + e]
            hits += slot_of[found] >= 0
            found += 1
        counts[index_of[e]] += 1
    info[0], info[1], info[2], info[3] = found, hits, found - hits, largest
    if largest >= experts:
        return OUT_OF_RANGE
    if cap == COUNT_ONLY:
        return 0
    if cap == UNLIMITED and found > slots:
        return OVER_CAPACITY
    routes, hit_routes, fetched_routes, fetched, evictions = 0, 0, 0, 0, 0
    for j in range(found):  # hits, touched in first-seen order
        routes += counts[j]
        if slot_of[j] >= 0:
            _unlink(prev, nxt, slot_of[j])
            _append(prev, nxt, slot_of[j], slots)
            hit_routes += counts[j]
    misses = np.empty(found - hits, dtype=np.int64)
    m = 0
    for j in range(found):  # most routes first, ties in first-seen order (a stable sort)
        if slot_of[j] < 0:
            k = m
            while k > 0 and counts[misses[k - 1]] < counts[j]:
                misses[k] = misses[k - 1]
                k -= 1
            misses[k] = j
            m += 1
    used = hits  # slots this call uses: the tail of the LRU order
    for t in range(m if cap == UNLIMITED else min(cap, m)):
        if state[0] < slots:  # a free slot, the lowest
            slot = state[0]
            state[0] += 1
        elif used >= slots:  # every slot is this call's: the other misses go to the CPU
            break
        else:  # evict the least recently used
            slot = nxt[slots]
            slot_of_flat[flat_of_slot[slot]] = -1
            _unlink(prev, nxt, slot)
            evictions += 1
        j = misses[t]
        flat = base + distinct[j]
        flat_of_slot[slot], slot_of_flat[flat] = flat, slot
        _append(prev, nxt, slot, slots)
        if pending_flat[slot] < 0:
            pending_slots[state[1]] = slot
            state[1] += 1
        pending_flat[slot] = flat
        slot_of[j] = slot
        used += 1
        fetched += 1
        fetched_routes += counts[j]
    for i in range(n):
        e = ids[i]
        ids[i] = slot_of[index_of[e]] if e >= 0 else -1
    cpu_routes = routes - hit_routes - fetched_routes
    stats[ROUTES] += routes
    stats[HITS] += hit_routes
    stats[FETCHED_ROUTES] += fetched_routes
    stats[CPU_ROUTES] += cpu_routes
    stats[FETCHED] += fetched
    stats[EVICTIONS] += evictions
    return cpu_routes


numba.config.CACHE_DIR = _previous_cache_dir
