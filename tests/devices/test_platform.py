"""platform/: device selection, and the cpu platform's contract (the one every target is tested
on without an accelerator). CUDA's are covered by tests/gpu/."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.platform.base import create_device_sync, create_platform, resolve_device
from hybridmoe.platform.cpu import CpuDeviceSync, CpuPlatform

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def test_cpu_is_always_available():
    assert resolve_device("cpu") == torch.device("cpu")
    assert isinstance(create_platform("cpu"), CpuPlatform)


@no_cuda
def test_auto_picks_the_cpu_without_an_accelerator(monkeypatch):
    monkeypatch.delenv("HYBRIDMOE_AUTO_DEVICE", raising=False)
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_the_first_accelerator(monkeypatch):
    monkeypatch.delenv("HYBRIDMOE_AUTO_DEVICE", raising=False)
    assert resolve_device("auto") == torch.device("cuda", 0)


def test_auto_can_be_pinned_by_the_environment(monkeypatch):
    monkeypatch.setenv("HYBRIDMOE_AUTO_DEVICE", "cpu")
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setenv("HYBRIDMOE_AUTO_DEVICE", "meta")
    with pytest.raises(ValueError, match="--device 'meta'"):
        resolve_device("auto")


@no_cuda
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_without_a_device_is_refused_naming_the_flag(spec):
    with pytest.raises(ValueError, match=rf"--device '{spec}'.*sees no CUDA or ROCm device"):
        create_platform(spec)


@pytest.mark.parametrize("spec", ["meta", "mps", "gpu", "cuda:x", ""])
def test_unknown_or_unsupported_devices_are_refused(spec):
    with pytest.raises(ValueError, match="--device"):
        resolve_device(spec)


def test_cpu_platform_copies_at_once_and_pins_nothing():
    platform = create_platform(torch.device("cpu"))
    src, dst = torch.arange(6.0), torch.zeros(6)
    handle = platform.start_copies([(src, dst)])
    assert torch.equal(dst, src)  # finished when start_copies returns
    platform.finish_copies(handle)
    tensor = torch.ones(3)
    assert platform.pin(tensor) is tensor
    assert platform.memory_bytes() is None
    platform.synchronize()
    platform.close()
    platform.close()  # idempotent


def test_cpu_device_sync_copies_nothing_and_is_always_ready():
    sync = create_device_sync("cpu")
    assert isinstance(sync, CpuDeviceSync)
    tensors = (torch.ones(2, 3), torch.zeros(2, 1, dtype=torch.long))
    host, handle = sync.to_host(tensors)
    assert all(a is b for a, b in zip(host, tensors, strict=True))
    sync.wait_ready(handle)  # returns at once
    assert sync.to_device(handle, tensors[0], torch.device("cpu")) is tensors[0]


def test_cpu_device_sync_refuses_device_tensors():
    with pytest.raises(ValueError, match="create_device_sync"):
        CpuDeviceSync().to_host([torch.empty(2, device="meta")])


def test_create_platform_refuses_a_device_type_without_a_platform():
    with pytest.raises(ValueError, match="no platform for device 'meta'.*cpu, cuda"):
        create_platform(torch.device("meta"))  # it used to get the CUDA platform
