"""MoeRuntime: the decode-time expert machinery one engine owns.

It owns the banks, the cache, the CpuMoeExecutor, the HybridDecodeExecutor over those two, the
prefill and the platform, and closes them in order. Nothing it owns refers back to it or to
each other in a cycle, so `close()` releases the device memory of the slots and banks at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from hybridmoe import env
from hybridmoe.errors import DeviceMemoryError
from hybridmoe.loader.weights import release_pages
from hybridmoe.models.transformer import MoeCausalLM
from hybridmoe.moe.backends import (
    DecodeTarget,
    ExpertStore,
    ResidentExperts,
    RuntimeParts,
    decode_target,
)
from hybridmoe.moe.cache_stats import ExpertCacheStats
from hybridmoe.moe.config import AUTO_TARGET, OffloadConfig
from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.cpu_experts import create_cpu_expert_fn
from hybridmoe.moe.fetch_policy import AutoFetch, prior_costs
from hybridmoe.moe.hybrid_decode import HybridDecodeExecutor
from hybridmoe.moe.offload_cache import OffloadMoeCache
from hybridmoe.moe.prefill import ExpertPrefill, InPlacePrefill, LayerStreamer
from hybridmoe.platform.base import Platform
from hybridmoe.platform.cpu import CpuPlatform
from hybridmoe.quant import activation_q8
from hybridmoe.quant.bank import ExpertBank, ExpertWeights
from hybridmoe.quant.formats import WeightFormat, dense_format, weight_format
from hybridmoe.quant.slot_banks import SlotBanks

if TYPE_CHECKING:
    from hybridmoe.engine.placement import DeviceMemoryPlan
    from hybridmoe.layers.moe import OffloadMoELayer


@dataclass
class MoeRuntime:
    config: OffloadConfig
    layers: list[OffloadMoELayer]
    banks: list[ExpertBank]  # per MoE layer, stacked (none when computed from the file)
    cache: OffloadMoeCache | None
    cpu_executor: CpuMoeExecutor | None
    hybrid_executor: HybridDecodeExecutor | None
    platform: Platform
    prefill: ExpertPrefill | None = None

    def close(self) -> None:
        """Join the CPU workers, detach the layers, release the slots, prefill's buffers and
        the banks, then close the platform (which unpins the host banks)."""
        if self.cpu_executor is not None:
            self.cpu_executor.close()
        for layer in self.layers:
            layer.use(_CLOSED)
        if self.cache is not None:
            self.cache.close()
        self.hybrid_executor = self.prefill = self.cache = None
        self.banks = []
        self.platform.close()

    def reset_stats(self) -> None:
        if self.cache is not None:
            self.cache.reset_stats()
        if self.hybrid_executor is not None:
            self.hybrid_executor.stats.clear()
        if self.cpu_executor is not None:
            self.cpu_executor.stats.clear()

    def stats(self) -> ExpertCacheStats | None:
        """Expert placement over the decode steps since reset_stats(); None for `gpu`."""
        if self.cache is not None:
            return self.cache.total_stats()
        if self.cpu_executor is not None:  # the `cpu` target: every route on the CPU
            routes = sum(layer.routes for layer in self.cpu_executor.stats.values())
            return ExpertCacheStats(routes=routes, cpu_routes=routes)
        return None


class _ClosedExperts:
    """The backend of a layer whose runtime is closed."""

    def prefill(self, *args: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the MoE runtime of this model is closed")

    decode = prefill


_CLOSED = _ClosedExperts()


def create_moe_runtime(
    model: MoeCausalLM,
    config: OffloadConfig,
    platform: Platform | None = None,
    progress: bool = False,
    memory: DeviceMemoryPlan | None = None,
) -> MoeRuntime:
    """Build the decode target's parts on `platform` (default: the cpu device) and install its
    expert backend in every MoE layer. Every target but `resident` on the cpu device in the
    model's dtype stacks each layer's experts into a host bank first (converting them to
    `expert_format`, with a progress bar when `progress`); that one computes from the
    checkpoint's mapped experts in place. With a memory plan the slot count comes from it
    (DeviceMemoryError when it does not fit)."""
    platform = platform if platform is not None else CpuPlatform()
    if config.decode_target == AUTO_TARGET:
        raise ValueError("decode target 'auto' is resolved by the engine (resolve_decode_target)")
    target = decode_target(config.decode_target)
    layers = model.moe_layers
    on_accelerator = platform.device.type != "cpu"
    # a memory plan counts the experts from their banks, so a planned `resident` stacks too
    stack = target.name != "resident" or on_accelerator or memory is not None
    stores = _expert_stores(layers, config, model.dtype, progress, stack)
    parts = RuntimeParts([_with_activation_quant(s, config.activation_quant) for s in stores])
    if target.name == "resident":
        _place_resident(parts, platform, memory)
    elif parts.stores:  # a model without MoE layers needs nothing more
        _build_offloaded(parts, target, model, config, platform, progress, memory)
    for i, layer in enumerate(layers):
        layer.use(target.build(parts, i))
    banks = [store for store in parts.stores if isinstance(store, ExpertBank)]
    return MoeRuntime(
        config,
        layers,
        banks,
        parts.cache,
        parts.cpu_executor,
        parts.hybrid,
        platform,
        parts.prefill,
    )


def _build_offloaded(
    parts: RuntimeParts,
    target: DecodeTarget,
    model: MoeCausalLM,
    config: OffloadConfig,
    platform: Platform,
    progress: bool,
    memory: DeviceMemoryPlan | None,
) -> None:
    """The parts of a target whose experts stay in host banks: pinned banks on an accelerator,
    prefill, the cache and the CPU executor, as the target uses them."""
    on_accelerator = platform.device.type != "cpu"
    if on_accelerator and config.pin_memory:
        bar = tqdm(parts.stores, desc="pinning expert banks", unit="layer", disable=not progress)
        parts.stores = [bank.in_own_pages() for bank in bar]
        for tensor in (t for bank in parts.stores for t in bank.tensors() + bank.bias_tensors()):
            platform.pin(tensor)
    banks = parts.stores
    # On the cpu device `auto` computes prefill from the banks in place.
    prefill_mode = config.prefill if on_accelerator or config.prefill != "auto" else None
    prefill_bytes = _prefill_bytes(prefill_mode, banks, memory)
    if target.uses_cache:
        slots = _num_slots(model, config, target, banks, memory, prefill_bytes)
        parts.cache = OffloadMoeCache(
            banks, slots, _max_fetch(config, banks[0], platform), platform
        )
    expert_fn = create_cpu_expert_fn(config.cpu_kernel, config.cpu_threads)
    if prefill_mode is None:  # a short prompt's first token by the fused kernel, not torch's
        parts.prefill = InPlacePrefill(banks, expert_fn)
    else:
        parts.prefill = ExpertPrefill(
            banks, platform, expert_fn, prefill_mode, config.prefill_cpu_tokens
        )
    if target.uses_cpu_executor:  # last: nothing after it can fail and leave its threads
        # on the cpu device the layer's other work shares the cores: nothing to overlap
        inline = not on_accelerator and env.cpu_inline()
        executor = CpuMoeExecutor(
            banks,
            expert_fn=expert_fn,
            sync=platform.device_sync(),
            inline=inline,
        )
        parts.cpu_executor = executor
        if parts.cache is not None:
            if isinstance(parts.cache.max_fetch, AutoFetch):  # follows the measured CPU cost
                parts.cache.max_fetch.attach(executor.stats)
            overlap = config.overlap and env.hybrid_overlap()
            parts.hybrid = HybridDecodeExecutor(parts.cache, executor, overlap)


def _max_fetch(config: OffloadConfig, bank: ExpertBank, platform: Platform) -> int | AutoFetch:
    """The cache's fetch cap: the configured integer, or for "auto" a policy from bandwidth
    priors (moe/fetch_policy.py) that follows the CPU executor's measured times."""
    if isinstance(config.max_fetch, int):
        return config.max_fetch
    on_accelerator = platform.device.type != "cpu"
    # on the cpu device both sides share the cores: their times add (planning/cost_model.py)
    overlap = config.overlap and env.hybrid_overlap() and on_accelerator
    return AutoFetch(prior_costs(bank.expert_nbytes, on_accelerator), overlap)


