"""kernels/threads.serial_torch_ops: torch at one thread inside, the kernels' default thread
count kept, everything restored after (an exception too), nesting harmless; and the dense
kernel's result under it is the same bits."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kernels.projection import DenseProjection
from hybridmoe.kernels.threads import kernel_threads, serial_torch_ops


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def test_serial_inside_kernel_threads_kept_and_restored(two_threads):
    assert kernel_threads() == 2
    with serial_torch_ops():
        assert torch.get_num_threads() == 1 and kernel_threads() == 2
        with serial_torch_ops():  # nested: still serial, and leaving it does not restore yet
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1 and kernel_threads() == 2
    assert torch.get_num_threads() == 2 and kernel_threads() == 2


def test_restored_after_an_exception(two_threads):
    with pytest.raises(ValueError, match="boom"), serial_torch_ops():
        raise ValueError("boom")
    assert torch.get_num_threads() == 2 and kernel_threads() == 2


def test_dense_kernel_gives_the_same_bits_under_it(two_threads):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1024, 512, generator=g).bfloat16()  # 1 MiB: launched on 2 threads
    x = torch.randn(3, 512, generator=g).bfloat16()
    projection = DenseProjection(weight)
    outside = projection(x)
    with serial_torch_ops():
        inside = projection(x)
    assert torch.equal(inside, outside)
