"""With overlap on, the CPU side of a hybrid step computes while the accelerator side runs; with
it off, one after the other. Both sides are made slow on purpose (the CPU expert function
sleeps, the accelerator runs a timed spin kernel first) and their intervals are measured on one
clock: the CPU's with perf_counter, the device's with CUDA events mapped to perf_counter."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from hybridmoe.kernels.torch_moe import gathered_moe
from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.cpu_experts import bank_moe
from hybridmoe.moe.hybrid_decode import HybridDecodeExecutor, HybridDecodeRequest
from hybridmoe.moe.offload_cache import OffloadMoeCache
from hybridmoe.platform.base import Platform, create_platform
from hybridmoe.quant.bank import ExpertBank

from .device_helpers import spin_cycles

pytestmark = pytest.mark.cuda_only

E, H, INTER = 8, 128, 64
CPU_SLEEP_S = 0.03  # the CPU expert function sleeps this long (time.sleep releases the GIL)
GPU_SPIN_S = 0.05  # the accelerator spins this long before its expert math
STEPS = 4
# Mapping device time to host time is off by a launch latency (microseconds); the margins below
# are orders of magnitude wider.
SERIAL_MAX_OVERLAP_S = 1e-3
OVERLAP_MIN_S = CPU_SLEEP_S / 2

Interval = tuple[float, float]  # (start, end) in perf_counter seconds


class DeviceClock:
    """CUDA events in host time: a reference event recorded on an idle device next to a
    perf_counter() reading; an event's host time is that reading plus the device time between."""

    def __init__(self, device: torch.device):
        torch.cuda.synchronize(device)
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record()
        self.ref_host_s = time.perf_counter()

    def host_s(self, event: torch.cuda.Event) -> float:
        return self.ref_host_s + self.ref.elapsed_time(event) / 1000  # elapsed_time is in ms


def overlap_s(a: Interval, b: Interval) -> float:
    """Length of the intersection of two intervals; negative: the gap between them."""
    return min(a[1], b[1]) - max(a[0], b[0])


@dataclass
class Parts:
    platform: Platform
    bank: ExpertBank  # one MoE layer, in pinned host memory
    cache: OffloadMoeCache
    executor: CpuMoeExecutor
    cpu_intervals: list[Interval]


@pytest.fixture
def parts(device: torch.device) -> Iterator[Parts]:
    platform = create_platform(device)
    gen = torch.Generator().manual_seed(0)
    bank = ExpertBank(
        torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5,
        torch.randn(E, H, INTER, generator=gen) / INTER**0.5,
    )
    platform.pin(bank.gate_up), platform.pin(bank.down)
    # One slot, one fetch a call: routing [[0, 1]] puts expert 0 in the slot at the first step
    # and expert 1 on the CPU at every step (the slot is in use by the same call).
    cache = OffloadMoeCache([bank], num_slots=1, max_fetch=1, platform=platform)
    cpu_intervals: list[Interval] = []

    def slow_expert_fn(x, ids, weights, bank):
        start = time.perf_counter()
        time.sleep(CPU_SLEEP_S)
        out = bank_moe(x, ids, weights, bank)
        cpu_intervals.append((start, time.perf_counter()))
        return out

    executor = CpuMoeExecutor([bank], expert_fn=slow_expert_fn, sync=platform.device_sync())
    try:
        yield Parts(platform, bank, cache, executor, cpu_intervals)
    finally:
        executor.close()
        platform.close()


def hybrid_step(parts: Parts, hybrid: HybridDecodeExecutor, cycles: int, device: torch.device):
    """One hybrid step of a token routed to experts [0, 1], its output checked against the
    reference: (the CPU side's interval, the accelerator side's interval)."""
    gen = torch.Generator().manual_seed(len(parts.cpu_intervals))
    x = torch.randn(1, H, generator=gen)
    weights = torch.tensor([[0.6, 0.4]])
    clock = DeviceClock(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def slow_gpu_runner(hidden, slots, gpu_weights):
        start.record()
        torch.cuda._sleep(cycles)
        out = gathered_moe(hidden, slots, gpu_weights, parts.cache.slot_bank)
        end.record()
        return out

    ids_dev = torch.tensor([[0, 1]], device=device)
    request = HybridDecodeRequest(0, x.to(device), ids_dev, weights.to(device))
    out = hybrid.decode(request, slow_gpu_runner)
    torch.cuda.synchronize(device)
    expected = bank_moe(x, torch.tensor([[0, 1]]), weights, parts.bank)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    return parts.cpu_intervals[-1], (clock.host_s(start), clock.host_s(end))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_cpu_and_accelerator_intervals(parts: Parts, device: torch.device, overlap: bool) -> None:
    cycles = spin_cycles(device, GPU_SPIN_S)
    hybrid = HybridDecodeExecutor(parts.cache, parts.executor, overlap=overlap)
    steps = [hybrid_step(parts, hybrid, cycles, device) for _ in range(STEPS)]
    report = "; ".join(
        f"cpu {(c[1] - c[0]) * 1e3:.1f} ms, gpu {(g[1] - g[0]) * 1e3:.1f} ms, "
        f"intersection {overlap_s(c, g) * 1e3:+.1f} ms"
        for c, g in steps
    )
    print(f"overlap={overlap}: {report}")
    assert parts.cache.stats_by_layer[0].cpu_routes == STEPS, report  # expert 1: CPU each step
    assert parts.cache.stats_by_layer[0].fetched == 1, report  # expert 0 fetched once, then hit
    for cpu, gpu in steps:
        # both sides really were slow (the spin's calibration may be off by clock changes)
        assert cpu[1] - cpu[0] >= CPU_SLEEP_S and gpu[1] - gpu[0] >= GPU_SPIN_S / 4, report
        if overlap:
            assert overlap_s(cpu, gpu) >= OVERLAP_MIN_S, f"the sides did not overlap: {report}"
        else:
            assert overlap_s(cpu, gpu) <= SERIAL_MAX_OVERLAP_S, f"the sides overlapped: {report}"