def _prefill_bytes(
    prefill_mode: str | None, banks: list[ExpertBank], memory: DeviceMemoryPlan | None
) -> int:
    """Device bytes of prefill's layer buffers (none when prefill never streams)."""
    streams = prefill_mode is not None and ExpertPrefill.streams(prefill_mode)
    needed = LayerStreamer.nbytes(banks) if streams else 0
    if memory is not None and needed > memory.expert_bytes:
        raise DeviceMemoryError(
            f"streaming prefill needs two layers of experts on the device "
            f"({needed / 2**30:.2f} GiB): {memory.describe()}; use --prefill cpu, or raise "
            "--gpu-memory"
        )
    return needed


def _place_resident(
    parts: RuntimeParts, platform: Platform, memory: DeviceMemoryPlan | None
) -> None:
    """`resident`: every bank on the device (the host copies freed); the mapped experts of the
    cpu device stay as they are."""
    banks = [store for store in parts.stores if isinstance(store, ExpertBank)]
    if memory is not None and banks:
        total = sum(bank.num_experts for bank in banks)
        memory.check_all_experts_fit(sum(bank.nbytes for bank in banks), total)
    if banks:
        parts.stores = [bank.to(platform.device) for bank in banks]


def _num_slots(
    model: MoeCausalLM,
    config: OffloadConfig,
    target: DecodeTarget,
    banks: list[ExpertBank],
    memory: DeviceMemoryPlan | None,
    prefill_bytes: int,
) -> int:
    total = sum(bank.num_experts for bank in banks)
    if memory is None:
        slots = config.num_slots(total)
    else:  # a size the user gave must fit; else the slots fill the budget
        asked = config.num_slots(total) if config.cache_size_given else None
        slots = memory.slots(prefill_bytes, SlotBanks.slot_nbytes(banks), total, asked)
    needed = OffloadMoeCache.min_slots(model.cfg.top_k, 1, model.cfg.num_experts)
    if not target.uses_cpu_executor and slots < needed:  # every route needs a slot
        raise ValueError(
            f"expert_cache_slots={slots} is below the {needed} slots one decode step needs "
            f"in the {target.name!r} target (top_k={model.cfg.top_k}); use at least {needed}"
        )
    return slots


