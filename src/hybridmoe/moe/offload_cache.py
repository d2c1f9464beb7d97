"""OffloadMoeCache: which routed experts live in the accelerator's slots (the cache policy).

One pool of `num_slots` expert slots is shared by every MoE layer. Residency is keyed by the
flat id `layer_idx * E + expert` and replaced by one global LRU. The policy runs on the host:
each call reads the ids once (`tolist()`), decides in O(T*K) Python work, and writes slots / -1
back with one `copy_`. It knows nothing about kernels, threads or vendors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from hybridmoe.moe.cache_stats import ExpertCacheStats
from hybridmoe.moe.fetch_policy import FetchPolicy
from hybridmoe.platform.base import Platform
from hybridmoe.platform.cpu import CpuPlatform
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.slot_banks import SlotBanks, check_expert_kinds


class OffloadMoeCache:
    """A global-LRU cache of experts in accelerator slots, shared by all MoE layers.

    Both `ensure_*` methods rewrite `topk_ids` [T, K] IN PLACE (the caller's tensor, on any
    device): a value >= 0 is a slot that holds that expert once `copy_missing()` has run; -1 is
    a CPU route (hybrid only) or an input id < 0, which is left at -1 and counted nowhere.
    Duplicates of an expert within a call share one slot. A slot a call uses (a hit or one of
    its fetches) is never evicted by that same call. Victims: the lowest free slot first, else
    the least recently used slot. Hits are touched in order of first appearance, then fetches.
    """

    def __init__(
        self,
        banks: Sequence[ExpertBank],
        num_slots: int,
        max_fetch: int | FetchPolicy,
        platform: Platform | None = None,
    ) -> None:
        _check_banks(banks)
        self.banks = list(banks)
        self.num_experts = banks[0].num_experts
        total = len(banks) * self.num_experts
        if not 1 <= num_slots <= total:
            raise ValueError(
                f"num_slots must be between 1 and the number of routed experts "
                f"({len(banks)} layers x {self.num_experts} = {total}); got {num_slots}"
            )
        if isinstance(max_fetch, int) and max_fetch < 0:
            raise ValueError(f"max_fetch must be >= 0 (0: never fetch in hybrid); got {max_fetch}")
        self.num_slots = num_slots
        self.max_fetch = max_fetch
        # Slots hold experts in their layer's formats (a fetch copies the stored bytes), each
        # slot sized for the largest; laid out as the banks: a fetch copies contiguous gate_up
        # (or gate, up) and down. Zeros, not empty: a CPU route runs slot 0 with weight 0 on
        # the accelerator side, and 0 * NaN from uninitialised memory would poison the sum.
        self.platform = platform if platform is not None else CpuPlatform()
        self.slots: SlotBanks | None = SlotBanks(banks, num_slots, self.platform.device)
        self._slot_banks = [self.slots.bank_for(bank) for bank in banks]  # per layer
        self._expert_nbytes = [bank.expert_nbytes for bank in banks]  # per layer, per fetch
        self._ids_pinned: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # see _write_back
        self.reset()

    def slot_bank_for(self, layer_idx: int) -> ExpertBank:
        """The slots as a bank in layer `layer_idx`'s formats: what its decode computes on
        (slot s holds whichever layer's expert the cache put there)."""
        self._check_layer(layer_idx)
        return self._slot_banks[layer_idx]

    @property
    def slot_bank(self) -> ExpertBank:
        """The slots as a bank in layer 0's formats (every layer's, in a uniform model)."""
        return self.slot_bank_for(0)

    @property
    def gate_up_slots(self) -> torch.Tensor:
        """[S, 2I, H] on the device: the slots' stacked gate and up rows (stacked banks)."""
        return self.slot_bank.gate_up

    @property
    def down_slots(self) -> torch.Tensor:
        """[S, H, I] on the device: the slots' down rows."""
        return self.slot_bank.down

    def reset(self) -> None:
        """Forget every resident expert, every planned copy and all stats."""
        self._lru: OrderedDict[int, int] = OrderedDict()  # slot -> flat id, least recent first
        self._slot_of_flat: dict[int, int] = {}
        self._free_slots = list(range(self.num_slots - 1, -1, -1))  # pop() gives the lowest
        self._pending: dict[int, int] = {}  # slot -> flat id that copy_missing() copies in
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats_by_layer = {layer: ExpertCacheStats() for layer in range(len(self.banks))}

    def total_stats(self) -> ExpertCacheStats:
        return ExpertCacheStats.merged(list(self.stats_by_layer.values()))

    def ensure_experts_hybrid(self, layer_idx: int, topk_ids: torch.Tensor) -> int:
        """Hits keep their slot; at most `max_fetch` distinct misses get a slot (planned for
        copy_missing()); every other route becomes -1 (CPU). A FetchPolicy as `max_fetch` sets
        the cap per call from the call's distinct hits and misses. When more than the cap miss,
        the experts with the most routes in this call are fetched first, ties broken by first
        appearance in row-major order. A miss with no evictable slot goes to the CPU. Returns
        the number of routes (ids >= 0) given to the CPU."""
        return self._ensure(layer_idx, topk_ids, self.max_fetch)

    def ensure_experts(self, layer_idx: int, topk_ids: torch.Tensor) -> None:
        """The `offload` target: every miss is fetched, so no valid id becomes -1. Raises
        ValueError (and changes nothing) when the call routes to more distinct experts than
        there are slots."""
        self._ensure(layer_idx, topk_ids, None)

    def copy_missing(self) -> None:
        """Copy every planned expert bank -> slot and clear the plan. Experts planned by any
        earlier call that has not been followed by copy_missing() are copied too. The platform
        orders the copies after the accelerator work already issued and before what follows."""
        if not self._pending:
            return  # a call of hits and CPU routes only
        copies = []
        for slot, flat in self._pending.items():
            layer, expert = divmod(flat, self.num_experts)
            copies += self.banks[layer].expert_copies(expert, self.slot_bank_for(layer), slot)
        self.platform.finish_copies(self.platform.start_copies(copies))
        self._pending.clear()

    @staticmethod
    def min_slots(top_k: int, tokens: int = 1, num_experts: int | None = None) -> int:
        """Slots an `offload` decode step of `tokens` tokens needs: one layer's call must hold
        all its distinct experts at once, at most tokens * top_k (capped by the experts per
        layer when `num_experts` is given). Layers run one after another, so slots are reused
        across layers and the need does not grow with the number of layers."""
        need = tokens * top_k
        return need if num_experts is None else min(need, num_experts)

    def close(self) -> None:
        """Release the slots (device memory on an accelerator) now, without waiting for the
        garbage collector; the cache cannot be used afterwards."""
        self.slots = None
        self._slot_banks = []
        self._pending.clear()
        self._ids_pinned.clear()

    def _ensure(
        self, layer_idx: int, topk_ids: torch.Tensor, fetch_cap: int | FetchPolicy | None
    ) -> int:
        """The policy of both ensure_* methods; returns the routes given to the CPU."""
        self._check_layer(layer_idx)
        flat_ids = topk_ids.reshape(-1).tolist()  # the one device -> host read of the call
        counts = self._count_routes(layer_idx, flat_ids)  # expert -> routes, first-seen order
        if fetch_cap is None and len(counts) > self.num_slots:
            raise ValueError(
                f"this decode step needs {len(counts)} expert slots (layer {layer_idx} routes to "
                f"{len(counts)} distinct experts) but expert_cache_slots is {self.num_slots}"
            )
        base = layer_idx * self.num_experts
        slot_of_expert = self._touch_hits(base, counts)
        hits = list(slot_of_expert)  # in first-seen order, as counts
        fetched = self._fetch_misses(layer_idx, counts, slot_of_expert, fetch_cap)
        cpu_routes = self._record(layer_idx, counts, hits, fetched)
        rewritten = [slot_of_expert.get(e, -1) for e in flat_ids]  # ids < 0 are never keys
        self._write_back(topk_ids, rewritten)
        return cpu_routes

    def _write_back(self, topk_ids: torch.Tensor, rewritten: list[int]) -> None:
        """topk_ids[:] = rewritten. On an accelerator through one reused page-locked buffer per
        shape, copied without blocking: reusing it is safe because every call starts with the
        `tolist()` read of ids that the compute stream produced after the last copy."""
        if topk_ids.device.type == "cpu":
            if topk_ids.is_contiguous():  # through numpy: no aten op (~13 -> ~2 µs warm)
                topk_ids.numpy().reshape(-1)[:] = rewritten
            else:
                topk_ids.copy_(torch.tensor(rewritten, dtype=topk_ids.dtype).view(topk_ids.shape))
            return
        key = (topk_ids.numel(), topk_ids.dtype)
        ids_pinned = self._ids_pinned.get(key)
        if ids_pinned is None:
            ids_pinned = torch.empty(key[0], dtype=key[1], pin_memory=True)
            self._ids_pinned[key] = ids_pinned
        ids_pinned.numpy()[:] = rewritten
        topk_ids.copy_(ids_pinned.view(topk_ids.shape), non_blocking=True)

    def _count_routes(self, layer_idx: int, flat_ids: list[int]) -> dict[int, int]:
        """expert -> its routes in the call, in first-seen order (ids < 0 are not routes)."""
        counts: dict[int, int] = {}
        for e in flat_ids:  # a loop: Counter's setup costs more than 8 ids
            if e >= 0:
                counts[e] = counts.get(e, 0) + 1
        if counts and max(counts) >= self.num_experts:
            raise ValueError(
                f"layer {layer_idx}: expert id {max(counts)} out of range "
                f"(the layer has {self.num_experts} experts)"
            )
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
        self,
        layer_idx: int,
        counts: dict[int, int],
        slot_of_expert: dict[int, int],
        fetch_cap: int | FetchPolicy | None,
    ) -> list[int]:
        misses = [e for e in counts if e not in slot_of_expert]
        misses.sort(key=lambda e: -counts[e])  # stable: ties keep first-appearance order
        if fetch_cap is not None and not isinstance(fetch_cap, int):
            fetch_cap = fetch_cap.fetch_count(layer_idx, len(slot_of_expert), len(misses))
        protected = set(slot_of_expert.values())
        fetched = []
        for expert in misses[:fetch_cap]:
            slot = self._claim_slot(protected, self.stats_by_layer[layer_idx])
            if slot is None:
                break  # every slot is used by this call; the remaining misses go to the CPU
            flat = layer_idx * self.num_experts + expert
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
        """Count the call in its layer's stats; returns its CPU routes."""
        stats = self.stats_by_layer[layer_idx]
        routes, hit_routes = sum(counts.values()), sum(counts[e] for e in hits)
        fetched_routes = sum(counts[e] for e in fetched)  # fetched: misses, none a hit
        cpu_routes = routes - hit_routes - fetched_routes
        stats.routes += routes
        stats.hits += hit_routes
        stats.fetched_routes += fetched_routes
        stats.cpu_routes += cpu_routes
        stats.fetched += len(fetched)
        stats.bytes_copied += len(fetched) * self._expert_nbytes[layer_idx]
        return cpu_routes

    def _check_layer(self, layer_idx: int) -> None:
        if not 0 <= layer_idx < len(self.banks):
            raise IndexError(f"layer_idx {layer_idx} out of range: {len(self.banks)} MoE layers")


