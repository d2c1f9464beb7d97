"""The CUDA platform, which serves ROCm too (PyTorch exposes HIP through the `torch.cuda` API).

Streams: the compute stream is torch's current stream on the platform's device (which need not
be the current device: every stream and event call here names the device or the stream);
`copy_stream` carries expert fetches (host banks -> slots, large); `d2h_stream`, a
high-priority one, carries the CPU side's small inputs (hidden states, ids, weights) to pinned
host buffers, so they never queue behind a fetch. Ordering between streams is by events
(`wait_stream` records one); the host only ever waits in a CPU worker, on the event that says
its inputs have landed, and that event is created with blocking sync so the worker sleeps
instead of spinning on a core the CPU experts need. Nothing here synchronises the whole device
on the hot path.

Host expert banks are page-locked with cudaHostRegister (hipHostRegister on ROCm) after they
are filled: allocating pinned memory first and filling it costs minutes on big models, and
torch's pinned allocator rounds sizes up to powers of two. Each registration is undone by
close() or, at the latest, by a finalizer on the bank's storage before its memory is freed.
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridmoe.errors import PinnedMemoryError

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every context
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered (the same code in HIP)


class CudaPlatform:
    def __init__(self, device: torch.device):
        self.device = device
        self.name = "rocm" if torch.version.hip else "cuda"
        # The accumulation contract (docs/architecture.md) accumulates each bf16 projection in
        # float32; cuBLAS may otherwise reduce split-K partial sums in bf16 (torch's default).
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        self.copy_stream = torch.cuda.Stream(device)
        # lower is higher; torch maps -1 to the device's highest priority when out of range
        self.d2h_stream = torch.cuda.Stream(device, priority=-1)
        # a bank freed before close() waits for the fetches that may still read it
        self._page_locks = HostPageLocks(CudaRuntime(device), self.copy_stream.synchronize)

    @property
    def pinned_regions(self) -> int:
        """Host regions pin() page-locked that are still locked."""
        return len(self._page_locks)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu" or tensor.is_pinned():
            return tensor
        self._page_locks.lock(tensor, self.name)
        return tensor

    def start_copies(
        self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.cuda.Event | None:
        if not copies:
            return None
        compute = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(compute)  # queued kernels may still read the destinations
        with torch.cuda.stream(self.copy_stream):  # also makes the stream's device current
            for src_host, dst_dev in copies:
                dst_dev.copy_(src_host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.copy_stream)
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
        try:  # copies still queued read the banks (fetches, prefill) or write staging buffers
            self.copy_stream.synchronize()
            self.d2h_stream.synchronize()
        finally:
            self._page_locks.close()


def to_device_no_sync(tensor_cpu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor_cpu` on `device` without the host waiting for the device: a host memcpy into
    pinned memory, then an asynchronous copy on `device`'s current stream. The pinned block is
    torch's (its caching host allocator reuses it only after that copy has run), so the caller
    may change or free `tensor_cpu` at once."""
    staged = torch.empty(tensor_cpu.shape, dtype=tensor_cpu.dtype, pin_memory=True)
    staged.copy_(tensor_cpu)
    return staged.to(device, non_blocking=True)


# --- page-locked host memory -------------------------------------------------------------------


class CudaRuntime:
    """cudaHostRegister / cudaHostUnregister (hip* on ROCm), called with `device` current so that
    a thread that has not used it yet binds that device's context (not device 0's). Each returns
    the runtime's status, 0 for success. A failed call also leaves its error as the calling
    thread's "last error", which torch's next kernel-launch check (cudaGetLastError) would raise
    at an unrelated kernel; it is cleared here at once, as torch clears the errors it handles."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cudart = torch.cuda.cudart()

    @property
    def can_register(self) -> bool:
        return hasattr(self.cudart, "cudaHostRegister")

    def register(self, ptr: int, size_bytes: int) -> int:
        with torch.cuda.device(self.device):
            status = self.cudart.cudaHostRegister(ptr, size_bytes, _HOST_REGISTER_PORTABLE)
            return self._handled(status)

    def unregister(self, ptr: int) -> int:
        with torch.cuda.device(self.device):
            return self._handled(self.cudart.cudaHostUnregister(ptr))

    def describe(self, status: int) -> str:
        """The runtime's words for error `status`."""
        try:
            return f"{self.cudart.cudaGetErrorString(self.cudart.cudaError(status))} ({status})"
        except (AttributeError, TypeError, ValueError):
            return f"error {status}"

    def _handled(self, status: object) -> int:
        status = int(status)
        if status != 0:
            clear = getattr(self.cudart, "cudaGetLastError", None) or _loaded_get_last_error()
            if clear is not None:
                clear()
        return status


