"""CPU expert math on a bank against moe_reference; CpuMoeExecutor's submit/sync contract;
the cpu DeviceSync. Every wait has a timeout, so a broken executor fails instead of hanging."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hybridmoe.errors import CpuExpertError, HybridMoeError
from hybridmoe.layers.moe import moe_reference
from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.cpu_experts import (
    CPU_EXPERT_FNS,
    bank_moe,
    create_cpu_expert_fn,
    fused_cpu_moe,
)
from hybridmoe.moe.hybrid_decode import HybridDecodeExecutor, HybridDecodeRequest
from hybridmoe.platform.cpu import CpuDeviceSync
from hybridmoe.quant.bank import ExpertBank, ExpertWeights

HIDDEN, INTER, EXPERTS = 32, 16, 8
WAIT_S = 10.0  # upper bound on any wait in a test; only reached when the code under test is broken


def make_layer(seed: int) -> tuple[ExpertWeights, ExpertBank]:
    """A random bank and per-expert views of it."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    bank = ExpertBank.stack(
        ExpertWeights(
            gate=[rand(INTER, HIDDEN) for _ in range(EXPERTS)],
            up=[rand(INTER, HIDDEN) for _ in range(EXPERTS)],
            down=[rand(HIDDEN, INTER) for _ in range(EXPERTS)],
        )
    )
    return bank.views(), bank


def make_inputs(
    tokens: int, top_k: int, seed: int, cpu_fraction: float = 0.6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], ids [T, K] with about 1 - cpu_fraction of them -1, weights [T, K]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:top_k] for _ in range(tokens)])
    ids[torch.rand(tokens, top_k, generator=g) > cpu_fraction] = -1
    weights = torch.rand(tokens, top_k, generator=g)
    return x, ids, weights


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # fp32: only summation order differs; assert_close prints the max difference on failure
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture
def banks() -> list[ExpertBank]:
    return [make_layer(seed)[1] for seed in range(3)]


@pytest.fixture
def make_executor():
    """Build executors that are closed at teardown even when the test fails."""
    made: list[CpuMoeExecutor] = []

    def make(banks: list[ExpertBank], **kwargs) -> CpuMoeExecutor:
        made.append(CpuMoeExecutor(banks, **kwargs))
        return made[-1]

    yield make
    for executor in made:
        executor.close()


# --- bank_moe -------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_bank_moe_matches_reference(tokens, top_k):
    experts, bank = make_layer(seed=tokens * 10 + top_k)
    for cpu_fraction in (1.0, 0.5):
        x, ids, weights = make_inputs(tokens, top_k, seed=top_k, cpu_fraction=cpu_fraction)
        assert_matches(bank_moe(x, ids, weights, bank), moe_reference(x, ids, weights, experts))


def test_bank_moe_duplicate_ids_in_a_row_add_up():
    experts, bank = make_layer(seed=1)
    x, _, weights = make_inputs(3, 4, seed=2)
    ids = torch.tensor([[5, 5, 2, 5], [0, 0, 0, 0], [7, -1, 7, 1]])
    expected = moe_reference(x, ids, weights, experts)
    assert_matches(bank_moe(x, ids, weights, bank), expected)
    once = bank_moe(x[:1], torch.tensor([[5]]), weights[:1, :1] + weights[:1, 1:2], bank)
    twice = bank_moe(x[:1], torch.tensor([[5, 5]]), weights[:1, :2], bank)
    assert_matches(twice, once)


def test_bank_moe_all_skipped_is_zero():
    _, bank = make_layer(seed=0)
    x, _, weights = make_inputs(4, 2, seed=0)
    out = bank_moe(x, torch.full((4, 2), -1), weights, bank)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert not out.any()


def test_cpu_expert_registry():
    assert {"torch", "numba"} <= set(CPU_EXPERT_FNS)
    assert create_cpu_expert_fn("torch") is bank_moe
    assert create_cpu_expert_fn().func is fused_cpu_moe  # numba is the default
    with pytest.raises(ValueError, match=r"cpu_threads=100000.*NUMBA_NUM_THREADS"):
        create_cpu_expert_fn("numba", threads=100_000)
    with pytest.raises(ValueError, match=r"unknown CPU expert kernel 'nope'.*torch"):
        create_cpu_expert_fn("nope")


# --- CpuMoeExecutor: results ----------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
def test_submit_sync_equals_bank_moe(make_executor, banks, threads):
    executor = make_executor(banks, threads=threads)
    for step in range(3):
        for layer, bank in enumerate(banks):
            x, ids, weights = make_inputs(5, 2, seed=step * 7 + layer)
            executor.decode_submit(layer, x, ids, weights)
            assert_matches(executor.decode_sync(layer), bank_moe(x, ids, weights, bank))


