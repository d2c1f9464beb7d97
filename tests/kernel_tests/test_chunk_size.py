"""The decode kernels' parallel loops hand out their work items in chunks, CHUNKS_PER_THREAD a
thread (kernels/numba_moe.chunk_size), set in jitted code by numba's runtime symbols
(set_chunk_size): the caller's chunk size comes back after a kernel, and a kernel setting it
is still cached on disk (numba.set_parallel_chunksize in jitted code is not)."""

from __future__ import annotations

import warnings

import numba
import numpy as np
import pytest
import torch
from numba.core.errors import NumbaWarning

from hybridmoe.kernels.numba_moe import CHUNKS_PER_THREAD, chunk_size, max_threads, set_chunk_size
from hybridmoe.moe.cpu_experts import _BANK_CALLS, fused_cpu_moe
from hybridmoe.quant.bank import ExpertBank


@numba.njit
def _set(items):
    return set_chunk_size(items)


@numba.njit
def _chunks(items):
    return chunk_size(items)


def test_set_chunk_size_returns_the_size_it_replaces() -> None:
    saved = numba.get_parallel_chunksize()
    try:
        numba.set_parallel_chunksize(3)
        assert _set(7) == 3
        assert numba.get_parallel_chunksize() == 7
    finally:
        numba.set_parallel_chunksize(saved)


@pytest.mark.skipif(max_threads() < 2, reason="needs 2 threads in numba's pool")
def test_each_thread_takes_its_share_of_chunks() -> None:
    saved = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        items = 2 * CHUNKS_PER_THREAD * 6
        assert _chunks(items) == 6  # CHUNKS_PER_THREAD chunks a thread
        assert _chunks(items + 5) == 6
        assert _chunks(3) == 1  # fewer items than chunks: one item at a time
    finally:
        numba.set_num_threads(saved)


def test_a_kernel_gives_back_the_callers_chunk_size() -> None:
    g = torch.Generator().manual_seed(0)
    bank = ExpertBank(torch.randn(4, 2 * 64, 96, generator=g), torch.randn(4, 96, 64, generator=g))
    ids = torch.tensor([[0, 2], [3, 1]])
    x, weights = torch.randn(2, 96, generator=g), torch.rand(2, 2, generator=g)
    expected = fused_cpu_moe(x, ids, weights, bank)  # compiled, the pool started
    call = _BANK_CALLS[bank]
    y = np.zeros(2 * 96, np.float32)
    args = (x.reshape(-1).numpy(), ids.reshape(-1).numpy(), weights.reshape(-1).numpy())
    extras = call.extras(bank, torch.float32, torch.float32)
    saved = numba.get_parallel_chunksize()
    try:
        numba.set_parallel_chunksize(5)
        call.kernel(*args, *call.weights, 2, *extras, y)  # on this thread, not through launch
        assert numba.get_parallel_chunksize() == 5
    finally:
        numba.set_parallel_chunksize(saved)
    assert torch.equal(torch.from_numpy(y).view(2, 96), expected)


def test_a_kernel_setting_chunks_is_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))

    def chunked(out):
        previous = set_chunk_size(chunk_size(out.shape[0]))
        for i in numba.prange(out.shape[0]):
            out[i] = i
        set_chunk_size(previous)

    with warnings.catch_warnings():
        warnings.simplefilter("error", NumbaWarning)  # "Cannot cache ... dynamic globals"
        kernel = numba.njit(cache=True, parallel=True)(chunked)
        out = np.zeros(100)
        kernel(out)
    assert np.array_equal(out, np.arange(100.0))
    assert any(tmp_path.rglob("*.nbi")), "nothing written to the cache"