class HostPageLocks:
    """Host memory regions page-locked in place, each unlocked exactly once: by close(), or when
    its storage is freed, by a finalizer that runs before the allocator releases the memory (a
    region freed while still registered makes a later registration of the same addresses
    fail). `before_unlock` runs first (the platform waits there for copies still reading)."""

    def __init__(self, runtime: CudaRuntime, before_unlock: Callable[[], None]):
        self._runtime, self._before_unlock = runtime, before_unlock
        self._finalizers: list[weakref.finalize] = []

    def __len__(self) -> int:
        return sum(finalizer.alive for finalizer in self._finalizers)

    def lock(self, tensor: torch.Tensor, platform_name: str) -> None:
        """Page-lock `tensor`'s whole storage; PinnedMemoryError naming --no-pin-memory when the
        system refuses (nothing is then registered)."""
        storage = tensor.untyped_storage()
        ptr, size_bytes = storage.data_ptr(), storage.nbytes()
        if size_bytes == 0:
            return
        if not self._runtime.can_register:
            raise PinnedMemoryError(
                f"this torch build ({torch.__version__}, {platform_name}) cannot page-lock "
                "existing memory (no cudaHostRegister); pass --no-pin-memory to keep the expert "
                "banks in pageable memory (fetches then copy synchronously and are slower)"
            )
        status = self._runtime.register(ptr, size_bytes)
        if status != 0:
            shared = (
                " (part of it is page-locked already: a bank sharing a memory page with one "
                "pinned before?)"
                if status == _ALREADY_REGISTERED
                else ""
            )
            raise PinnedMemoryError(
                f"page-locking {size_bytes / 2**30:.2f} GiB of expert bank failed "
                f"({platform_name}: {self._runtime.describe(status)}{shared}; {len(self)} banks "
                "already pinned). The locked-memory limit (ulimit -l) or free RAM may be too "
                "small; pass --no-pin-memory to keep the banks in pageable memory (fetches then "
                "copy synchronously and are slower)"
            )
        self._finalizers = [f for f in self._finalizers if f.alive]
        unlock = weakref.finalize(storage, _unlock, self._runtime, ptr, self._before_unlock)
        self._finalizers.append(unlock)

    def close(self) -> None:
        """Unlock every region still locked. Idempotent."""
        while self._finalizers:
            self._finalizers.pop()()  # a finalizer runs once: a no-op if its storage is gone


def _unlock(runtime: CudaRuntime, ptr: int, before_unlock: Callable[[], None]) -> None:
    try:
        before_unlock()
    finally:
        runtime.unregister(ptr)  # a failure (already unregistered) leaves nothing to undo


@functools.cache
def _loaded_get_last_error() -> Callable[[], int] | None:
    """cudaGetLastError (hipGetLastError), which returns and resets the calling thread's last
    error, from the runtime library this process has loaded: torch.cuda.cudart() does not bind
    it (torch/csrc/cuda/shared/cudart.cpp). RTLD_NOLOAD opens the very copy torch uses, never a
    second one. None where no runtime library is loaded (one linked statically into torch)."""
    library = runtime_library_path(_process_maps())
    if library is None:
        return None
    try:
        handle = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        name = "hipGetLastError" if "amdhip" in Path(library).name else "cudaGetLastError"
        get_last_error = getattr(handle, name)
    except (OSError, AttributeError):
        return None
    get_last_error.restype, get_last_error.argtypes = ctypes.c_int, []
    return get_last_error


def _process_maps() -> list[str]:
    try:
        return Path("/proc/self/maps").read_text().splitlines()
    except OSError:  # not Linux
        return []


def runtime_library_path(maps_lines: Sequence[str]) -> str | None:
    """The CUDA (libcudart) or HIP (libamdhip64) runtime library among the files mapped into
    a process, given the lines of its /proc/<pid>/maps."""
    for line in maps_lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]).name.startswith(("libcudart", "libamdhip64")):
            return fields[5]
    return None


# --- the CPU side's synchronisation ------------------------------------------------------------


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
        staging.landed.record(self.d2h_stream)
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
        compute = torch.cuda.current_stream(device)
        partial_dev = handle.output.to(device, non_blocking=True)  # on `device`'s current stream
        handle.returned.record(compute)
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
