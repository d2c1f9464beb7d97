"""SpinHandoff: the CPU expert executor's hand-off between the calling thread and its workers,
polled before it blocks.

A thread blocked on a lock or queue is woken through the kernel (a futex); on a virtual machine
whose idle vCPUs halt, that wake-up alone costs tens of µs, and a hybrid decode step pays two
per MoE layer (the job to the worker, its partial back). Here both sides first poll a word of
host memory with the GIL released (kernels/spin_wait.py), where the other's store shows in well
under a µs, and block as before only when the wait outlasts `spin_us`:

- an idle worker polls the number of the last submitted job for `spin_us` after each job (the
  accelerator's launches of the next layer's attention come in between);
- decode_sync blocks on the job until spin_us before its expected end (the layer's last job's
  kernel time after its submit), then polls its done word for spin_us: while the job runs the
  caller does not take a core from the expert kernel's threads, and it is awake when the job
  ends.

The queue and the job's lock stay the source of truth: a word is written after the queue put
(or the lock release) that it announces, so a thread that sees it never blocks on them.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from hybridmoe import env
from hybridmoe.kernels.spin_wait import SPIN_SUPPORTED, spin_until, store_then_spin

# About a layer's attention launches on an accelerator: the time between one layer's CPU job
# and the next layer's submit, which an idle worker polls through.
DEFAULT_SPIN_US = 200.0


class SpinHandoff:
    """Numbers the jobs of `layers` layers and polls for them; spin_us 0 never polls (every
    method then costs a few attribute reads and returns)."""

    def __init__(self, layers: int, spin_us: float | None = None) -> None:
        if spin_us is None:
            spin_us = env.spin_us()
        if spin_us is None:
            spin_us = DEFAULT_SPIN_US
        if not spin_us >= 0:
            raise ValueError(f"spin_us must be >= 0, got {spin_us!r}")
        self.spin_us = float(spin_us) if SPIN_SUPPORTED else 0.0
        self._spin_ns = int(self.spin_us * 1000)
        # [0]: the number of the last job submitted; [1 + layer]: the number of that layer's
        # last finished job
        self._words = np.zeros(1 + layers, dtype=np.int64)
        self._words_at = self._words.ctypes.data
        self._submitted = 0
        self._taken = 0  # the number of the last job a worker took
        self._last_busy_s: dict[int, float] = {}  # layer -> its last job's kernel time
        if self._spin_ns:  # compiled (or loaded from numba's cache) here, while the executor is
            # built, not on a worker's first job (tests/moe/test_cpu_executor_compile.py)
            spin_until(self._words_at, 0, 0)
            store_then_spin(self._words_at + 8, 0, self._words_at, 0, 0)

    def number(self) -> tuple[int, float]:
        """(the next job's number, its submit time): called before the job is queued."""
        self._submitted += 1
        return self._submitted, time.perf_counter()

    def submitted(self, seq: int) -> None:
        """Job `seq` is in the queue: idle workers may stop polling."""
        self._words[0] = seq

    def taken(self, seq: int) -> None:
        self._taken = seq

    def finished(self, layer_idx: int, seq: int, queue_empty: bool) -> None:
        """A worker finished job `seq` of layer `layer_idx` (its lock released): announce it,
        then, about to block on an empty queue, poll for a job submitted after the last one
        taken, for at most spin_us. One call with the GIL released from before the
        announcement (kernels/spin_wait.store_then_spin)."""
        if self._spin_ns:
            wait_ns = self._spin_ns if queue_empty else 0
            done_at = self._words_at + 8 * (1 + layer_idx)
            store_then_spin(done_at, seq, self._words_at, self._taken + 1, wait_ns)

    def wait_done(
        self, layer_idx: int, seq: int, submitted_s: float, done: threading.Lock, limit_s: float
    ) -> bool:
        """The caller is about to block on job `seq` (its lock `done`, held until the job
        ends): blocks on it until spin_us before the job's expected end (the layer's last
        job's kernel time after its submit; at most `limit_s`), then polls for spin_us. True
        when it acquired `done`; else the caller blocks on it as before (acquiring at once when
        the poll saw the job end)."""
        if not self._spin_ns:
            return False
        spin_s = self._spin_ns * 1e-9
        early_s = self._last_busy_s.get(layer_idx, 0.0) - (time.perf_counter() - submitted_s)
        if early_s > spin_s and done.acquire(timeout=min(early_s - spin_s, limit_s)):
            return True
        spin_until(self._words_at + 8 * (1 + layer_idx), seq, self._spin_ns)
        return False

    def synced(self, layer_idx: int, busy_s: float) -> None:
        """Layer `layer_idx`'s job took `busy_s` in its kernel (what the next one is expected
        to take)."""
        self._last_busy_s[layer_idx] = busy_s

    def close(self, workers: int) -> None:
        """Stop polling: the `workers` stop jobs are queued."""
        self._words[0] = self._submitted + workers