def _expert_stores(
    layers: list[OffloadMoELayer],
    config: OffloadConfig,
    dtype: torch.dtype,
    progress: bool,
    stack: bool,
) -> list[ExpertStore]:
    """Each layer's experts as the target computes from them: stacked into a host bank in
    `expert_format` (the mapped pages released: the bank is their only copy), or, when not
    `stack`ing and the format is the model's, the mapped experts themselves, aligned. A file
    that stores its experts merged (GGUF) comes as banks already, in the file's format."""
    loaded = [_loaded_experts(layer) for layer in layers]
    asked = weight_format(config.expert_format) if config.expert_format else None
    if loaded and isinstance(loaded[0], ExpertBank):
        return [_file_bank(bank, asked) for bank in loaded]
    native = dense_format(dtype)
    fmt = asked or native
    if fmt == native and not stack:
        for experts in loaded:
            experts.align()
        return loaded
    desc = "stacking experts" if fmt == native else f"experts -> {fmt.name}"
    weights = [sum(w.numel() for w in e.gate + e.up + e.down) for e in loaded]  # per layer
    stores = []
    with tqdm(
        total=sum(weights), desc=desc, unit="weight", unit_scale=True, disable=not progress
    ) as bar:
        for experts, count in zip(loaded, weights, strict=True):
            stores.append(_stacked(experts, fmt))
            bar.update(count)
    return stores


def _with_activation_quant(store: ExpertStore, activation_quant: str) -> ExpertStore:
    """A bank computing with `activation_quant` ("auto": activation_q8.resolve's choice for
    its formats; its slots and copies inherit it); the checkpoint's mapped dense experts have
    no integer blocks, so none applies to them."""
    if not isinstance(store, ExpertBank):
        return store
    chosen = activation_q8.resolve(activation_quant, store.formats)
    return store if store.activation_quant == chosen else store.with_activation_quant(chosen)


def _loaded_experts(layer: OffloadMoELayer) -> ExpertStore:
    experts = layer.experts
    unplaced = isinstance(experts, ResidentExperts) and (
        experts.loaded or isinstance(experts.store, ExpertWeights)
    )
    if not unplaced:
        raise RuntimeError(
            "this model's experts were already placed by a MoE runtime; load the model again "
            "to build another"
        )
    return experts.store


def _file_bank(bank: ExpertBank, asked: WeightFormat | None) -> ExpertBank:
    """A bank the file stored: kept in its formats; `expert_format` may only quantise floats."""
    if asked is None or bank.formats == (asked, asked):
        return bank
    if bank.is_quantized:
        stored = "/".join(dict.fromkeys(f.name for f in bank.formats))
        raise ValueError(
            f"expert_format={asked.name!r}: the file stores its experts as {stored}, "
            "and hybridmoe does not re-quantise them; leave --expert-format unset"
        )
    return bank.converted(asked)


def _stacked(experts: ExpertWeights, fmt: WeightFormat) -> ExpertBank:
    bank = ExpertBank.stack(experts, fmt)  # quantised straight from the mapped matrices
    release_pages(experts.gate + experts.up + experts.down)  # the bank is now their only copy
    return bank
