"""For tests that need a real accelerator: a timed spin kernel that delays one stream, and CUDA's
sync debug mode, which reports every op that makes the host wait for the device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def spin_cycles(device: torch.device, seconds: float) -> int:
    """Clock cycles for which torch.cuda._sleep spins about `seconds` on `device`."""
    calibration_cycles = 20_000_000
    with torch.cuda.device(device):
        torch.cuda._sleep(1000)  # load the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(calibration_cycles)
        end.record()
        end.synchronize()
    return int(calibration_cycles * seconds * 1000 / start.elapsed_time(end))


def spin(stream: torch.cuda.Stream, cycles: int) -> None:
    """Queue a kernel that spins `cycles` on `stream` (on its device): work queued on the stream
    after it starts that much later, and the host does not wait."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


@contextlib.contextmanager
def sync_debug_mode(mode: str) -> Iterator[None]:
    """torch.cuda.set_sync_debug_mode(`mode`) inside: "error" raises on a synchronising op,
    "warn" warns ("called a synchronizing CUDA operation")."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
