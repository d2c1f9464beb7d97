"""CpuDeviceSync: the DeviceSync for the `cpu` device, where the accelerator tier is host memory.

Nothing to copy and nothing to wait for: the tensors the compute thread hands over are already
in host memory and complete when handed over.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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

    def to_device(self, host_tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            raise ValueError(f"CpuDeviceSync cannot move a tensor to {device}")
        return host_tensor
