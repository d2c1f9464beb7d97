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
from hybridmoe.models.transformer import MoeCausalLM
from hybridmoe.moe.cache_stats import ExpertCacheStats
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.cpu_experts import create_cpu_expert_fn
from hybridmoe.moe.host_banks import HostExpertBank
from hybridmoe.moe.hybrid_decode import HybridDecodeExecutor
from hybridmoe.moe.offload_cache import OffloadMoeCache
from hybridmoe.moe.prefill import ExpertPrefill, LayerStreamer
from hybridmoe.platform.base import Platform
from hybridmoe.platform.cpu import CpuPlatform
from hybridmoe.quant.formats import dense_format, weight_format

if TYPE_CHECKING:
    from hybridmoe.engine.placement import DeviceMemoryPlan
    from hybridmoe.layers.moe import OffloadMoELayer


@dataclass
class MoeRuntime:
    config: OffloadConfig
    layers: list[OffloadMoELayer]
    banks: list[HostExpertBank]
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
            layer.detach()
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


def create_moe_runtime(
    model: MoeCausalLM,
    config: OffloadConfig,
    platform: Platform | None = None,
    progress: bool = False,
    memory: DeviceMemoryPlan | None = None,
) -> MoeRuntime:
    """Attach the decode target's parts to every MoE layer, on `platform` (default: the cpu
    device). Targets other than `gpu`, any target on an accelerator, and any target with an
    expert format other than the model's dtype stack each layer's experts into a host bank
    first (converting them, with a progress bar when `progress`); `gpu` on the cpu device in
    the model's dtype keeps the memory-mapped experts as they are. With a memory plan the
    slot count comes from it (DeviceMemoryError when it does not fit)."""
    platform = platform if platform is not None else CpuPlatform()
    layers = model.moe_layers
    on_accelerator = platform.device.type != "cpu"
    # a memory plan counts the experts from their banks, so a planned `gpu` target stacks too
    stack_all = on_accelerator or memory is not None
    banks = _adopt_banks(layers, config, model.dtype, progress, stack_all)
    if config.decode_target == "gpu":
        return _attach_resident(layers, config, platform, banks, memory)
    if not banks:  # a model without MoE layers
        return _attach(layers, config, platform, banks)
    if on_accelerator and config.pin_memory:
        for bank in tqdm(banks, desc="pinning expert banks", unit="layer", disable=not progress):
            platform.pin(bank.gate_up), platform.pin(bank.down)
    # On the cpu device `auto` computes prefill from the banks in place: no ExpertPrefill.
    prefill_mode = config.prefill if on_accelerator or config.prefill != "auto" else None
    prefill_bytes = _prefill_bytes(prefill_mode, banks[0], memory)
    cache = executor = hybrid = prefill = None
    if config.uses_cache:
        slots = _num_slots(model, config, banks, memory, prefill_bytes)
        cache = OffloadMoeCache(banks, slots, config.max_fetch, platform)
    if prefill_mode is not None or config.uses_cpu_executor:
        expert_fn = create_cpu_expert_fn(config.cpu_kernel, config.cpu_threads)
    if prefill_mode is not None:
        prefill = ExpertPrefill(banks, platform, expert_fn, prefill_mode, config.prefill_cpu_tokens)
    if config.uses_cpu_executor:  # last: nothing after it can fail and leave its threads
        executor = CpuMoeExecutor(banks, expert_fn=expert_fn, sync=platform.device_sync())
        if cache is not None:
            hybrid = HybridDecodeExecutor(cache, executor, config.overlap and env.hybrid_overlap())
    return _attach(layers, config, platform, banks, cache, executor, hybrid, prefill)


def _prefill_bytes(
    prefill_mode: str | None, bank: HostExpertBank, memory: DeviceMemoryPlan | None
) -> int:
    """Device bytes of prefill's layer buffers (none when prefill never streams)."""
    streams = prefill_mode is not None and ExpertPrefill.streams(prefill_mode)
    needed = LayerStreamer.nbytes(bank) if streams else 0
    if memory is not None and needed > memory.expert_bytes:
        raise DeviceMemoryError(
            f"streaming prefill needs two layers of experts on the device "
            f"({needed / 2**30:.2f} GiB): {memory.describe()}; use --prefill cpu, or raise "
            "--gpu-memory"
        )
    return needed


def _attach_resident(
    layers: list,
    config: OffloadConfig,
    platform: Platform,
    banks: list[HostExpertBank],
    memory: DeviceMemoryPlan | None,
) -> MoeRuntime:
    """The `gpu` target: every bank on the device (none when the layers keep their experts)."""
    if memory is not None and banks:
        total = sum(bank.num_experts for bank in banks)
        memory.check_all_experts_fit(banks[0].expert_nbytes, total)
    device_banks = [bank.to(platform.device) for bank in banks]  # frees the host copies
    for layer, bank in zip(layers[: len(device_banks)], device_banks, strict=True):
        layer.bank = bank
    return _attach(layers, config, platform, device_banks)


def _attach(
    layers: list[OffloadMoELayer],
    config: OffloadConfig,
    platform: Platform,
    banks: list[HostExpertBank],
    cache: OffloadMoeCache | None = None,
    executor: CpuMoeExecutor | None = None,
    hybrid: HybridDecodeExecutor | None = None,
    prefill: ExpertPrefill | None = None,
) -> MoeRuntime:
    for layer in layers:
        layer.attach(config.decode_target, cache, executor, hybrid, prefill)
    return MoeRuntime(config, layers, banks, cache, executor, hybrid, platform, prefill)


def _num_slots(
    model: MoeCausalLM,
    config: OffloadConfig,
    banks: list[HostExpertBank],
    memory: DeviceMemoryPlan | None,
    prefill_bytes: int,
) -> int:
    total = sum(bank.num_experts for bank in banks)
    if memory is None:
        slots = config.num_slots(total)
    else:  # a size the user gave must fit; else the slots fill the budget
        asked = config.num_slots(total) if config.cache_size_given else None
        slots = memory.slots(prefill_bytes, banks[0].expert_nbytes, total, asked)
    needed = OffloadMoeCache.min_slots(model.cfg.top_k, 1, model.cfg.num_experts)
    if config.decode_target == "offload" and slots < needed:
        raise ValueError(
            f"expert_cache_slots={slots} is below the {needed} slots one decode step needs "
            f"in the 'offload' target (top_k={model.cfg.top_k}); use at least {needed}"
        )
    return slots


def _adopt_banks(
    layers: list, config: OffloadConfig, dtype: torch.dtype, progress: bool, always: bool
) -> list[HostExpertBank]:
    native = dense_format(dtype)
    fmt = weight_format(config.expert_format) if config.expert_format else native
    if fmt == native:
        if config.decode_target == "gpu" and not always:  # computed from the mapped experts
            for layer in layers:
                layer.experts.align()
            return []
        return [layer.adopt_bank(None, drop_experts=always) for layer in layers]
    bar = tqdm(layers, desc=f"experts -> {fmt.name}", unit="layer", disable=not progress)
    return [layer.adopt_bank(fmt) for layer in bar]
