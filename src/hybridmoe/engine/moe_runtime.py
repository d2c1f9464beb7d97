"""MoeRuntime: the decode-time expert machinery one engine owns (banks, cache, CPU executor).

The cache owns the HybridDecodeExecutor beside the CPU executor, as the reference does for
now; moving that ownership here is a follow-up (docs/proposals/0001).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe import env
from hybridmoe.models.transformer import MoeCausalLM
from hybridmoe.moe.cache_stats import ExpertCacheStats
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.host_banks import HostExpertBank
from hybridmoe.moe.offload_cache import OffloadMoeCache


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
    model: MoeCausalLM, config: OffloadConfig, device: torch.device | str = "cpu"
) -> MoeRuntime:
    """Attach the decode target's parts to every MoE layer. Targets other than `gpu` stack each
    layer's experts into a host bank first; `gpu` keeps the memory-mapped experts as they are."""
    layers = model.moe_layers
    banks = [] if config.decode_target == "gpu" else [layer.adopt_bank() for layer in layers]
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
        executor = CpuMoeExecutor(banks, threads=config.cpu_threads)
        if cache is not None:
            overlap = config.overlap and env.hybrid_overlap()
            cache.attach_cpu_executor(executor, overlap)
    for layer in layers:
        layer.attach(config.decode_target, cache, executor)
    return MoeRuntime(config, banks, cache, executor)
