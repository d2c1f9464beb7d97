"""The CUDA platform, which serves ROCm too (PyTorch exposes HIP through the `torch.cuda` API).

Streams: the compute stream is torch's current stream; `copy_stream` carries expert fetches
(host banks -> slots, large); `d2h_stream`, a high-priority one, carries the CPU side's small
inputs (hidden states, ids, weights) to pinned host buffers, so they never queue behind a
fetch. Ordering between streams is by events (`wait_stream` records one); the host only ever
waits in a CPU worker, on the event that says its inputs have landed, and that event is
created with blocking sync so the worker sleeps instead of spinning on a core the CPU experts
need. Nothing here synchronises the whole device on the hot path.

Host expert banks are page-locked with cudaHostRegister (hipHostRegister on ROCm) after they
are filled: allocating pinned memory first and filling it costs minutes on big models, and
torch's pinned allocator rounds sizes up to powers of two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridmoe.errors import PinnedMemoryError

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every context


class CudaPlatform:
    def __init__(self, device: torch.device):
        self.device = device
        self.name = "rocm" if torch.version.hip else "cuda"
        self.copy_stream = torch.cuda.Stream(device)
        # lower is higher; torch maps -1 to the device's highest priority when out of range
        self.d2h_stream = torch.cuda.Stream(device, priority=-1)
        self._pinned: list[int] = []  # data_ptr of every region pin() registered

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu" or tensor.is_pinned():
            return tensor
        size_bytes = tensor.untyped_storage().nbytes()
        ptr = tensor.untyped_storage().data_ptr()
        cudart = torch.cuda.cudart()
        if not hasattr(cudart, "cudaHostRegister"):
            raise PinnedMemoryError(
                f"this torch build ({torch.__version__}, {self.name}) cannot page-lock existing "
                "memory (no cudaHostRegister); pass --no-pin-memory to keep the expert banks in "
                "pageable memory (fetches then copy synchronously and are slower)"
            )
        status = int(cudart.cudaHostRegister(ptr, size_bytes, _HOST_REGISTER_PORTABLE))
        if status != 0:
            raise PinnedMemoryError(
                f"page-locking {size_bytes / 2**30:.2f} GiB of expert bank failed ({self.name} "
                f"error {status}; {len(self._pinned)} banks already pinned). The locked-memory "
                "limit (ulimit -l) or free RAM may be too small; pass --no-pin-memory to keep "
                "the banks in pageable memory (fetches then copy synchronously and are slower)"
            )
        self._pinned.append(ptr)
        return tensor

    def start_copies(
        self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.cuda.Event | None:
        if not copies:
            return None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # queued kernels
        with torch.cuda.stream(self.copy_stream):  # may still read the old destinations
            for src_host, dst_dev in copies:
                dst_dev.copy_(src_host, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return done

    def finish_copies(self, handle: torch.cuda.Event | None) -> None:
        if handle is not None:
            torch.cuda.current_stream(self.device).wait_event(handle)

    def memory_bytes(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def device_sync(self) -> CudaEventSync:
        return CudaEventSync(self.device, self.d2h_stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        cudart = torch.cuda.cudart()
        while self._pinned:
            cudart.cudaHostUnregister(self._pinned.pop())


@dataclass(eq=False)
class _Staging:
    """One job's pinned host buffers: the inputs, and the partial on its way back."""

    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor | None = None
    landed: torch.cuda.Event | None = None  # inputs are in host memory (a worker waits on it)
    returned: torch.cuda.Event | None = None  # the output's copy to the device has run
    key: tuple = field(default=())


class CudaEventSync:
    """DeviceSync over pinned buffers and events.

    to_host: the d2h stream waits for the compute stream, copies the inputs into a pinned
    staging set and records `landed`; the worker sleeps on `landed`. to_device: the partial is
    copied into the set's pinned output and from there to the device on the compute stream,
    so work issued next sees it; the set goes back to a pool keyed by shapes. A submit takes a
    set whose `returned` has passed (queried, never waited for) or makes one: a few sets per
    shape, and shapes are fixed per batch size, so the pool stops growing after the first
    steps of each batch size.
    """

    def __init__(self, device: torch.device, d2h_stream: torch.cuda.Stream):
        self.device, self.d2h_stream = device, d2h_stream
        self._free: dict[tuple, list[_Staging]] = {}
        self.staging_sets = 0  # created so far (tests check it stays bounded)

    def to_host(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], _Staging]:
        staging = self._take(tensors)
        compute = torch.cuda.current_stream(self.device)
        self.d2h_stream.wait_stream(compute)  # the inputs are written by queued compute work
        with torch.cuda.stream(self.d2h_stream):
            for dst_pinned, src_dev in zip(staging.inputs, tensors, strict=True):
                dst_pinned.copy_(src_dev, non_blocking=True)
            staging.landed.record()
        return staging.inputs, staging

    def wait_ready(self, handle: _Staging) -> None:
        handle.landed.synchronize()  # blocking-sync event: the worker sleeps

    def to_device(
        self, handle: _Staging, host_tensor: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        if handle.output is None or handle.output.shape != host_tensor.shape:
            shape, dtype = host_tensor.shape, host_tensor.dtype
            handle.output = torch.empty(shape, dtype=dtype, pin_memory=True)
        handle.output.copy_(host_tensor)  # host memcpy of [T, H]: a few KiB
        partial_dev = handle.output.to(device, non_blocking=True)  # on the compute stream
        handle.returned.record()
        self._free.setdefault(handle.key, []).append(handle)
        return partial_dev

    def _take(self, tensors: Sequence[torch.Tensor]) -> _Staging:
        key = tuple((tuple(t.shape), t.dtype) for t in tensors)
        pool = self._free.get(key, [])
        for i, staging in enumerate(pool):
            if staging.returned.query():  # its last partial has left the pinned output
                return pool.pop(i)
        self.staging_sets += 1
        inputs = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
        return _Staging(
            inputs,
            landed=torch.cuda.Event(blocking=True),
            returned=torch.cuda.Event(blocking=True),
            key=key,
        )
