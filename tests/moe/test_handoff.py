"""The hand-off's polling (moe/handoff.py, kernels/spin_wait.py): spin_until sees another
thread's store and gives up after its time; CpuMoeExecutor's jobs poll on both sides and give
the same results polled or not, and a job longer than the polling time is waited for blocked."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest
import torch

from hybridmoe.kernels.spin_wait import SPIN_SUPPORTED, spin_until, store_then_spin
from hybridmoe.moe import handoff
from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.cpu_experts import bank_moe
from moe.test_cpu_executor import WAIT_S, assert_matches, make_inputs, make_layer

pytestmark = pytest.mark.skipif(not SPIN_SUPPORTED, reason="no clock_gettime: never polls")


def test_spin_until_sees_a_store_from_another_thread_and_gives_up_without_one():
    word = np.zeros(1, dtype=np.int64)
    assert spin_until(word.ctypes.data, 0, 0)  # already there
    assert not spin_until(word.ctypes.data, 1, 20_000)  # 20 µs, nobody stores
    started = threading.Event()

    def store() -> None:
        started.wait(WAIT_S)
        word[0] = 3

    thread = threading.Thread(target=store)
    thread.start()
    started.set()
    assert spin_until(word.ctypes.data, 3, int(WAIT_S * 1e9))  # the GIL is released meanwhile
    thread.join(WAIT_S)


def test_store_then_spin_stores_before_it_polls():
    words = np.zeros(2, dtype=np.int64)
    first, second = words.ctypes.data, words.ctypes.data + 8
    assert not store_then_spin(first, 4, second, 1, 0)  # a store alone
    assert words.tolist() == [4, 0]
    answered = []

    def answer() -> None:  # waits for the other side's store, then answers it
        answered.append(spin_until(first, 5, int(WAIT_S * 1e9)))
        words[1] = 1

    thread = threading.Thread(target=answer)
    thread.start()
    assert store_then_spin(first, 5, second, 1, int(WAIT_S * 1e9))
    thread.join(WAIT_S)
    assert answered == [True] and words.tolist() == [5, 1]


class CountingSpin:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bool]] = []  # (address, value waited for, seen)

    def __call__(self, address: int, value: int, max_ns: int) -> bool:
        seen = spin_until(address, value, max_ns)
        self.calls.append((address, value, seen))
        return seen

    def after_store(self, store_at: int, stored: int, address: int, value: int, max_ns: int):
        """store_then_spin's stand-in: the store, then the poll recorded as above."""
        ctypes.c_int64.from_address(store_at).value = stored
        return self(address, value, max_ns) if max_ns else False


def count_spins(monkeypatch) -> CountingSpin:
    spins = CountingSpin()
    monkeypatch.setattr(handoff, "spin_until", spins)
    monkeypatch.setattr(handoff, "store_then_spin", spins.after_store)
    return spins


@pytest.mark.parametrize("spin_us", [0.0, 5000.0])
def test_jobs_give_the_same_partials_polled_or_not(monkeypatch, spin_us):
    spins = count_spins(monkeypatch)
    banks = [make_layer(seed)[1] for seed in range(2)]
    with CpuMoeExecutor(banks, spin_us=spin_us, expert_fn=bank_moe) as executor:
        spins.calls.clear()  # the helpers' first calls, made while the executor is built
        assert executor.handoff.spin_us == spin_us
        for step in range(6):
            for layer, bank in enumerate(banks):
                x, ids, weights = make_inputs(2, 2, seed=10 * step + layer, cpu_fraction=1.0)
                executor.decode_submit(layer, x, ids, weights)
                assert_matches(executor.decode_sync(layer), bank_moe(x, ids, weights, bank))
    if spin_us == 0:
        assert spins.calls == []
    else:  # the worker polled for jobs and saw most of them (a 5 ms window)
        assert sum(seen for _, _, seen in spins.calls) >= 6


class NeverLock:
    """A job's done lock that never comes free: records the timeouts it is waited on with."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def acquire(self, timeout: float) -> bool:
        self.timeouts.append(timeout)
        return False


def test_a_long_job_is_waited_for_blocked_until_just_before_its_expected_end(monkeypatch):
    spins = count_spins(monkeypatch)
    spin = handoff.SpinHandoff(2, spin_us=100.0)
    spins.calls.clear()  # the helpers' first calls, made while it is built
    done_word = spin._words_at + 8 * 2  # layer 1's
    lock = NeverLock()
    assert not spin.wait_done(1, 7, time.perf_counter(), lock, limit_s=WAIT_S)
    assert lock.timeouts == [] and spins.calls == [(done_word, 7, False)]  # no history: polls
    spin.synced(1, 0.05)  # the layer's jobs take 50 ms: block until 100 µs before that
    spins.calls.clear()
    assert not spin.wait_done(1, 8, time.perf_counter(), lock, limit_s=WAIT_S)
    assert len(lock.timeouts) == 1 and 0.0 < lock.timeouts[0] <= 0.05 - 100e-6
    assert spins.calls == [(done_word, 8, False)]  # then polls
    spin.synced(1, 2 * WAIT_S)
    spin.wait_done(1, 9, time.perf_counter(), lock, limit_s=0.5)
    assert lock.timeouts[-1] == 0.5  # never past the caller's limit


def test_a_job_is_collected_after_the_early_wait(monkeypatch):
    bank = make_layer(0)[1]

    def slow(x, ids, weights, bank):
        time.sleep(0.02)
        return bank_moe(x, ids, weights, bank)

    x, ids, weights = make_inputs(2, 2, seed=0, cpu_fraction=1.0)
    with CpuMoeExecutor([bank], spin_us=100.0, expert_fn=slow) as executor:
        for _ in range(3):  # from the second on, the caller first blocks until ~20 ms
            executor.decode_submit(0, x, ids, weights)
            torch.testing.assert_close(executor.decode_sync(0), bank_moe(x, ids, weights, bank))


def test_a_bad_polling_time_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="spin_us must be >= 0"):
        handoff.SpinHandoff(1, -1.0)
    monkeypatch.setenv("HYBRIDMOE_SPIN_US", "fast")
    with pytest.raises(ValueError, match="HYBRIDMOE_SPIN_US"):
        handoff.SpinHandoff(1)
    monkeypatch.setenv("HYBRIDMOE_SPIN_US", "0")
    assert handoff.SpinHandoff(1).spin_us == 0.0