def test_all_skipped_submission_returns_zeros(make_executor, banks):
    executor = make_executor(banks)
    x, _, weights = make_inputs(3, 2, seed=0)
    executor.decode_submit(0, x, torch.full((3, 2), -1), weights)
    out = executor.decode_sync(0)
    assert out.shape == x.shape and not out.any()
    assert executor.stats[0].jobs == 1 and executor.stats[0].routes == 0


class NoCopiesSync:
    """A DeviceSync that fails any copy: a job that must not stage its inputs uses it."""

    def to_host(self, tensors):
        raise AssertionError("a job of 0 routes copied its inputs to host memory")

    def wait_ready(self, handle):
        raise AssertionError("a job of 0 routes waited for a copy")

    def to_device(self, handle, host_tensor, device):
        raise AssertionError("a job of 0 routes copied its partial back")


@pytest.mark.parametrize("inline", [False, True])
def test_a_job_counted_as_no_routes_finishes_at_submit_on_any_device(make_executor, banks, inline):
    """routes=0 (the hybrid cache's count): no copy, no worker, no kernel; zeros on the
    inputs' device. On `meta` tensors, any read of their values would raise."""

    def no_kernel(x, ids, weights, bank):
        raise AssertionError("a job of 0 routes ran the kernel")

    executor = make_executor(banks, expert_fn=no_kernel, sync=NoCopiesSync(), inline=inline)
    x = torch.empty(3, HIDDEN, dtype=torch.bfloat16, device="meta")
    ids = torch.empty(3, 2, dtype=torch.int64, device="meta")
    weights = torch.empty(3, 2, dtype=torch.bfloat16, device="meta")
    for _ in range(2):
        executor.decode_submit(1, x, ids, weights, 0)
        out = executor.decode_sync(1)
        assert (out.shape, out.dtype, out.device.type) == ((3, HIDDEN), torch.float32, "meta")
    assert executor.stats[1].jobs == 2 and executor.stats[1].routes == 0
    x, ids, weights = make_inputs(3, 2, seed=4, cpu_fraction=0.0)  # every id -1
    executor.decode_submit(0, x, ids, weights, 0)
    assert not executor.decode_sync(0).any()


def test_a_job_counted_with_routes_still_runs(make_executor, banks):
    """A count > 0 from the caller is only for the stats: the job runs as any other."""
    x, ids, weights = make_inputs(4, 2, seed=6, cpu_fraction=1.0)
    executor = make_executor(banks)
    executor.decode_submit(2, x, ids, weights, ids.numel())
    assert_matches(executor.decode_sync(2), bank_moe(x, ids, weights, banks[2]))
    assert executor.stats[2].routes == ids.numel()


def test_several_layers_in_flight_run_on_two_workers(make_executor, banks):
    both_running = threading.Barrier(2, timeout=WAIT_S)  # breaks unless two jobs run at once

    def meet_then_compute(x, ids, weights, bank):
        if bank is banks[0] or bank is banks[1]:
            both_running.wait()
        return bank_moe(x, ids, weights, bank)

    executor = make_executor(banks, threads=2, expert_fn=meet_then_compute)
    inputs = [make_inputs(4, 2, seed=layer) for layer in range(3)]
    for layer, (x, ids, weights) in enumerate(inputs):
        executor.decode_submit(layer, x, ids, weights)
    for layer in (2, 0, 1):  # sync order need not follow submit order
        assert_matches(executor.decode_sync(layer), bank_moe(*inputs[layer], banks[layer]))


def test_integrates_with_hybrid_decode_executor(make_executor):
    experts, bank = make_layer(seed=5)
    cached = [1, 4, 6]  # experts resident in accelerator slots 0, 1, 2
    slot_bank = ExpertBank(gate_up=bank.gate_up[cached], down=bank.down[cached])

    class FixedCache:
        def ensure_experts_hybrid(self, layer_idx, topk_ids):
            rows = topk_ids.tolist()
            slots = [[cached.index(e) if e in cached else -1 for e in row] for row in rows]
            topk_ids.copy_(torch.tensor(slots))

        def copy_missing(self):
            pass

    cpu_executor = make_executor([bank])
    x, ids, weights = make_inputs(6, 4, seed=3, cpu_fraction=1.0)
    expected = moe_reference(x, ids, weights, experts)
    for overlap in (True, False):
        cpu_executor.stats.clear()
        hybrid = HybridDecodeExecutor(FixedCache(), cpu_executor, overlap=overlap)
        request = HybridDecodeRequest(0, x, ids.clone(), weights)
        out = hybrid.decode(request, lambda h, s, w: bank_moe(h, s, w, slot_bank))
        assert_matches(out, expected)
        assert 0 < cpu_executor.stats[0].routes < ids.numel()


