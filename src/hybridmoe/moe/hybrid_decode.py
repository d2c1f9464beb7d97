"""HybridDecodeExecutor: the shared CPU/accelerator schedule of one hybrid MoE decode step.

It owns the order and overlap of the two sides and nothing else: the cache decides placement,
the CPU executor (with platform/) owns synchronisation, the layer owns the accelerator math.
This module imports no vendor code, no cache policy and no quantisation format.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class HybridDecodeRequest:
    layer_idx: int  # MoE layer ordinal
    hidden_states: torch.Tensor  # [T, H] on the accelerator
    topk_ids: torch.Tensor  # [T, K] int64 expert ids; rewritten in place to slots / -1
    topk_weights: torch.Tensor  # [T, K]


class HybridExpertCache(Protocol):
    def ensure_experts_hybrid(self, layer_idx: int, topk_ids: torch.Tensor) -> int | None:
        """Rewrite `topk_ids` in place: a slot that holds the expert after copy_missing(), or -1
        for a route the CPU computes. Plans the copies; copies nothing. Returns how many routes
        (input ids >= 0) it gave the CPU, counted on the host as it decided, or None when it
        does not count them."""
        ...

    def copy_missing(self) -> None:
        """Perform the copies the last ensure_experts_hybrid() planned."""
        ...


class CpuExecutor(Protocol):
    def decode_submit(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        cpu_expert_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        routes: int | None = None,
    ) -> None:
        """Start the CPU routes (ids < 0 skipped) without blocking; `routes`: the count of
        ids >= 0 when the caller knows it (None: the executor counts). With 0 routes the
        executor may finish at once (its partial: zeros), but decode_sync is still called."""
        ...

    def decode_sync(self, layer_idx: int) -> torch.Tensor:
        """Wait for the submitted work; its float32 partial output [T, H] on the accelerator. A
        worker failure raises here."""
        ...


# (hidden [T, H], slots [T, K], weights [T, K]) -> accelerator partial [T, H] in float32
GpuExpertRunner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class HybridStepStats:
    """Calls per layer. Where each route ran is the cache's to count (it decides on the host);
    counting it here would add device ops to every call."""

    steps: int = 0
    routes: int = 0


@dataclass
class HybridDecodeExecutor:
    cache: HybridExpertCache
    cpu_executor: CpuExecutor
    overlap: bool = True
    stats: dict[int, HybridStepStats] = field(default_factory=dict)

    def decode(
        self, request: HybridDecodeRequest, gpu_expert_runner: GpuExpertRunner
    ) -> torch.Tensor:
        """The routed experts' float32 sum [T, H]: every routed contribution computed exactly
        once, on one side; the two float32 partials are added before the caller's one
        rounding to the activation dtype."""
        original_ids = request.topk_ids.clone()  # 1. keep the router's expert ids
        # 2. in place; the count of CPU routes, known on the host, lets the executor finish a
        # call without CPU routes at once (no copies to host memory, no thread round trip)
        cpu_routes = self.cache.ensure_experts_hybrid(request.layer_idx, request.topk_ids)
        on_cpu = request.topk_ids < 0  # 3. slot >= 0: accelerator; -1: CPU
        cpu_ids, gpu_slots, gpu_weights = split_routes(
            original_ids, request.topk_ids, request.topk_weights, on_cpu
        )  # 4.
        self.cpu_executor.decode_submit(  # 5. CPU first, so it overlaps the accelerator work
            request.layer_idx, request.hidden_states, cpu_ids, request.topk_weights, cpu_routes
        )
        if not self.overlap:
            cpu_partial = self.cpu_executor.decode_sync(request.layer_idx)
        try:
            self.cache.copy_missing()  # 6.
            gpu_partial = gpu_expert_runner(request.hidden_states, gpu_slots, gpu_weights)
        except BaseException:
            if self.overlap:  # collect the CPU job, so the layer is not left with work in flight
                with contextlib.suppress(Exception):
                    self.cpu_executor.decode_sync(request.layer_idx)
            raise
        if self.overlap:
            cpu_partial = self.cpu_executor.decode_sync(request.layer_idx)  # 7.
        stats = self.stats.get(request.layer_idx)
        if stats is None:  # setdefault would build a HybridStepStats on every call
            stats = self.stats[request.layer_idx] = HybridStepStats()
        stats.steps += 1
        stats.routes += on_cpu.numel()  # router ids are all valid: one route each
        return gpu_partial + cpu_partial  # 8.


def split_routes(
    original_ids: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    on_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Complementary routes: (cpu_ids, gpu_slots, gpu_weights), each [T, K].

    cpu_ids = original where slot < 0 else -1; gpu_slots = the slots, -1 where the route is
    the CPU's (the accelerator side skips it: a slot may hold another layer's expert in other
    formats, whose bytes read in this layer's formats need not be finite, so no slot is run
    with weight 0 instead); gpu_weights = 0 where slot < 0 else the router weight.
    `on_cpu` is `slots < 0` when the caller has it already.
    """
    on_cpu = slots < 0 if on_cpu is None else on_cpu
    cpu_ids = torch.where(on_cpu, original_ids, -1)
    gpu_slots = slots
    gpu_weights = weights.masked_fill(on_cpu, 0)
    return cpu_ids, gpu_slots, gpu_weights
