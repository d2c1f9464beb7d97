"""kv_cache.lazy_zeros against its reference, torch.zeros: the same tensor (shape, dtype,
contiguity, values, writable), and on the CPU none of its pages resident until written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridmoe.engine.kv_cache import lazy_zeros


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4, 0, 64), (2, 4, 7, 64), (1, 1, 1, 1)])
def test_lazy_zeros_is_torch_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    ours, reference = lazy_zeros(shape, dtype, "cpu"), torch.zeros(shape, dtype=dtype)
    assert ours.shape == reference.shape and ours.dtype == reference.dtype
    assert ours.is_contiguous() and ours.stride() == reference.stride()
    torch.testing.assert_close(ours, reference, atol=0, rtol=0)
    ours.add_(2)
    torch.testing.assert_close(ours, reference + 2, atol=0, rtol=0)


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmRSS line")


def test_lazy_zeros_pages_are_not_resident_until_written() -> None:
    """512 MiB allocated adds (almost) nothing to the RSS; writing one row of it adds that row,
    not the rest (torch.zeros would add all 512 MiB at once: a memset)."""
    before = _rss_bytes()
    cache = lazy_zeros((8, 2**15, 1024), torch.bfloat16, "cpu")  # 512 MiB
    allocated = _rss_bytes()
    cache[0] = 1  # 64 MiB
    written = _rss_bytes()
    assert allocated - before < 32 * 2**20, (before, allocated)
    assert 60 * 2**20 < written - allocated < 100 * 2**20, (allocated, written)