# --- CpuMoeExecutor: threads and synchronisation --------------------------------------------


def test_submit_returns_before_the_worker_finishes(make_executor, banks):
    submitted, started = threading.Event(), threading.Event()

    def wait_for_submit_to_return(x, ids, weights, bank):
        started.set()
        if not submitted.wait(WAIT_S):
            raise AssertionError("decode_submit blocked on the worker")
        return bank_moe(x, ids, weights, bank)

    executor = make_executor(banks, expert_fn=wait_for_submit_to_return)
    x, ids, weights = make_inputs(2, 2, seed=0)
    executor.decode_submit(0, x, ids, weights)
    submitted.set()
    assert started.wait(WAIT_S), "the worker never started the job"
    assert_matches(executor.decode_sync(0), bank_moe(x, ids, weights, banks[0]))


def test_device_sync_is_used_on_the_right_threads(make_executor, banks):
    caller = threading.current_thread()
    calls: list[tuple[str, bool]] = []

    class RecordingSync(CpuDeviceSync):
        def to_host(self, tensors):
            calls.append(("to_host", threading.current_thread() is caller))
            return tuple(t.clone() for t in tensors), "handle"

        def wait_ready(self, handle):
            assert handle == "handle"
            calls.append(("wait_ready", threading.current_thread() is caller))

        def to_device(self, handle, host_tensor, device):
            assert handle == "handle"
            calls.append(("to_device", threading.current_thread() is caller))
            return host_tensor

    def recording_fn(*args):
        calls.append(("expert_fn", threading.current_thread() is caller))
        return bank_moe(*args)

    executor = make_executor(banks, sync=RecordingSync(), expert_fn=recording_fn)
    x, ids, weights = make_inputs(2, 2, seed=0)
    executor.decode_submit(1, x, ids, weights)
    assert_matches(executor.decode_sync(1), bank_moe(x, ids, weights, banks[1]))
    assert calls == [
        ("to_host", True),
        ("wait_ready", False),
        ("expert_fn", False),
        ("to_device", True),
    ]


def test_worker_exception_surfaces_at_sync_and_executor_recovers(make_executor, banks):
    calls = []

    def flaky(x, ids, weights, bank):
        calls.append(bank)
        if len(calls) == 1:
            raise ValueError("kernel exploded")
        return bank_moe(x, ids, weights, bank)

    executor = make_executor(banks, expert_fn=flaky)
    x, ids, weights = make_inputs(3, 2, seed=1)
    executor.decode_submit(2, x, ids, weights)
    with pytest.raises(CpuExpertError, match=r"layer 2.*kernel exploded") as caught:
        executor.decode_sync(2)
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, HybridMoeError)
    assert isinstance(caught.value.__cause__, ValueError)
    executor.decode_submit(2, x, ids, weights)
    assert_matches(executor.decode_sync(2), bank_moe(x, ids, weights, banks[2]))


def test_bad_expert_id_surfaces_at_sync(make_executor, banks):
    executor = make_executor(banks)
    x, _, weights = make_inputs(1, 2, seed=0)
    executor.decode_submit(0, x, torch.tensor([[EXPERTS, -1]]), weights)
    with pytest.raises(CpuExpertError, match="layer 0") as caught:
        executor.decode_sync(0)
    assert isinstance(caught.value.__cause__, IndexError)


def test_timeout_raises_instead_of_hanging(make_executor, banks):
    release = threading.Event()

    def slow(x, ids, weights, bank):
        release.wait(WAIT_S)
        return bank_moe(x, ids, weights, bank)

    executor = make_executor(banks, timeout_s=0.05, expert_fn=slow)
    x, ids, weights = make_inputs(2, 2, seed=0)
    executor.decode_submit(1, x, ids, weights)
    with pytest.raises(TimeoutError, match=r"layer 1.*0\.05 s"):
        executor.decode_sync(1)
    with pytest.raises(RuntimeError, match=r"layer 1.*timed out"):
        executor.decode_submit(1, x, ids, weights)
    release.set()
    executor.timeout_s = WAIT_S
    assert_matches(executor.decode_sync(1), bank_moe(x, ids, weights, banks[1]))


