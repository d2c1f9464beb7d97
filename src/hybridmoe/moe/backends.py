"""Expert backends: where one MoE layer's routed experts run, one implementation per decode target.

A layer holds exactly one ExpertBackend and calls `prefill` or `decode` with the router's
output; every backend returns the float32 partial of the accumulation contract
(docs/architecture.md), which the layer rounds once. DECODE_TARGETS is the one place a
target's meaning is spelled: which shared parts of the runtime it needs (the expert cache,
the CPU executor) and how it builds a layer's backend from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridmoe.kernels.torch_moe import gathered_moe
from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.cpu_experts import FUSED_MAX_TOKENS, block_experts
from hybridmoe.moe.hybrid_decode import HybridDecodeExecutor, HybridDecodeRequest
from hybridmoe.moe.offload_cache import OffloadMoeCache
from hybridmoe.moe.routing import combine_experts
from hybridmoe.quant.bank import ExpertBank, ExpertWeights
from hybridmoe.registry import add_entry

GATHER_MAX_TOKENS = FUSED_MAX_TOKENS  # decode batches up to this size gather on an accelerator

# A layer's experts as the computation reads them: a stacked bank (host or device, any
# format) or, for `resident` on the cpu device, the checkpoint's mapped per-expert matrices.
ExpertStore = ExpertBank | ExpertWeights


class ExpertBackend(Protocol):
    """x [T, H], topk_ids [T, K], topk_weights [T, K] -> the float32 partial [T, H]."""

    def prefill(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor: ...

    def decode(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """May rewrite `topk_ids` in place (a cache's slots)."""
        ...


class PrefillExperts(Protocol):
    """A prefill's routed experts of layer `layer_idx` when they are not all resident
    (moe/prefill.py): (layer_idx, x [N, H], ids [N, K], weights [N, K]) -> float32 [N, H]."""

    def __call__(
        self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor: ...


def accelerator_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, store: ExpertStore
) -> torch.Tensor:
    """The expert math where the store lives: on an accelerator, decode's few routes take
    `gathered_moe` (no host sync, the same kernels whatever the routing); otherwise the
    grouped reference. ids index the store (experts, or cache slots)."""
    on_device = x.device.type != "cpu" and isinstance(store, ExpertBank)
    if on_device and x.shape[0] <= GATHER_MAX_TOKENS:
        return gathered_moe(x, ids, weights, store)
    return combine_experts(x, ids, weights, store.expert_mlp)


@dataclass(eq=False)
class ResidentExperts:
    """`resident`: every expert lives where the layer computes."""

    store: ExpertStore
    loaded: bool = False  # the layer's backend as loaded: its store is the checkpoint's experts

    def prefill(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return accelerator_experts(x, ids, weights, self.store)

    def decode(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return accelerator_experts(x, ids, weights, self.store)


@dataclass(eq=False)
class _HostBankExperts:
    """A target whose experts live in host banks: its prefill is the runtime's PrefillExperts."""

    layer_idx: int
    prefill_experts: PrefillExperts

    def prefill(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.prefill_experts(self.layer_idx, x, ids, weights)


@dataclass(eq=False)
class OffloadExperts(_HostBankExperts):
    """`offload`: decode computes on the cache's slots, every miss fetched first."""

    cache: OffloadMoeCache

    def decode(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A batched step routing to more distinct experts than the cache holds runs token by
        token (exact: tokens are independent in the MoE)."""
        cache = self.cache
        may_overflow = x.shape[0] > 1 and ids.numel() > cache.num_slots  # known without a sync
        if may_overflow and torch.unique(ids).numel() > cache.num_slots:
            rows = [slice(t, t + 1) for t in range(x.shape[0])]
            return torch.cat([self.decode(x[r], ids[r], weights[r]) for r in rows])
        cache.ensure_experts(self.layer_idx, ids)
        cache.copy_missing()
        return accelerator_experts(x, ids, weights, cache.slot_bank_for(self.layer_idx))


@dataclass(eq=False)
class CpuExperts(_HostBankExperts):
    """`cpu`: decode's routes computed by the CPU executor from the host banks."""

    cpu_executor: CpuMoeExecutor

    def decode(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """ids: the router's, every one a route (counted without reading them)."""
        return self.cpu_executor.decode(self.layer_idx, x, ids, weights, routes=ids.numel())

    def block_experts(
        self, x: torch.Tensor, top_k: int, weights_dtype: torch.dtype
    ) -> tuple | None:
        """What the attention block takes to compute decode's step on x [T, H] (routes of
        `top_k` weights in `weights_dtype`) in its own call, with decode's bits
        (cpu_experts.block_experts); None unless the executor runs inline on host inputs.
        The block's caller then counts the step (block_done)."""
        executor = self.cpu_executor
        if not (executor.inline and x.is_cpu):
            return None
        bank = executor.banks[self.layer_idx]
        return block_experts(bank, x.dtype, weights_dtype, x.shape[0], top_k, executor.expert_fn)

    def block_done(self, ids: torch.Tensor) -> None:
        """Counts a step the attention block computed (every id a route, as decode's)."""
        self.cpu_executor.record(self.layer_idx, ids.numel())


@dataclass(eq=False)
class HybridExperts(_HostBankExperts):
    """`hybrid`: the HybridDecodeExecutor splits decode's routes between the cache's slots and
    the CPU; this backend supplies the accelerator side's math on the slots."""

    executor: HybridDecodeExecutor
    cache: OffloadMoeCache

    def decode(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        request = HybridDecodeRequest(self.layer_idx, x, ids, weights)
        return self.executor.decode(request, self.run_on_slots)

    def run_on_slots(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The accelerator side: routes [T, K] given as cache slots."""
        return accelerator_experts(x, slots, weights, self.cache.slot_bank_for(self.layer_idx))


@dataclass
class RuntimeParts:
    """What the MoE runtime built for a target; each backend takes the parts it uses."""

    stores: list[ExpertStore]  # per MoE layer
    cache: OffloadMoeCache | None = None
    cpu_executor: CpuMoeExecutor | None = None
    hybrid: HybridDecodeExecutor | None = None
    prefill: PrefillExperts | None = None


@dataclass(frozen=True)
class DecodeTarget:
    name: str
    summary: str  # where routed experts run at decode, for --help and errors
    build: Callable[[RuntimeParts, int], ExpertBackend] = field(repr=False)
    uses_cache: bool = False
    uses_cpu_executor: bool = False


DECODE_TARGETS: dict[str, DecodeTarget] = {}
TARGET_ALIASES = {"gpu": "resident"}  # the name `resident` had before it ran on any device


def register_decode_target(target: DecodeTarget) -> DecodeTarget:
    if target.name in TARGET_ALIASES:
        raise ValueError(f"decode target {target.name!r} is already registered")
    return add_entry(DECODE_TARGETS, "decode target", target.name, target)


def decode_target(name: str) -> DecodeTarget:
    """The registered target called `name` (or an alias of it); ValueError naming the choices."""
    target = DECODE_TARGETS.get(TARGET_ALIASES.get(name, name))
    if target is None:
        choices = ", ".join([*DECODE_TARGETS, *TARGET_ALIASES])
        raise ValueError(f"decode_target must be one of {choices}, got {name!r}")
    return target


register_decode_target(
    DecodeTarget(
        "resident",
        "every expert resident where the model runs (the accelerator, else host memory)",
        lambda parts, i: ResidentExperts(parts.stores[i]),
    )
)
register_decode_target(
    DecodeTarget(
        "offload",
        "a cache of experts on the accelerator; every miss is fetched before use",
        lambda parts, i: OffloadExperts(i, parts.prefill, parts.cache),
        uses_cache=True,
    )
)
register_decode_target(
    DecodeTarget(
        "cpu",
        "every routed expert computed on the CPU from host memory",
        lambda parts, i: CpuExperts(i, parts.prefill, parts.cpu_executor),
        uses_cpu_executor=True,
    )
)
register_decode_target(
    DecodeTarget(
        "hybrid",
        "cache hits on the accelerator; misses on the CPU, overlapped, but up to max_fetch "
        "per layer call fetched into the cache",
        lambda parts, i: HybridExperts(i, parts.prefill, parts.hybrid, parts.cache),
        uses_cache=True,
        uses_cpu_executor=True,
    )
)
