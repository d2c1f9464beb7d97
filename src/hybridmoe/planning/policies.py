"""Online cache policies for the simulator: which experts hold the S accelerator slots.

Each policy answers three questions the replay (simulator.py) asks per cache call: is a flat
expert id (`layer * E + expert`) resident, note a use of a resident one, and admit a miss
(evicting a victim that is not `protected`, i.e. not used by the current call) or refuse.
`LruPolicy` is OffloadMoeCache's policy; its replay gives the cache's counts exactly.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Protocol


class SlotPolicy(Protocol):
    def resident(self, flat: int) -> bool: ...

    def seen(self, flat: int, routes: int) -> None:
        """The current call routes `routes` tokens to `flat` (resident or not)."""
        ...

    def touch(self, flat: int) -> None:
        """A resident expert was used by the current call."""
        ...

    def admit(self, flat: int, protected: set[int]) -> bool | None:
        """Give `flat` a slot: None when no slot is free or evictable (never one in
        `protected`), else whether a resident expert was evicted for it."""
        ...


class LruPolicy:
    """One global LRU over every layer's experts (OffloadMoeCache)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.lru: OrderedDict[int, None] = OrderedDict()  # least recent first

    def resident(self, flat: int) -> bool:
        return flat in self.lru

    def seen(self, flat: int, routes: int) -> None:
        pass

    def touch(self, flat: int) -> None:
        self.lru.move_to_end(flat)

    def admit(self, flat: int, protected: set[int]) -> bool | None:
        evicted = len(self.lru) >= self.num_slots
        if evicted:
            # the call's own experts were touched last: the head is protected only if all are
            victim = next(iter(self.lru))
            if victim in protected:
                return None
            del self.lru[victim]
        self.lru[flat] = None
        return evicted


class PerLayerLruPolicy:
    """S slots split evenly among the layers (the first S mod L layers get one more), an LRU
    in each: a layer never takes another's slots."""

    def __init__(self, num_slots: int, num_layers: int, num_experts: int):
        base, extra = divmod(num_slots, num_layers)
        self.num_experts = num_experts
        self.layers = [
            LruPolicy(base + (i < extra)) if base + (i < extra) else None for i in range(num_layers)
        ]

    def _of(self, flat: int) -> LruPolicy | None:
        return self.layers[flat // self.num_experts]

    def resident(self, flat: int) -> bool:
        lru = self._of(flat)
        return lru is not None and lru.resident(flat)

    def seen(self, flat: int, routes: int) -> None:
        pass

    def touch(self, flat: int) -> None:
        self._of(flat).touch(flat)

    def admit(self, flat: int, protected: set[int]) -> bool | None:
        lru = self._of(flat)
        return None if lru is None else lru.admit(flat, protected)


class LfuPolicy:
    """Evicts the resident expert with the fewest routes so far (ties: least recently used)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.uses: Counter[int] = Counter()  # routes per flat id, resident or not
        self.last: dict[int, int] = {}  # resident flat -> clock of its last use
        self.clock = 0

    def resident(self, flat: int) -> bool:
        return flat in self.last

    def seen(self, flat: int, routes: int) -> None:
        self.uses[flat] += routes

    def touch(self, flat: int) -> None:
        self.clock += 1
        self.last[flat] = self.clock

    def admit(self, flat: int, protected: set[int]) -> bool | None:
        evicted = len(self.last) >= self.num_slots
        if evicted:
            candidates = [f for f in self.last if f not in protected]
            if not candidates:
                return None
            del self.last[min(candidates, key=lambda f: (self.uses[f], self.last[f]))]
        self.clock += 1
        self.last[flat] = self.clock
        return evicted


class StaticPolicy:
    """A fixed placement (the S most routed experts of a profile, as KTransformers and Fiddler
    place them): never admits, never evicts."""

    def __init__(self, resident_flats: set[int]):
        self.flats = frozenset(resident_flats)

    def resident(self, flat: int) -> bool:
        return flat in self.flats

    def seen(self, flat: int, routes: int) -> None:
        pass

    def touch(self, flat: int) -> None:
        pass

    def admit(self, flat: int, protected: set[int]) -> bool | None:
        return None