def test_double_submit_and_sync_without_submit_are_errors(make_executor, banks):
    executor = make_executor(banks)
    x, ids, weights = make_inputs(2, 2, seed=0)
    with pytest.raises(RuntimeError, match=r"layer 0 has no submitted CPU work"):
        executor.decode_sync(0)
    executor.decode_submit(0, x, ids, weights)
    with pytest.raises(RuntimeError, match=r"layer 0 already has CPU work in flight"):
        executor.decode_submit(0, x, ids, weights)
    executor.decode_sync(0)
    with pytest.raises(RuntimeError, match=r"layer 0 has no submitted CPU work"):
        executor.decode_sync(0)


@pytest.mark.parametrize(
    ("layer", "shapes", "message"),
    [
        (3, ((2, HIDDEN), (2, 2), (2, 2)), "layer 3 out of range"),
        (-1, ((2, HIDDEN), (2, 2), (2, 2)), "layer -1 out of range"),
        (0, ((2, HIDDEN + 1), (2, 2), (2, 2)), r"hidden_states must be \[T, 32\]"),
        (0, ((2, HIDDEN), (3, 2), (3, 2)), r"must both be \[2, K\]"),
        (0, ((2, HIDDEN), (2, 2), (2, 1)), r"must both be \[2, K\]"),
    ],
)
def test_bad_submission_is_rejected_at_submit(make_executor, banks, layer, shapes, message):
    executor = make_executor(banks)
    x_shape, ids_shape, weights_shape = shapes
    with pytest.raises((ValueError, IndexError), match=message):
        executor.decode_submit(
            layer,
            torch.zeros(x_shape),
            torch.zeros(ids_shape, dtype=torch.long),
            torch.zeros(weights_shape),
        )


def test_constructor_validates_arguments(banks):
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        CpuMoeExecutor(banks, threads=0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        CpuMoeExecutor(banks, timeout_s=0)


def test_busy_time_is_recorded_per_layer(make_executor, banks):
    def sleepy(x, ids, weights, bank):
        time.sleep(0.02)
        return bank_moe(x, ids, weights, bank)

    executor = make_executor(banks, expert_fn=sleepy)
    x, ids, weights = make_inputs(4, 2, seed=0, cpu_fraction=1.0)
    for _ in range(2):
        executor.decode_submit(1, x, ids, weights)
        executor.decode_sync(1)
    stats = executor.stats[1]
    assert stats.jobs == 2 and stats.routes == 2 * ids.numel()
    assert stats.busy_s >= 0.03  # two sleeps of 0.02 s happened inside the timed region
    assert 0 not in executor.stats


# --- CpuMoeExecutor: lifetime ---------------------------------------------------------------


def test_close_joins_every_worker_and_is_idempotent(banks):
    before = set(threading.enumerate())
    executor = CpuMoeExecutor(banks, threads=3)
    workers = set(threading.enumerate()) - before
    assert len(workers) == 3
    x, ids, weights = make_inputs(2, 2, seed=0)
    executor.decode_submit(0, x, ids, weights)
    executor.decode_sync(0)
    assert set(threading.enumerate()) - before == workers, "no threads created per call"
    executor.close()
    executor.close()
    assert set(threading.enumerate()) == before
    with pytest.raises(RuntimeError, match="closed"):
        executor.decode_submit(0, x, ids, weights)


def test_context_manager_closes(banks):
    before = set(threading.enumerate())
    with CpuMoeExecutor(banks, threads=2) as executor:
        x, ids, weights = make_inputs(2, 2, seed=0)
        executor.decode_submit(2, x, ids, weights)
        executor.decode_sync(2)
    assert set(threading.enumerate()) == before


def test_the_default_kernel_is_compiled_before_any_job(make_executor):
    # a first numba call compiles (minutes on a shared machine): that must happen while the
    # executor is built, not inside a job's timeout_s. This (gate/up, down) pair's kernel is
    # made on first use and no other test uses it, so only the build can have compiled it.
    from hybridmoe.kernels.numba_moe import fused_moe_kernel
    from hybridmoe.quant.formats import weight_format

    torch.manual_seed(0)
    gate, up = (torch.randn(2, 32, 64, dtype=torch.bfloat16) for _ in range(2))
    down = torch.randn(2, 64, 32)
    bank = ExpertBank(
        gate=gate, up=up, down=down, fmt=weight_format("bf16"), down_fmt=weight_format("f32")
    )
    assert not fused_moe_kernel("bf16", "f32").signatures
    make_executor([bank])
    assert fused_moe_kernel("bf16", "f32").signatures


def test_a_given_expert_fn_is_not_called_at_build(make_executor, banks):
    calls = []

    def counting(x, ids, weights, bank):
        calls.append(bank)
        return bank_moe(x, ids, weights, bank)

    make_executor(banks, expert_fn=counting)
    assert calls == []
