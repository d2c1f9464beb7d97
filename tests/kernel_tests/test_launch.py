"""numba_moe.launch sets numba's thread count (per calling thread in numba) only when it
changes for the calling thread: each thread's kernels run on the count it asked for, whatever
another thread launched with meanwhile, and a repeated count costs no numba call."""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest
from numba import prange

from hybridmoe.kernels import numba_moe
from hybridmoe.kernels.numba_moe import launch, max_threads


@numba.njit(parallel=True, cache=False)
def _seen_counts(out):
    """out[i]: the thread count of the parallel region that computed item i."""
    for i in prange(out.shape[0]):
        out[i] = numba.get_num_threads()


def _counts(threads: int | None) -> set[int]:
    out = np.zeros(64, np.int64)
    launch(_seen_counts, threads, out)
    return set(out.tolist())


def _in_thread(fn):
    """fn() on a new thread (a fresh numba thread count); its result or its exception."""
    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as err:  # re-raised on the test's thread
            result["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.mark.skipif(max_threads() < 2, reason="needs numba's pool of 2 threads or more")
def test_each_thread_keeps_its_own_count():
    assert _counts(1) == {1}
    assert numba.get_num_threads() == 1
    # another thread's first launch sets its own count, even the count this thread has
    assert _in_thread(lambda: _counts(1)) == {1}
    assert _in_thread(lambda: (_counts(2), numba.get_num_threads())) == ({2}, 2)
    assert _in_thread(lambda: _counts(None)) == {max_threads()}  # None: the whole pool
    assert _counts(1) == {1}  # this thread's count is as it set it
    assert _counts(2) == {2}  # a change applies at once
    assert _counts(1) == {1}


def test_the_chunk_size_is_set_on_each_thread():
    """Work items one at a time on every launching thread (numba's chunk size, per thread,
    is 0 on a new thread)."""
    assert _in_thread(lambda: (_counts(1), numba.get_parallel_chunksize())) == ({1}, 1)


def test_a_repeated_count_sets_nothing(monkeypatch: pytest.MonkeyPatch):
    calls = []
    real = numba.set_num_threads
    monkeypatch.setattr(numba, "set_num_threads", lambda n: (calls.append(n), real(n)))
    assert numba_moe.numba is numba  # launch calls it through this module's `numba`

    def launches():
        for _ in range(3):
            _counts(1)
        _counts(max_threads())
        _counts(max_threads())
        return list(calls)

    expected = [1, max_threads()] if max_threads() > 1 else [1]
    assert _in_thread(launches) == expected
