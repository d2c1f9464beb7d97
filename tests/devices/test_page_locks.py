"""platform/cuda.py's bookkeeping of page-locked host memory, on a fake CUDA runtime (the real one
is exercised by tests/gpu): every registration is undone exactly once, by close() after the
platform's streams have finished, or by a finalizer before the memory is freed; a failed
runtime call's error is cleared so torch's next kernel launch does not report it."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from hybridmoe.errors import PinnedMemoryError
from hybridmoe.platform import cuda
from hybridmoe.platform.cuda import CudaPlatform, CudaRuntime, HostPageLocks

ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered


class FakeCudart:
    """The torch.cuda.cudart() calls page-locking makes, with the runtime's per-thread last
    error (set by every failed call, read and reset by cudaGetLastError)."""

    def __init__(self, log: list[str], refuse: bool = False):
        self.log, self.refuse = log, refuse
        self.registered: dict[int, int] = {}  # ptr -> bytes
        self.last_error = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        if self.refuse or ptr in self.registered:
            self.last_error = ALREADY_REGISTERED
            return ALREADY_REGISTERED
        self.registered[ptr] = size
        self.log.append(f"register {ptr}")
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        if self.registered.pop(ptr, None) is None:
            self.last_error = NOT_REGISTERED
            return NOT_REGISTERED
        self.log.append(f"unregister {ptr}")
        return 0

    def cudaGetLastError(self) -> int:
        error, self.last_error = self.last_error, 0
        return error


class FakeStream:
    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(f"synchronize {self.name}")


@pytest.fixture
def log() -> list[str]:
    return []


@pytest.fixture
def fake_cudart(monkeypatch, log) -> FakeCudart:
    fake = FakeCudart(log)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return fake


def page_locks(log: list[str]) -> HostPageLocks:
    runtime = CudaRuntime(torch.device("cuda", 1))
    return HostPageLocks(runtime, lambda: log.append("before unlock"))


def test_lock_registers_the_whole_storage_and_close_unlocks_it_once(fake_cudart, log):
    locks = page_locks(log)
    bank = torch.zeros(4, 1024)
    locks.lock(bank[1:3], "cuda")  # a view: its storage's base and size are registered
    ptr = bank.untyped_storage().data_ptr()
    assert fake_cudart.registered == {ptr: bank.nbytes} and len(locks) == 1
    locks.close()
    locks.close()  # idempotent
    assert log == [f"register {ptr}", "before unlock", f"unregister {ptr}"]
    assert len(locks) == 0 and fake_cudart.last_error == 0


def test_a_bank_freed_before_close_is_unlocked_before_its_memory_goes(fake_cudart, log):
    locks = page_locks(log)
    bank = torch.zeros(4, 1024)
    ptr = bank.untyped_storage().data_ptr()
    locks.lock(bank, "cuda")
    view = bank[2:]
    del bank
    gc.collect()
    assert fake_cudart.registered == {ptr: 4 * 1024 * 4}  # the view keeps the storage alive
    del view
    assert fake_cudart.registered == {} and len(locks) == 0
    assert log[-2:] == ["before unlock", f"unregister {ptr}"]
    locks.close()  # nothing left to unlock: no second unregister
    assert log.count(f"unregister {ptr}") == 1 and fake_cudart.last_error == 0


def test_a_refused_registration_is_a_clear_error_and_leaves_no_runtime_error(fake_cudart, log):
    fake_cudart.refuse = True
    locks = page_locks(log)
    with pytest.raises(PinnedMemoryError, match=r"error 712.*--no-pin-memory"):
        locks.lock(torch.zeros(8), "cuda")
    assert fake_cudart.last_error == 0  # torch's next kernel-launch check would raise it
    assert len(locks) == 0 and fake_cudart.registered == {}


def test_a_failed_unregistration_leaves_no_runtime_error(fake_cudart, log):
    runtime = CudaRuntime(torch.device("cuda", 0))
    assert runtime.unregister(12345) == NOT_REGISTERED
    assert fake_cudart.last_error == 0


def test_without_get_last_error_a_failure_is_still_reported(monkeypatch, log):
    fake = FakeCudart(log, refuse=True)
    monkeypatch.setattr(FakeCudart, "cudaGetLastError", None)  # as torch.cuda.cudart() is
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    cuda._loaded_get_last_error.cache_clear()
    with pytest.raises(PinnedMemoryError, match="error 712"):
        page_locks(log).lock(torch.zeros(8), "cuda")


def test_close_waits_for_both_streams_before_unlocking(monkeypatch, fake_cudart, log):
    streams = iter(["copy", "d2h"])
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: FakeStream(log, next(streams)))
    platform = CudaPlatform(torch.device("cuda", 0))
    bank = torch.zeros(16)
    assert platform.pin(bank) is bank and platform.pinned_regions == 1
    ptr = bank.untyped_storage().data_ptr()
    platform.close()
    assert log == [
        f"register {ptr}",
        "synchronize copy",
        "synchronize d2h",
        "synchronize copy",  # a region's own unlock waits for the fetches that may read it
        f"unregister {ptr}",
    ]
    assert platform.pinned_regions == 0


@pytest.mark.parametrize(
    ("path", "found"),
    [
        ("/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12", True),
        ("/venv/lib/python3.11/site-packages/torch/lib/libcudart-9335f6a2.so.12", True),
        ("/opt/rocm/lib/libamdhip64.so.6.2.60200", True),
        ("/venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so", False),
    ],
)
def test_the_runtime_library_is_found_among_the_mapped_files(path, found):
    maps = [
        "7f0000000000-7f0000001000 r--p 00000000 00:00 0 ",
        f"7f1000000000-7f1000100000 r-xp 00010000 103:02 4194 {path}",
    ]
    assert cuda.runtime_library_path(maps) == (path if found else None)
