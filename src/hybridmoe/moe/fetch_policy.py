"""How many of a hybrid call's misses to fetch: a fixed cap, or `auto`, which balances the two
sides of the overlapped step from a cost model whose CPU cost is updated from measured times.

The hybrid step of one layer runs the accelerator side (copy `f` fetched experts, then compute
the `h` hits and the `f` fetches) overlapped with the CPU side (compute the `m - f` other
misses). `balanced_fetch_count` picks the `f` in [0, m] that minimises the step's predicted
time: max(accelerator, CPU) with overlap, their sum without.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class FetchPolicy(Protocol):
    def fetch_count(self, layer_idx: int, hits: int, misses: int) -> int:
        """How many of a call's `misses` distinct missing experts to fetch (0..misses), given
        its `hits` distinct resident ones."""
        ...


@dataclass
class FetchCosts:
    """Seconds per expert of one decode call (T tokens) on each side."""

    fetch_s: float  # copy one expert host -> accelerator
    accel_expert_s: float  # one expert's math on the accelerator
    cpu_expert_s: float  # one expert's math on the CPU
    cpu_job_s: float = 0.0  # fixed cost of a CPU job that has routes (dispatch + wake-up)

    def __post_init__(self) -> None:
        for name in ("fetch_s", "accel_expert_s", "cpu_expert_s", "cpu_job_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"FetchCosts.{name} must be >= 0 s, got {getattr(self, name)}")

    def step_s(self, hits: int, fetched: int, on_cpu: int, overlap: bool = True) -> float:
        """Predicted seconds of one hybrid layer call."""
        accel = (hits + fetched) * self.accel_expert_s + fetched * self.fetch_s
        cpu = on_cpu * self.cpu_expert_s + (self.cpu_job_s if on_cpu else 0.0)
        return max(accel, cpu) if overlap else accel + cpu


def balanced_fetch_count(hits: int, misses: int, costs: FetchCosts, overlap: bool = True) -> int:
    """The f in [0, misses] with the least predicted step time; ties go to the larger f (a
    fetched expert may hit again). O(misses)."""
    best_f, best_s = 0, costs.step_s(hits, 0, misses, overlap)
    for f in range(1, misses + 1):
        step_s = costs.step_s(hits, f, misses - f, overlap)
        if step_s <= best_s:
            best_f, best_s = f, step_s
    return best_f


class CpuCostSource(Protocol):
    """Per-layer counters of the CPU executor (CpuLayerStats): routes and seconds computed."""

    routes: int
    busy_s: float


@dataclass
class AutoFetch:
    """`max_fetch auto`: balanced_fetch_count over `costs`, whose cpu_expert_s follows the CPU
    executor's measured seconds per route (an exponential moving average, weight `ema`) once
    `attach` gave it the executor's per-layer stats."""

    costs: FetchCosts
    overlap: bool = True
    ema: float = 0.2
    _cpu_stats: dict | None = None  # layer -> CpuCostSource, the executor's own dict
    _seen: dict | None = None  # layer -> (routes, busy_s) at the last update

    def attach(self, cpu_stats: dict) -> None:
        """Follow the measured CPU cost in `cpu_stats` (CpuMoeExecutor.stats, filled as jobs
        finish)."""
        self._cpu_stats, self._seen = cpu_stats, {}

    def fetch_count(self, layer_idx: int, hits: int, misses: int) -> int:
        self._update(layer_idx)
        return balanced_fetch_count(hits, misses, self.costs, self.overlap)

    def _update(self, layer_idx: int) -> None:
        stats = self._cpu_stats.get(layer_idx) if self._cpu_stats is not None else None
        if stats is None:
            return
        routes0, busy0 = self._seen.get(layer_idx, (0, 0.0))
        if stats.routes < routes0:  # the executor's stats were reset: a new baseline
            routes0, busy0 = 0, 0.0
        routes, busy_s = stats.routes - routes0, stats.busy_s - busy0
        if routes > 0:
            measured = busy_s / routes
            self.costs.cpu_expert_s += self.ema * (measured - self.costs.cpu_expert_s)
            self._seen[layer_idx] = (stats.routes, stats.busy_s)


# Priors until measurements (or a hardware profile) say otherwise: a desktop's DRAM read
# bandwidth, pinned PCIe 4.0 x16, a GPU's memory bandwidth (GB/s).
PRIOR_DRAM_GBPS, PRIOR_PCIE_GBPS, PRIOR_DEVICE_GBPS = 20.0, 12.0, 1000.0


def prior_costs(expert_nbytes: int, on_accelerator: bool) -> FetchCosts:
    """Costs from bandwidth priors: an expert's math reads its bytes once; on the cpu device
    the "accelerator" side is the CPU too and a fetch is a host copy (read + write)."""
    cpu_s = expert_nbytes / (PRIOR_DRAM_GBPS * 1e9)
    if not on_accelerator:
        return FetchCosts(fetch_s=2 * cpu_s, accel_expert_s=cpu_s, cpu_expert_s=cpu_s)
    return FetchCosts(
        fetch_s=expert_nbytes / (PRIOR_PCIE_GBPS * 1e9),
        accel_expert_s=expert_nbytes / (PRIOR_DEVICE_GBPS * 1e9),
        cpu_expert_s=cpu_s,
    )
