"""MoeRuntime: the decode-time expert machinery one engine owns (banks, cache, CPU executor).

The cache owns the HybridDecodeExecutor beside the CPU executor, as the reference does for
now; moving that ownership here is a follow-up (docs/proposals/0001).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from hybridmoe import env
from hybridmoe.models.transformer import MoeCausalLM
from hybridmoe.moe.cache_stats import ExpertCacheStats
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.cpu_experts import create_cpu_expert_fn
from hybridmoe.moe.host_banks import HostExpertBank
from hybridmoe.moe.offload_cache import OffloadMoeCache
from hybridmoe.quant.formats import dense_format, weight_format


@dataclass
class MoeRuntime:
    config: OffloadConfig
    banks: list[HostExpertBank]
    cache: OffloadMoeCache | None
    cpu_executor: CpuMoeExecutor | None

    def close(self) -> None:
        if self.cpu_executor is not None:
            self.cpu_executor.close()

    def reset_stats(self) -> None:
        if self.cache is not None:
            self.cache.reset_stats()
            if self.cache.hybrid_executor is not None:
                self.cache.hybrid_executor.stats.clear()
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
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> MoeRuntime:
    """Attach the decode target's parts to every MoE layer. Targets other than `gpu`, and any
    target with an expert format other than the model's dtype, stack each layer's experts
    into a host bank first (converting them, with a progress bar when `progress`); `gpu` in
    the model's dtype keeps the memory-mapped experts as they are."""
    layers = model.moe_layers
    banks = _adopt_banks(layers, config, model.dtype, progress)
    cache = executor = None
    if config.uses_cache and banks:
        total = sum(bank.num_experts for bank in banks)
        slots = config.num_slots(total)
        needed = OffloadMoeCache.min_slots(model.cfg.top_k, 1, model.cfg.num_experts)
        if config.decode_target == "offload" and slots < needed:
            raise ValueError(
                f"expert_cache_slots={slots} is below the {needed} slots one decode step needs "
                f"in the 'offload' target (top_k={model.cfg.top_k}); use at least {needed}"
            )
        cache = OffloadMoeCache(banks, slots, config.max_fetch, device)
    if config.uses_cpu_executor and banks:
        expert_fn = create_cpu_expert_fn(config.cpu_kernel, config.cpu_threads)
        executor = CpuMoeExecutor(banks, expert_fn=expert_fn)
        if cache is not None:
            overlap = config.overlap and env.hybrid_overlap()
            cache.attach_cpu_executor(executor, overlap)
    for layer in layers:
        layer.attach(config.decode_target, cache, executor)
    return MoeRuntime(config, banks, cache, executor)


def _adopt_banks(
    layers: list, config: OffloadConfig, dtype: torch.dtype, progress: bool
) -> list[HostExpertBank]:
    native = dense_format(dtype)
    fmt = weight_format(config.expert_format) if config.expert_format else native
    if fmt == native:
        return [] if config.decode_target == "gpu" else [layer.adopt_bank() for layer in layers]
    bar = tqdm(layers, desc=f"experts -> {fmt.name}", unit="layer", disable=not progress)
    return [layer.adopt_bank(fmt) for layer in bar]
