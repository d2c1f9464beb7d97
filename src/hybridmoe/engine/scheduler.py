"""Scheduler: continuous batching over one persistent KV cache.

Each of `max_batch` KV-cache rows holds at most one request (and, for a model with
linear-attention layers, its recurrent state: the same row, overwritten by its prefill).
Between decode steps, requests that finished or were cancelled give their row back and
waiting requests are prefilled into free rows (the part of the prompt the prefix cache does
not hold); then one decode step advances every running request by one token together. A
thread inside `run()` (or `start()`'s background thread) takes these steps (`serve`), or
`step()` is driven by hand: Engine.generate and stream step their engine's scheduler until
their requests finish.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from hybridmoe.engine import steps
from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.engine.logprobs import TokenLogprob
from hybridmoe.engine.moe_runtime import MoeRuntime
from hybridmoe.engine.prefix_cache import PrefixCache
from hybridmoe.engine.sequence import Sequence
from hybridmoe.engine.stats import GenerationStats
from hybridmoe.models.transformer import MoeCausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request; the last output has `finished` set."""

    text: str  # text made printable by this step (stop strings are never included)
    completion_tokens: int  # tokens generated so far, EOS included
    finish_reason: str | None = None  # "stop" | "length" on the last output of a success
    error: Exception | None = None  # set on the last output of a request that failed
    # Of the tokens sampled since the previous output (SamplingParams.logprobs; else empty).
    logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


OutputCallback = Callable[[RequestOutput], None]


class SchedulerClosed(RuntimeError):
    """The scheduler has shut down: raised by submit, and the error of requests it dropped."""


class ScheduledRequest:
    """A submitted request. `on_output` is called on the scheduler thread, once per step that
    produces text and once at the end; it must not block. If it raises, the request is dropped."""

    def __init__(self, seq: Sequence, on_output: OutputCallback) -> None:
        self.seq, self.on_output = seq, on_output
        self.cached_tokens = 0  # prompt positions the prefix cache held; set at admission
        # Written by any thread, read by the scheduler between steps (a plain bool suffices:
        # the worst case is one extra step before the row is freed).
        self.cancelled = False

    def cancel(self) -> None:
        """Drop the request; its row is freed before the next step. Safe from any thread."""
        self.cancelled = True


