"""Measurements behind a HardwareProfile (`hybridmoe bench-hw`): host DRAM read bandwidth, the
numba CPU expert kernel and the accelerator tier's expert math per weight format at TOKENS
tokens (three expert sizes, fitted linearly in bytes), a CPU job's round trip, the accelerator's
dense read speed and host -> accelerator copy bandwidth. Each figure is the best of `repeats`
timings (the least disturbed by other work on the machine)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from hybridmoe.moe.backends import accelerator_experts
from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.cpu_experts import fused_cpu_moe
from hybridmoe.planning.hardware import TOKENS, ExpertTime
from hybridmoe.platform.base import Platform
from hybridmoe.quant import activation_q8
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.formats import weight_format

SIZES = ((256, 128), (512, 256), (1024, 512))  # (hidden, intermediate) of the measured experts
ROUTES = 8  # experts per measured call: every token routes to experts 0..7


def best_s(
    fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None
) -> float:
    fn()  # warm-up (compilation, first-touch pages)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def dram_read_gbps(mib: int = 256, repeats: int = 3) -> float:
    """Host memory read bandwidth: a float32 sum over `mib` MiB by torch, on its threads
    (bench-hw's --threads). numpy's sum reads on one core: 13.8-15.9 GB/s on the 2-core Xeon
    where 2 threads read 27-31."""
    data = torch.ones(mib * 2**20 // 4)
    return data.nbytes / best_s(data.sum, repeats) / 1e9


def make_bank(hidden: int, inter: int, fmt_name: str) -> ExpertBank:
    g = torch.Generator().manual_seed(0)
    bank = ExpertBank(
        gate_up=torch.randn(ROUTES, 2 * inter, hidden, generator=g) * 0.02,
        down=torch.randn(ROUTES, hidden, inter, generator=g) * 0.02,
    )
    if bank.fmt.name != fmt_name:
        bank = bank.converted(weight_format(fmt_name))
    # as the engine's default computes that format (OffloadConfig.activation_quant "auto")
    return bank.with_activation_quant(activation_q8.resolve("auto", bank.formats))


def expert_time(
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ExpertBank], object],
    fmt_name: str,
    repeats: int,
    device: torch.device,
    sync: Callable[[], None],
) -> ExpertTime:
    """Per expert: (call seconds) / ROUTES at each of TOKENS, fitted over SIZES in MiB."""
    fixed, per_mib = [], []
    banks = [make_bank(h, i, fmt_name).to(device) for h, i in SIZES]
    # activations as a model of that format computes them: a dense bank's own dtype (no
    # casts), float32 beside a quantised one
    fmt = weight_format(fmt_name)
    act_dtype = torch.float32 if fmt.is_quantized else fmt.storage_dtype
    for tokens in TOKENS:
        points = []
        for bank in banks:
            x = torch.randn(tokens, bank.hidden_size, device=device).to(act_dtype)
            ids = torch.arange(ROUTES, device=device).repeat(tokens, 1)  # [T, ROUTES]
            w = torch.full((tokens, ROUTES), 1.0 / ROUTES, device=device)
            seconds = best_s(lambda b=bank, x=x, i=ids, w=w: run(x, i, w, b), repeats, sync)
            points.append((bank.expert_nbytes / 2**20, seconds / ROUTES))
        intercept, slope = linear_fit(points)
        fixed.append(intercept)
        per_mib.append(slope)
    return ExpertTime(tuple(fixed), tuple(per_mib))


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of seconds over MiB, both clamped at >= 0 (a timing
    disturbed by other work may tilt a fit below zero)."""
    mibs, secs = np.array(points).T
    slope = max(float(np.polyfit(mibs, secs, 1)[0]), 0.0)
    return max(float(np.mean(secs - slope * mibs)), 0.0), slope


def cpu_expert_time(fmt_name: str, threads: int | None, repeats: int = 5) -> ExpertTime:
    def run(x, ids, w, bank):
        return fused_cpu_moe(x, ids, w, bank, threads)

    return expert_time(run, fmt_name, repeats, torch.device("cpu"), lambda: None)


def accel_expert_time(fmt_name: str, platform: Platform, repeats: int = 5) -> ExpertTime:
    """The accelerator tier's expert math (on the cpu device: torch, as `resident` runs)."""
    return expert_time(
        accelerator_experts, fmt_name, repeats, platform.device, platform.synchronize
    )


def cpu_job_s(repeats: int = 30) -> float:
    """An empty CPU executor job's round trip: submit, the worker's wake-up, sync."""
    bank = make_bank(*SIZES[0], "f32")
    executor = CpuMoeExecutor([bank], expert_fn=fused_cpu_moe)
    x, ids, w = torch.zeros(1, bank.hidden_size), torch.full((1, 2), -1), torch.zeros(1, 2)
    try:
        return best_s(
            lambda: (executor.decode_submit(0, x, ids, w), executor.decode_sync(0)), repeats
        )
    finally:
        executor.close()


def dense_gbps(platform: Platform, dtype: torch.dtype, mib: int = 64, repeats: int = 5) -> float:
    """Weight bytes per second of a [1, H] x [H, N] matmul in `dtype` (the dense layers' read)."""
    hidden = 4096
    rows = mib * 2**20 // dtype.itemsize // hidden
    weight = torch.randn(rows, hidden, device=platform.device).to(dtype)
    x = torch.randn(1, hidden, device=platform.device).to(dtype)
    return weight.nbytes / best_s(lambda: F.linear(x, weight), repeats, platform.synchronize) / 1e9


def h2d_gbps(platform: Platform, mib: int = 64, repeats: int = 5) -> float:
    """Copy of one expert-sized block host -> accelerator through the platform's copies."""
    host = platform.pin(torch.ones(mib * 2**20 // 4))
    dest = torch.empty_like(host, device=platform.device)

    def copy() -> None:
        platform.finish_copies(platform.start_copies([(host, dest)]))

    return host.nbytes / best_s(copy, repeats, platform.synchronize) / 1e9