def _check_banks(banks: Sequence[ExpertBank]) -> None:
    """ValueError naming the first layer whose bank's layout or logical shapes differ from
    layer 0's (formats may differ: each slot is sized for the largest), whose stored shapes do
    not match its own formats, or whose kind of expert differs (check_expert_kinds)."""
    if not banks:
        raise ValueError("OffloadMoeCache needs one ExpertBank per MoE layer; got none")
    first = banks[0]
    shape = (first.num_experts, first.hidden_size, first.intermediate_size)
    for layer, bank in enumerate(banks):
        num_experts, hidden, inter = bank.num_experts, bank.hidden_size, bank.intermediate_size
        stored = (
            bank.gate_up_fmt.stored_shape((num_experts, inter, hidden)),
            bank.down_fmt.stored_shape((num_experts, hidden, inter)),
        )
        if (bank.gate.shape, bank.down.shape) != stored:
            raise ValueError(
                f"layer {layer}: bank gate {tuple(bank.gate.shape)} [E, I, H] does not match "
                f"down {tuple(bank.down.shape)} [E, H, I]"
            )
        if (num_experts, hidden, inter) != shape or bank.stacked != first.stacked:
            raise ValueError(
                f"layer {layer}: bank {bank} differs from layer 0's {first} in its shapes "
                "or layout; all MoE layers must share expert shapes and layout"
            )
    check_expert_kinds(banks)