class Scheduler:
    """Continuous batching of `model` over a KV cache of `max_batch` rows x `max_seq_len`
    positions and a prefix cache of `prefix_cache_blocks` blocks (0: none), allocated here.
    Steps run on one thread at a time: while a thread is inside run(), the model and MoE
    runtime belong to it (Engine.generate refuses to step then)."""

    def __init__(
        self,
        model: MoeCausalLM,
        moe_runtime: MoeRuntime,
        max_batch: int,
        max_seq_len: int,
        prefix_cache_blocks: int = 0,
        attention_kernel: str = "auto",
    ) -> None:
        context = model.cfg.max_position_embeddings
        if not 2 <= max_seq_len <= context:
            raise ValueError(
                f"max_seq_len must be in [2, {context}] (the model's context window), "
                f"got {max_seq_len}"
            )
        if prefix_cache_blocks and model.cfg.has_recurrent_state:
            raise ValueError(
                f"{model.cfg.architecture} keeps a recurrent state per sequence (linear "
                "attention) that a prefix cache of KV blocks cannot restore: use none"
            )
        self.model, self.moe_runtime = model, moe_runtime
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.cache = KVCache(  # ring layers keep a prefill's keys for the prefix cache
            model.cfg,
            max_batch,
            max_seq_len,
            model.dtype,
            model.device,
            keep_prefill_kv=prefix_cache_blocks > 0,
            attention_kernel=attention_kernel,  # EngineConfig.attention_kernel
        )
        self.prefix_cache = None
        if prefix_cache_blocks:
            args = (model.cfg, prefix_cache_blocks, model.dtype, model.device)
            self.prefix_cache = PrefixCache(*args)
        self.free_rows = list(range(max_batch))  # a min-heap: low rows keep batches dense
        self.running: dict[int, ScheduledRequest] = {}  # KV row -> request
        self.waiting: deque[ScheduledRequest] = deque()
        self._counters = GenerationStats()  # since the start
        self._cond = threading.Condition()  # guards `waiting` and `_stopping`; wakes the loop
        self._step_lock = threading.Lock()  # held during a step, so stats() sees whole steps
        self._stopping = False
        self._loop_done = threading.Event()  # set while no thread is inside run()
        self._loop_done.set()
        moe_runtime.reset_stats()

    # --- any thread ------------------------------------------------------------------------

    def submit(self, seq: Sequence, on_output: OutputCallback) -> ScheduledRequest:
        """Queue `seq`, a fresh Sequence (Engine.new_sequence). Raises ValueError if it may
        grow beyond max_seq_len and SchedulerClosed once the scheduler is closed."""
        if seq.max_len > self.max_seq_len:
            raise ValueError(
                f"the sequence may grow to {seq.max_len} positions; the KV cache holds "
                f"{self.max_seq_len}"
            )
        request = ScheduledRequest(seq, on_output)
        with self._cond:
            if self._stopping:
                raise SchedulerClosed("the scheduler is closed")
            self.waiting.append(request)
            self._cond.notify()
        return request

    def run(self) -> None:
        """Run steps in the calling thread whenever there is work, until close().

        Prefer the thread that loaded the model: with libgomp (torch's OpenMP on Linux), once
        one thread has run parallel ops, every other thread's parallel ops cost ~1.5-3x more
        (two thread pools oversubscribe the cores, so idle workers sleep instead of spin)."""
        self._loop_done.clear()
        try:
            while self._wait_for_work():
                self._step_or_fail_running()
        finally:
            self._loop_done.set()

    def start(self) -> threading.Thread:
        """run() on a new background thread."""
        self._loop_done.clear()  # alive from now on, not only once the thread gets going
        thread = threading.Thread(target=self.run, name="hybridmoe-scheduler", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Stop the loop after its current step, fail the requests still queued or running,
        and release the KV cache and the model. Idempotent; must not be called from the
        thread inside run()."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._loop_done.wait()
        with self._step_lock, self._cond:
            pending = list(self.waiting) + [self.running[row] for row in sorted(self.running)]
            self.waiting.clear()
            for request in pending:
                self._fail(request, SchedulerClosed("the scheduler is closed"))
            self.running.clear()
            self.cache = self.model = None  # nothing runs again: submit refuses from now on
            self.prefix_cache = None

    def stats(self) -> GenerationStats:
        """A snapshot of the counters since the start, taken between steps."""
        with self._step_lock, self._cond:
            return replace(
                self._counters,
                requests_running=len(self.running),
                requests_waiting=len(self.waiting),
                experts=self.moe_runtime.stats(),
                prefix_cache=self.prefix_cache.stats() if self.prefix_cache else None,
            )

    @property
    def idle(self) -> bool:
        """No request queued or running (a lock-free read, exact only between steps)."""
        return not self.running and not self.waiting

    @property
    def alive(self) -> bool:
        """A thread is inside run()."""
        return not self._loop_done.is_set()

    # --- the scheduler thread --------------------------------------------------------------

    def _step_or_fail_running(self) -> None:
        try:
            self.step()
        except Exception as exc:  # a bug, not a bad request: fail what is in flight, go on
            log.exception("scheduler step failed")
            with self._step_lock:
                self._fail_running(exc)

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._stopping and not self.waiting and not self.running:
                self._cond.wait()
            return not self._stopping

    def step(self) -> None:
        """Free the rows of cancelled requests, prefill waiting requests into free rows, then
        decode one token for every running request."""
        with self._step_lock:
            self._drop_cancelled()
            self._admit_waiting()
            if self.running:
                self._decode_running()

    def _drop_cancelled(self) -> None:
        for row in [row for row, request in self.running.items() if request.cancelled]:
            self._release(row)
            self._counters.requests_cancelled += 1

    def _admit_waiting(self) -> None:
        while self.free_rows:
            request = self._next_waiting()
            if request is None:
                return
            if request.cancelled:
                self._counters.requests_cancelled += 1
                continue
            self._prefill(request, heapq.heappop(self.free_rows))

    def _next_waiting(self) -> ScheduledRequest | None:
        with self._cond:
            return self.waiting.popleft() if self.waiting else None

    def _prefill(self, request: ScheduledRequest, row: int) -> None:
        seq, start = request.seq, time.perf_counter()
        try:
            cached = self._load_prefix(seq, row)
            delta = steps.prefill(self.model, seq, row, self.cache, cached)
            if self.prefix_cache is not None:
                self.prefix_cache.store(seq.prompt_ids, row, self.cache)
        except Exception as exc:  # this request's fault (or its input's): fail it alone
            heapq.heappush(self.free_rows, row)
            self._fail(request, exc)
            return
        finally:
            self.cache.release_prefill_kv()
        request.cached_tokens = cached
        self._counters.prefill_s += time.perf_counter() - start
        self._counters.prompt_tokens += len(seq.prompt_ids)
        self._counters.cached_prompt_tokens += cached
        self._counters.completion_tokens += 1
        self.running[row] = request
        self._deliver(row, delta)

    def _load_prefix(self, seq: Sequence, row: int) -> int:
        """Copies what the prefix cache holds of `seq`'s prompt into `row`; its length."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.load(seq.prompt_ids, row, self.cache)

    def _decode_running(self) -> None:
        rows = sorted(self.running)  # ascending rows: contiguous batches take the cheap KV path
        seqs = [self.running[row].seq for row in rows]
        start = time.perf_counter()
        try:
            deltas = steps.decode(self.model, rows, seqs, self.cache)
        except Exception as exc:  # one step serves every running request: all of them fail
            # Each gets `exc` as its error, which its consumer reports (the server logs it,
            # Engine.generate raises it).
            log.debug("decode step failed", exc_info=True)
            self._fail_running(exc)
            return
        self._counters.decode_s += time.perf_counter() - start
        self._counters.decode_steps += 1
        self._counters.decode_tokens += len(rows)
        self._counters.completion_tokens += len(rows)
        for row, delta in zip(rows, deltas, strict=True):
            self._deliver(row, delta)

    def _deliver(self, row: int, delta: str) -> None:
        request = self.running[row]
        seq = request.seq
        if delta or seq.finished:
            output = RequestOutput(
                delta, len(seq.output_ids), seq.finish_reason, logprobs=seq.take_logprobs()
            )
            if not self._send(request, output):
                request.cancel()
        if seq.finished:
            self._release(row)
            self._counters.requests_served += 1

    def _send(self, request: ScheduledRequest, output: RequestOutput) -> bool:
        try:
            request.on_output(output)
        except Exception:  # the consumer is gone (e.g. its event loop closed)
            log.debug("dropping a request whose output callback failed", exc_info=True)
            return False
        return True

    def _release(self, row: int) -> None:
        del self.running[row]
        heapq.heappush(self.free_rows, row)

    def _fail(self, request: ScheduledRequest, exc: Exception) -> None:
        self._counters.requests_failed += 1
        self._send(request, RequestOutput("", len(request.seq.output_ids), error=exc))

    def _fail_running(self, exc: Exception) -> None:
        for row in list(self.running):
            request = self.running[row]
            self._release(row)
            self._fail(request, exc)
