"""DeviceSync: where accelerator progress meets CPU worker progress.

The CPU executor moves a decode step's inputs to host memory, lets a worker thread compute the
CPU routes, and moves the CPU partial back. How the worker learns that the inputs have arrived,
and how the compute side waits for the partial, depends on the device (CUDA events and pinned
buffers, HIP signals, nothing at all on the CPU). platform/ is the only package that creates
streams or events or synchronises; everything above it goes through this interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

# Opaque: only the DeviceSync that returned it from to_host() reads it.
ReadyHandle = object


class DeviceSync(Protocol):
    def to_host(
        self, tensors: Sequence[torch.Tensor]
    ) -> tuple[tuple[torch.Tensor, ...], ReadyHandle]:
        """Start moving `tensors` (on the device) to host memory without blocking the caller.

        Called on the compute thread at submit. Returns the host tensors, in order, and a
        handle; the host tensors must not be read before `wait_ready(handle)` returns. The
        caller must not modify `tensors` until the matching `to_device` has been called.
        """
        ...

    def wait_ready(self, handle: ReadyHandle) -> None:
        """Block until the host tensors behind `handle` hold the device's values.

        Called on the worker thread, before it reads them.
        """
        ...

    def to_device(self, host_tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`host_tensor` (the finished CPU partial) as a tensor on `device`.

        Called on the compute thread at sync, after the worker has finished writing it; the
        result is safe to use in work the compute side issues next.
        """
        ...


def create_device_sync(device: torch.device | str) -> DeviceSync:
    """The DeviceSync for `device`'s type. Only `cpu` exists so far."""
    device = torch.device(device)
    if device.type == "cpu":
        from hybridmoe.platform.cpu import CpuDeviceSync

        return CpuDeviceSync()
    raise NotImplementedError(
        f"no DeviceSync for device {str(device)!r} (type {device.type!r}): only 'cpu' is "
        "implemented; the CUDA/ROCm synchronisation backend is a later issue"
    )
