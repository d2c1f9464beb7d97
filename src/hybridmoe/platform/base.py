"""The accelerator platform: device selection, and where accelerator progress meets host work.

platform/ is the only package that creates streams or events or synchronises; everything
above it goes through the two protocols here:

- `DeviceSync`: how the CPU executor moves a decode step's inputs to host memory, lets a
  worker compute the CPU routes, and moves the CPU partial back (CUDA events and pinned
  buffers on an accelerator, nothing at all on the CPU);
- `Platform`: the rest of what the engine needs from a device: page-locking host memory,
  copying experts into accelerator slots ordered before the kernels that read them, memory
  figures for planning, and a DeviceSync.

On a machine without an accelerator the accelerator tier is the `cpu` torch device
(`CpuPlatform`): every decode target runs unchanged, which is how all of the above is tested.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from hybridmoe import env

# Opaque: only the DeviceSync that returned it from to_host() reads it.
ReadyHandle = object
# Opaque: only the Platform that returned it from start_copies() reads it.
CopyHandle = object

DEVICE_HELP = "auto (the accelerator when torch sees one, else cpu), cpu, cuda or cuda:N"


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

    def to_device(
        self, handle: ReadyHandle, host_tensor: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """`host_tensor` (the finished CPU partial of the job behind `handle`) on `device`.

        Called on the compute thread at sync, after the worker has finished; the result is
        safe to use in work the compute side issues next, and the job's host buffers may be
        reused once the copy it issues has run.
        """
        ...


class Platform(Protocol):
    device: torch.device  # the accelerator tier: where dense weights, KV cache and slots live
    name: str  # "cpu", "cuda" or "rocm"

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-lock host `tensor` in place (already filled) so copies from it run
        asynchronously; returns it. Raises PinnedMemoryError when the system refuses."""
        ...

    def start_copies(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> CopyHandle:
        """Start copying each (host source, device destination) pair, ordered after the
        accelerator work already issued (which may still read the destinations); never waits
        on the host. Work issued later may run alongside the copies until finish_copies()."""
        ...

    def finish_copies(self, handle: CopyHandle) -> None:
        """Make accelerator work issued after this call wait for the copies behind `handle`
        (a device-side wait: the host does not block)."""
        ...

    def memory_bytes(self) -> tuple[int, int] | None:
        """(free, total) bytes of device memory; None when the tier is host memory."""
        ...

    def device_sync(self) -> DeviceSync:
        """A new DeviceSync for this device, with its own host buffers."""
        ...

    def synchronize(self) -> None:
        """Wait until all work issued to the device has finished (tests and benchmarks)."""
        ...

    def close(self) -> None:
        """Unpin what pin() page-locked. Idempotent."""
        ...


def resolve_device(spec: str) -> torch.device:
    """The torch device `--device spec` names; ValueError naming the flag when torch cannot
    use it. `auto` is the first accelerator when torch sees one, else `cpu` (or what
    HYBRIDMOE_AUTO_DEVICE says, env.auto_device)."""
    if spec == "auto":
        if env.auto_device() is not None:
            return resolve_device(env.auto_device())
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise ValueError(f"--device {spec!r} is not a device: use {DEVICE_HELP}") from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device {spec!r}: only {DEVICE_HELP} are supported")
    if not torch.cuda.is_available():
        build = torch.__version__
        raise ValueError(
            f"--device {spec!r}: torch {build} sees no CUDA or ROCm device (a CPU-only build, "
            "or no driver); install a CUDA/ROCm build of torch, or use --device cpu"
        )
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"--device {spec!r}: there are only {torch.cuda.device_count()} devices (cuda:0.."
            f"cuda:{torch.cuda.device_count() - 1})"
        )
    return torch.device("cuda", index)


def _cpu_platform(device: torch.device) -> Platform:
    from hybridmoe.platform.cpu import CpuPlatform

    return CpuPlatform()


def _cuda_platform(device: torch.device) -> Platform:
    from hybridmoe.platform.cuda import CudaPlatform  # CUDA and ROCm (torch.cuda serves both)

    return CudaPlatform(device)


# torch device type -> factory(device); each imports its vendor module when first called
PLATFORMS: dict[str, Callable[[torch.device], Platform]] = {
    "cpu": _cpu_platform,
    "cuda": _cuda_platform,
}


def create_platform(device: torch.device | str) -> Platform:
    """The Platform for `device` (a torch device or a `--device` spec); ValueError for a device
    type no platform is registered for."""
    device = resolve_device(device) if isinstance(device, str) else torch.device(device)
    factory = PLATFORMS.get(device.type)
    if factory is None:
        raise ValueError(
            f"no platform for device {str(device)!r}; registered: {', '.join(sorted(PLATFORMS))}"
        )
    return factory(device)


def create_device_sync(device: torch.device | str) -> DeviceSync:
    """The DeviceSync for `device`'s type."""
    return create_platform(device).device_sync()


def to_device_no_sync(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; a host tensor reaches an accelerator without the host waiting
    for the device (staged through pinned memory), and the caller may change or free it at
    once. On the cpu device it is `tensor` itself (returned without torch's `to`: an aten op,
    ~10-20 µs on a decode step's cold caches)."""
    if device.type == "cpu" and tensor.is_cpu:
        return tensor
    if tensor.device.type != "cpu" or device.type == "cpu":
        return tensor.to(device)
    from hybridmoe.platform.cuda import to_device_no_sync as cuda_to_device_no_sync

    return cuda_to_device_no_sync(tensor, device)
