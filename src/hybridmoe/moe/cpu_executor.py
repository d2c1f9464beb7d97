"""CpuMoeExecutor: a decode step's CPU expert routes, run on persistent worker threads, or
inline on the calling thread when there is nothing to overlap them with.

`decode_submit` hands a layer's job to the workers and returns at once; `decode_sync` waits for
it and returns the CPU partial on the caller's device. Moving data between the device and host
memory, and knowing when it has arrived, is the DeviceSync's job (platform/): this module
creates no streams or events. torch releases the GIL inside its ops, so a worker computes while
the caller issues the accelerator's work.

With `inline=True` (the cpu device: its "accelerator" work runs on the same cores, so a worker
would only add two thread hand-offs per layer) decode_submit computes the job itself; the
contract is otherwise the same: a failure is kept and raised by decode_sync, the result is the
same bits (the same expert_fn on the same inputs).

On the worker path both sides poll before they block (moe/handoff.py: `spin_us`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridmoe.errors import CpuExpertError
from hybridmoe.moe import compile_helpers
from hybridmoe.moe.cpu_experts import CpuExpertFn, compiles_on_first_call, create_cpu_expert_fn
from hybridmoe.moe.handoff import SpinHandoff
from hybridmoe.platform.base import DeviceSync, ReadyHandle, create_device_sync
from hybridmoe.quant.bank import ExpertBank


@dataclass
class CpuLayerStats:
    jobs: int = 0  # synced jobs
    routes: int = 0  # (token, expert) routes computed on the CPU
    busy_s: float = 0.0  # worker time inside the expert math
    wait_s: float = 0.0  # caller time blocked in decode_sync


def _held_lock() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock


@dataclass(eq=False)
class _Job:
    layer_idx: int
    host_inputs: tuple[torch.Tensor, ...]  # x [T, H], ids [T, K], weights [T, K] in host memory
    ready: ReadyHandle  # from DeviceSync.to_host; the worker waits on it before reading
    device: torch.device  # where the partial goes back to
    # held from creation until the worker finishes: one semaphore wake-up for the waiter,
    # where an Event's condition variable can take two
    done: threading.Lock = field(default_factory=_held_lock)
    output_cpu: torch.Tensor | None = None  # [T, H], written by the worker before `done`
    output: torch.Tensor | None = None  # [T, H] on `device` already: a job without routes
    error: BaseException | None = None
    busy_s: float = 0.0
    routes: int | None = None  # ids >= 0: the submitter's count, else counted by the worker
    timed_out: bool = False
    seq: int = 0  # the job's number on the worker path (SpinHandoff), from 1
    submitted_s: float = 0.0  # perf_counter() at submit


class CpuMoeExecutor:
    """Implements the CpuExecutor protocol of moe/hybrid_decode.py.

    Call submit/sync from one thread. At most one job per layer is in flight; jobs of different
    layers may run at once on different workers (`threads`). The tensors given to decode_submit
    must not be modified until decode_sync for that layer has returned. `sync` defaults to the
    `cpu` device's DeviceSync; pass create_device_sync(device) for an accelerator.
    `inline=True` starts no worker: decode_submit runs the job on the caller (module docstring);
    `timeout_s` then bounds nothing. A kernel that compiles on its first call (the numba one,
    default or given: cpu_experts.compiles_on_first_call) is compiled here, per kind of bank;
    any other given `expert_fn` is first called by a job. `spin_us`: how long the worker
    path's hand-off polls before it blocks (moe/handoff.py; None: HYBRIDMOE_SPIN_US, else its
    default; 0: never).
    """

    def __init__(
        self,
        banks: Sequence[ExpertBank],
        *,
        threads: int = 1,
        timeout_s: float = 120.0,
        expert_fn: CpuExpertFn | None = None,
        sync: DeviceSync | None = None,
        inline: bool = False,
        spin_us: float | None = None,
    ):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.banks = list(banks)
        self.timeout_s = timeout_s
        if expert_fn is None:
            expert_fn = create_cpu_expert_fn()
        # kinds of bank whose kernel compiled in a helper process (moe/compile_helpers.py)
        self.kernels_compiled_elsewhere = 0
        if compiles_on_first_call(expert_fn):  # the engine's, given: compiled here all the same
            self.kernels_compiled_elsewhere = _compile_kernels(expert_fn, self.banks)
        self.expert_fn = expert_fn
        self.sync = sync if sync is not None else create_device_sync("cpu")
        self.stats: dict[int, CpuLayerStats] = {}
        self._pending: dict[int, _Job] = {}
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self.inline = inline
        self.handoff = SpinHandoff(len(self.banks), 0.0 if inline else spin_us)
        self._workers = [
            threading.Thread(target=self._work, name=f"hybridmoe-cpu-experts-{i}", daemon=True)
            for i in range(0 if inline else threads)
        ]
        for worker in self._workers:
            worker.start()

    def decode_submit(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        cpu_expert_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        routes: int | None = None,
    ) -> None:
        """Start layer `layer_idx`'s CPU routes (ids < 0 skipped) and return without waiting.

        hidden_states [T, H], cpu_expert_ids [T, K] int, topk_weights [T, K]. `routes`: how
        many ids are >= 0 when the caller knows it (a router's ids: all of them; the hybrid
        cache's count of the routes it gave the CPU), for the stats; None: counted here. A job
        of 0 routes finishes here on any device: its partial is zeros on the input's device,
        with no copy to host memory, no worker and no copy back.
        """
        self._check_can_submit(layer_idx)
        _check_shapes(layer_idx, hidden_states, cpu_expert_ids, topk_weights, self.banks[layer_idx])
        if routes is None and not self.inline and hidden_states.is_cpu:
            # reading the ids costs no device sync here, and an empty job saves a thread round
            # trip (inline, the kernel's call on no routes costs about what the read does)
            routes = 0 if not bool((cpu_expert_ids >= 0).any()) else None
        if routes == 0:
            # Nothing to compute and nothing to stage: finish here. The caller still submits
            # and syncs, so its structure is unchanged.
            job = _Job(layer_idx, (), None, hidden_states.device, routes=0)
            job.output = torch.zeros(
                hidden_states.shape, dtype=torch.float32, device=hidden_states.device
            )
            job.done.release()
            self._pending[layer_idx] = job
            return
        host_inputs, ready = self.sync.to_host((hidden_states, cpu_expert_ids, topk_weights))
        job = _Job(layer_idx, tuple(host_inputs), ready, hidden_states.device, routes=routes)
        self._pending[layer_idx] = job
        if self.inline:
            self._run(job)  # on this thread; an error is kept for decode_sync
        else:
            job.seq, job.submitted_s = self.handoff.number()
            self._jobs.put(job)
            self.handoff.submitted(job.seq)

    def decode(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        cpu_expert_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        routes: int | None = None,
    ) -> torch.Tensor:
        """decode_submit then decode_sync: the same checks, stats, errors and result. The
        inline executor on host inputs (the `cpu` target's every layer) runs the job without
        its hand-off (a _Job, its lock, the DeviceSync's no-op copies): measured ~15 µs a
        layer in a decode step, where every Python object it touches is out of cache."""
        if not (self.inline and hidden_states.is_cpu):
            self.decode_submit(layer_idx, hidden_states, cpu_expert_ids, topk_weights, routes)
            return self.decode_sync(layer_idx)
        self._check_can_submit(layer_idx)
        bank = self.banks[layer_idx]
        _check_shapes(layer_idx, hidden_states, cpu_expert_ids, topk_weights, bank)
        start = time.perf_counter()
        try:
            output = self.expert_fn(hidden_states, cpu_expert_ids, topk_weights, bank)
        except Exception as err:
            raise CpuExpertError(
                f"CPU experts of layer {layer_idx} failed: {type(err).__name__}: {err}"
            ) from err
        busy_s = time.perf_counter() - start
        if routes is None:
            routes = int((cpu_expert_ids >= 0).sum())
        self.record(layer_idx, routes, busy_s)
        return output

    def record(self, layer_idx: int, routes: int, busy_s: float = 0.0) -> None:
        """Count a job of layer `layer_idx` computed without the executor: `routes` routes in
        `busy_s` seconds (0: not timed apart, as when the attention block computed them in
        its own call: kernels/attention_block.py)."""
        stats = self.stats.get(layer_idx) or self.stats.setdefault(layer_idx, CpuLayerStats())
        stats.jobs += 1
        stats.routes += routes
        stats.busy_s += busy_s

    def decode_sync(self, layer_idx: int) -> torch.Tensor:
        """Wait for layer `layer_idx`'s submitted job; its float32 partial [T, H] on the input's
        device (the expert kernel's, unrounded: the accumulation contract).

        Raises CpuExpertError (cause chained) if the worker failed, and TimeoutError after
        `timeout_s`; a timed-out job stays pending, so decode_sync may be called again.
        """
        job = self._pending.get(layer_idx)
        if job is None:
            raise RuntimeError(
                f"decode_sync({layer_idx}): layer {layer_idx} has no submitted CPU work; "
                "call decode_submit first"
            )
        stats = self.stats.get(layer_idx) or self.stats.setdefault(layer_idx, CpuLayerStats())
        start = time.perf_counter()
        finished = job.done.acquire(blocking=False) or self.handoff.wait_done(
            layer_idx, job.seq, job.submitted_s, job.done, self.timeout_s
        )
        if not finished:
            left_s = self.timeout_s - (time.perf_counter() - start)
            finished = job.done.acquire(timeout=max(left_s, 0.0))
        stats.wait_s += time.perf_counter() - start
        if not finished:
            job.timed_out = True
            raise TimeoutError(
                f"CPU experts of layer {layer_idx} did not finish within {self.timeout_s} s"
            )
        del self._pending[layer_idx]
        if job.error is not None:
            raise CpuExpertError(
                f"CPU experts of layer {layer_idx} failed: {type(job.error).__name__}: {job.error}"
            ) from job.error
        stats.jobs += 1
        stats.routes += job.routes
        stats.busy_s += job.busy_s
        if job.seq:
            self.handoff.synced(layer_idx, job.busy_s)
        if job.output is not None:
            return job.output
        return self.sync.to_device(job.ready, job.output_cpu, job.device)

    def close(self) -> None:
        """Stop and join every worker (queued jobs finish first). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for _ in self._workers:
            self._jobs.put(None)
        self.handoff.close(len(self._workers))
        for worker in self._workers:
            worker.join(self.timeout_s)
        stuck = [worker.name for worker in self._workers if worker.is_alive()]
        if stuck:
            raise TimeoutError(f"CPU expert workers still busy after {self.timeout_s} s: {stuck}")

    def __enter__(self) -> CpuMoeExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_can_submit(self, layer_idx: int) -> None:
        if self._closed:
            raise RuntimeError("CpuMoeExecutor is closed; create a new one to submit work")
        if not 0 <= layer_idx < len(self.banks):
            raise IndexError(
                f"layer {layer_idx} out of range: the executor holds {len(self.banks)} banks"
            )
        job = self._pending.get(layer_idx)
        if job is not None:
            hint = " (its decode_sync timed out; call it again)" if job.timed_out else ""
            raise RuntimeError(
                f"decode_submit({layer_idx}): layer {layer_idx} already has CPU work in flight"
                f"{hint}; call decode_sync({layer_idx}) before submitting it again"
            )

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            self.handoff.taken(job.seq)
            self._run(job)
            self.handoff.finished(job.layer_idx, job.seq, self._jobs.empty())  # then polls

    def _run(self, job: _Job) -> None:
        try:
            self.sync.wait_ready(job.ready)
            x_cpu, ids_cpu, weights_cpu = job.host_inputs
            start = time.perf_counter()
            job.output_cpu = self.expert_fn(x_cpu, ids_cpu, weights_cpu, self.banks[job.layer_idx])
            job.busy_s = time.perf_counter() - start
            if job.routes is None:
                job.routes = int((ids_cpu >= 0).sum())
        except BaseException as err:  # any failure must reach decode_sync, not kill the worker
            job.error = err
        finally:
            job.done.release()  # before the handoff's word: its reader acquires without blocking


def _compile_kernels(expert_fn: CpuExpertFn, banks: Sequence[ExpertBank]) -> int:
    """Call `expert_fn` once per kind of bank (formats, activation quantisation, layout, biases,
    activation) on one route of weight 0, before any job. The numba kernel compiles, or loads
    from its disk cache, on its first call: minutes on a slow or shared machine, which a job
    must not spend inside `timeout_s` (that bounds a hung worker, not a compiler); here it
    takes what it takes, while the engine is built. The kernel's argument types are a job's
    whatever the activation dtype (fused_cpu_moe hands it float32, int64 and the bank's own
    arrays); a bf16 x and router weights are widened first by a numba glue call of its own,
    so each kind is called with float32 and with bfloat16 inputs
    (tests/moe/test_cpu_executor_compile.py checks it). Kinds missing from the cache beyond
    the first compile meanwhile in helper processes (moe/compile_helpers.py), whose work the
    calls here then load; returns how many kinds they compiled."""
    kinds: dict[tuple, ExpertBank] = {}
    for bank in banks:
        kernel = (*(f.name for f in bank.formats), bank.activation_quant)  # picks the entry
        kinds.setdefault((*kernel, bank.stacked, bank.biases is None, bank.activation), bank)
    helpers = compile_helpers.start_missing(list(kinds.values()))
    try:
        for bank in kinds.values():  # the caller's own first, the helpers' once they are done
            if not any(bank is helped for helped in helpers.banks):
                _call_once(expert_fn, bank)
    except BaseException:  # an interrupt or a failure here: the helpers' work is not wanted
        helpers.stop()
        raise
    helpers.wait()
    for bank in helpers.banks:
        _call_once(expert_fn, bank)
    return len(helpers.banks)


def _call_once(expert_fn: CpuExpertFn, bank: ExpertBank) -> None:
    """expert_fn on one route of weight 0, with float32 and with bfloat16 inputs."""
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, bank.hidden_size, dtype=dtype)  # [1, H]
        weights = torch.zeros(1, 1, dtype=dtype)
        expert_fn(x, torch.zeros(1, 1, dtype=torch.int64), weights, bank)


def _check_shapes(
    layer_idx: int,
    hidden_states: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    bank: ExpertBank,
) -> None:
    """Metadata checks only: nothing here reads device memory."""
    hidden_size = bank.down.shape[1]
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden_size:
        raise ValueError(
            f"layer {layer_idx}: hidden_states must be [T, {hidden_size}], "
            f"got {list(hidden_states.shape)}"
        )
    if ids.dim() != 2 or ids.shape[0] != hidden_states.shape[0] or ids.shape != weights.shape:
        raise ValueError(
            f"layer {layer_idx}: cpu_expert_ids and topk_weights must both be "
            f"[{hidden_states.shape[0]}, K], got {list(ids.shape)} and {list(weights.shape)}"
        )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"layer {layer_idx}: cpu_expert_ids must be integer, got {ids.dtype}")
