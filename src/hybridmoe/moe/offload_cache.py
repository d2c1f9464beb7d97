"""OffloadMoeCache: which routed experts live in the accelerator's slots (the cache policy).

One pool of `num_slots` expert slots is shared by every MoE layer. Residency is keyed by the
flat id `layer_idx * E + expert` and replaced by one global LRU (moe/lru_slots.py). The policy
runs on the host: each call reads the ids once (in place on the cpu device, else one copy to
host memory), decides in one numba call, and writes slots / -1 back (on an accelerator with one
`copy_`). It knows nothing about threads or vendors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridmoe.moe.cache_stats import ExpertCacheStats
from hybridmoe.moe.fetch_policy import FetchPolicy
from hybridmoe.moe.lru_slots import LruSlots
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
        # per layer: (bank tensor, slot tensor) pairs, row [expert] -> row [slot] (a fetch)
        self._copy_pairs = [
            bank.expert_tensor_pairs(slot_bank)
            for bank, slot_bank in zip(self.banks, self._slot_banks, strict=True)
        ]
        # Row views made at an expert's (a slot's) first fetch and kept: a fetch then costs
        # its copies, not a view per tensor. An expert's rows per layer; a slot's per set of
        # slot tensors, shared by the layers that copy into the same ones. At most a view per
        # tensor of every expert and slot, ~0.3 KB of host memory each.
        self._expert_rows: list[list[list[torch.Tensor] | None]] = [
            [None] * self.num_experts for _ in banks
        ]
        slot_rows: dict[tuple[int, ...], list[list[torch.Tensor] | None]] = {}
        self._slot_rows = [
            slot_rows.setdefault(tuple(id(dst) for _, dst in pairs), [None] * num_slots)
            for pairs in self._copy_pairs
        ]
        self._expert_nbytes = [bank.expert_nbytes for bank in banks]  # per layer, per fetch
        self._ids_pinned: dict[int, torch.Tensor] = {}  # see _ensure_on_device
        self._policy = LruSlots(len(self.banks), self.num_experts, num_slots)

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
        self._policy.reset()

    def reset_stats(self) -> None:
        self._policy.reset_stats()

    @property
    def stats_by_layer(self) -> dict[int, ExpertCacheStats]:
        """Each layer's counts so far (a snapshot)."""
        stats = {layer: self._policy.stats(layer) for layer in range(len(self.banks))}
        for layer, layer_stats in stats.items():
            layer_stats.bytes_copied = layer_stats.fetched * self._expert_nbytes[layer]
        return stats

    def resident(self) -> dict[int, int]:
        """slot -> (layer_idx * E + expert) of every occupied slot, planned copies included."""
        return self._policy.resident()

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
        pending = self._policy.pending()
        if not pending:
            return  # a call of hits and CPU routes only
        copies = []
        for slot, flat in pending:
            layer, expert = divmod(flat, self.num_experts)
            sources = self._expert_rows[layer][expert]
            if sources is None:
                sources = [src[expert] for src, _ in self._copy_pairs[layer]]
                self._expert_rows[layer][expert] = sources
            targets = self._slot_rows[layer][slot]
            if targets is None:
                targets = [dst[slot] for _, dst in self._copy_pairs[layer]]
                self._slot_rows[layer][slot] = targets
            copies += zip(sources, targets, strict=True)
        self.platform.finish_copies(self.platform.start_copies(copies))
        self._policy.clear_pending()  # after the copies: a failed one stays planned

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
        self._slot_banks, self._copy_pairs = [], []
        self._expert_rows, self._slot_rows = [], []
        self._policy.clear_pending()
        self._ids_pinned.clear()

    def _ensure(
        self, layer_idx: int, topk_ids: torch.Tensor, fetch_cap: int | FetchPolicy | None
    ) -> int:
        """The policy of both ensure_* methods; returns the routes given to the CPU."""
        self._check_layer(layer_idx)
        if topk_ids.device.type != "cpu":
            return self._ensure_on_device(layer_idx, topk_ids, fetch_cap)
        if topk_ids.dtype == torch.int64 and topk_ids.is_contiguous():  # a router's ids
            return self._policy.ensure_at(
                layer_idx, topk_ids.data_ptr(), topk_ids.numel(), fetch_cap
            )
        ids64 = topk_ids.to(torch.int64).contiguous()  # another dtype or layout: rewritten
        cpu_routes = self._policy.ensure_at(layer_idx, ids64.data_ptr(), ids64.numel(), fetch_cap)
        topk_ids.copy_(ids64)  # through the copy
        return cpu_routes

    def _ensure_on_device(
        self, layer_idx: int, topk_ids: torch.Tensor, fetch_cap: int | FetchPolicy | None
    ) -> int:
        """ensure on an accelerator's ids through one reused page-locked buffer per size: the
        blocking copy in is the call's one device -> host read, the copy back does not block.
        Reusing the buffer is safe: each call's copy in is ordered after the last copy back."""
        n = topk_ids.numel()
        ids_pinned = self._ids_pinned.get(n)
        if ids_pinned is None:
            ids_pinned = torch.empty(n, dtype=torch.int64, pin_memory=True)
            self._ids_pinned[n] = ids_pinned
        ids_pinned.copy_(topk_ids.reshape(-1))
        cpu_routes = self._policy.ensure_at(layer_idx, ids_pinned.data_ptr(), n, fetch_cap)
        topk_ids.copy_(ids_pinned.view(topk_ids.shape), non_blocking=True)
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
