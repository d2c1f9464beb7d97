"""The hand-off's polling (moe/handoff.py, kernels/spin_wait.py): spin_until sees another
thread's store and gives up after its time; CpuMoeExecutor's jobs poll on both sides and give
the same results polled or not, and a job longer than the polling time is waited for blocked."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from hybridmoe.kernels.spin_wait import SPIN_SUPPORTED, spin_until
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


class CountingSpin:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bool]] = []  # (address, value waited for, seen)

    def __call__(self, address: int, value: int, max_ns: int) -> bool:
        seen = spin_until(address, value, max_ns)
        self.calls.append((address, value, seen))
        return seen


@pytest.mark.parametrize("spin_us", [0.0, 5000.0])
def test_jobs_give_the_same_partials_polled_or_not(monkeypatch, spin_us):
    spins = CountingSpin()
    monkeypatch.setattr(handoff, "spin_until", spins)
    banks = [make_layer(seed)[1] for seed in range(2)]
    with CpuMoeExecutor(banks, spin_us=spin_us, expert_fn=bank_moe) as executor:
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


def test_a_job_longer_than_the_polling_time_is_waited_for_blocked(monkeypatch):
    spins = CountingSpin()
    monkeypatch.setattr(handoff, "spin_until", spins)
    bank = make_layer(0)[1]
    release = threading.Event()

    def slow(x, ids, weights, bank):
        release.wait(0.05)  # 50 ms: far longer than the 100 µs of polling
        return bank_moe(x, ids, weights, bank)

    x, ids, weights = make_inputs(2, 2, seed=0, cpu_fraction=1.0)
    with CpuMoeExecutor([bank], spin_us=100.0, expert_fn=slow) as executor:
        done_word = executor.handoff._words_at + 8  # layer 0's
        executor.decode_submit(0, x, ids, weights)
        executor.decode_sync(0)  # the layer's first job: polled (no history), then blocked
        first = [call for call in spins.calls if call[0] == done_word]
        spins.calls.clear()
        executor.decode_submit(0, x, ids, weights)
        result = executor.decode_sync(0)
        second = [call for call in spins.calls if call[0] == done_word]
    assert first == [(done_word, 1, False)]  # 100 µs of a 50 ms job
    assert second == []  # the last job took 50 ms: no polling
    torch.testing.assert_close(result, bank_moe(x, ids, weights, bank))


def test_a_bad_polling_time_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="spin_us must be >= 0"):
        handoff.SpinHandoff(1, -1.0)
    monkeypatch.setenv("HYBRIDMOE_SPIN_US", "fast")
    with pytest.raises(ValueError, match="HYBRIDMOE_SPIN_US"):
        handoff.SpinHandoff(1)
    monkeypatch.setenv("HYBRIDMOE_SPIN_US", "0")
    assert handoff.SpinHandoff(1).spin_us == 0.0
