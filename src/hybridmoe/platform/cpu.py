"""The `cpu` platform, where the accelerator tier is host memory.

Nothing to copy asynchronously and nothing to wait for: tensors handed over are already in
host memory and complete when handed over, and a copy has finished when it returns.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

MEMINFO = Path("/proc/meminfo")


class CpuDeviceSync:
    def to_host(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], None]:
        for tensor in tensors:
            if tensor.device.type != "cpu":
                raise ValueError(
                    f"CpuDeviceSync got a tensor on {tensor.device}; "
                    "create the DeviceSync for that device with create_device_sync()"
                )
        return tuple(tensors), None  # no copies; the handle is already complete

    def wait_ready(self, handle: None) -> None:
        return None

    def to_device(
        self, handle: None, host_tensor: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            raise ValueError(f"CpuDeviceSync cannot move a tensor to {device}")
        return host_tensor


class CpuPlatform:
    device = torch.device("cpu")
    name = "cpu"

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # host memory is the tier itself: nothing is copied asynchronously

    def start_copies(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for src, dst in copies:
            dst.copy_(src)  # finished when it returns

    def finish_copies(self, handle: None) -> None:
        return None

    def memory_bytes(self) -> None:
        return None

    def device_sync(self) -> CpuDeviceSync:
        return CpuDeviceSync()

    def synchronize(self) -> None:
        return None

    def close(self) -> None:
        return None


def host_available_bytes() -> int:
    """Bytes of host memory available to a new allocation without swapping: Linux's
    MemAvailable (free plus reclaimable page cache); elsewhere the free physical pages."""
    if MEMINFO.exists():
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file says kB
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
