"""CpuMoeExecutor(inline=True), the cpu device's path, against the worker path it replaces: the
same bits from the same kernel, the same submit/sync contract (failures at sync, not submit),
no threads; and the engine on the cpu device with it (the default; HYBRIDMOE_CPU_INLINE=0 is
the worker path) decodes the worker path's tokens."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.errors import CpuExpertError
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.cpu_experts import bank_moe, fused_cpu_moe
from hybridmoe.quant.bank import ExpertBank, ExpertWeights
from moe.test_cpu_executor import EXPERTS, make_inputs, make_layer


@pytest.fixture
def banks():
    return [make_layer(seed)[1] for seed in range(3)]


def _bf16_bank(seed: int) -> ExpertBank:
    views = make_layer(seed)[0]
    cast = [[t.bfloat16() for t in ts] for ts in (views.gate, views.up, views.down)]
    return ExpertBank.stack(ExpertWeights(gate=cast[0], up=cast[1], down=cast[2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_inline_gives_the_workers_bits(banks, dtype, threads):
    if dtype == torch.bfloat16:
        banks = [_bf16_bank(seed) for seed in range(3)]
    fn = lambda x, ids, w, bank: fused_cpu_moe(x, ids, w, bank, threads=threads)  # noqa: E731
    with (
        CpuMoeExecutor(banks, expert_fn=fn) as workers,
        CpuMoeExecutor(banks, expert_fn=fn, inline=True) as inline,
    ):
        for step in range(3):
            for layer in range(len(banks)):
                x, ids, weights = make_inputs(1 + step, 2, seed=step * 7 + layer)
                x, weights = x.to(dtype), weights.to(dtype)
                for executor in (workers, inline):
                    executor.decode_submit(layer, x, ids, weights)
                expected, actual = workers.decode_sync(layer), inline.decode_sync(layer)
                assert actual.dtype == torch.float32
                assert torch.equal(actual, expected), (step, layer)


def test_inline_runs_on_the_caller_and_starts_no_thread(banks):
    caller, ran_on = threading.current_thread(), []

    def fn(x, ids, weights, bank):
        ran_on.append(threading.current_thread())
        return bank_moe(x, ids, weights, bank)

    before = set(threading.enumerate())
    with CpuMoeExecutor(banks, threads=2, expert_fn=fn, inline=True) as executor:
        assert set(threading.enumerate()) == before
        x, ids, weights = make_inputs(2, 2, seed=3, cpu_fraction=1.0)
        executor.decode_submit(1, x, ids, weights)
        assert ran_on == [caller]  # computed by submit itself
        out = executor.decode_sync(1)
    assert torch.equal(out, bank_moe(x, ids, weights, banks[1]))
    assert executor.stats[1].jobs == 1 and executor.stats[1].routes == 4


def test_inline_failure_surfaces_at_sync_and_recovers(banks):
    calls = []

    def flaky(x, ids, weights, bank):
        calls.append(bank)
        if len(calls) == 1:
            raise ValueError("kernel exploded")
        return bank_moe(x, ids, weights, bank)

    with CpuMoeExecutor(banks, expert_fn=flaky, inline=True) as executor:
        x, ids, weights = make_inputs(3, 2, seed=1, cpu_fraction=1.0)
        executor.decode_submit(2, x, ids, weights)  # does not raise: the contract's sync does
        with pytest.raises(RuntimeError, match="already has CPU work in flight"):
            executor.decode_submit(2, x, ids, weights)
        with pytest.raises(CpuExpertError, match=r"layer 2.*kernel exploded") as caught:
            executor.decode_sync(2)
        assert isinstance(caught.value.__cause__, ValueError)
        executor.decode_submit(2, x, ids, weights)
        assert torch.equal(executor.decode_sync(2), bank_moe(x, ids, weights, banks[2]))


def test_inline_bad_expert_id_surfaces_at_sync(banks):
    with CpuMoeExecutor(banks, inline=True) as executor:
        x, _, weights = make_inputs(1, 2, seed=0)
        executor.decode_submit(0, x, torch.tensor([[EXPERTS, -1]]), weights)
        with pytest.raises(CpuExpertError, match="layer 0") as caught:
            executor.decode_sync(0)
    assert isinstance(caught.value.__cause__, IndexError)


PROMPTS = [[5, 17, 300, 42, 7], [9, 1000]]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _generate(directory: Path, decode_target: str) -> tuple[list[list[int]], bool]:
    offload = OffloadConfig(decode_target=decode_target, expert_cache_slots=3, max_fetch=1)
    config = EngineConfig(dtype="bfloat16", threads=2, offload=offload)
    with Engine.from_pretrained(directory, config) as engine:
        inline = engine.moe_runtime.cpu_executor.inline
        return engine.generate_ids(PROMPTS, GREEDY), inline


@pytest.mark.parametrize("decode_target", ["cpu", "hybrid"])
def test_engine_decode_paths_give_the_same_tokens(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, decode_target: str
):
    """The worker path with torch's threads in decode (the old one), torch's ops serial in a
    CPU decode step (its hand-off polled, and blocking) and with the inline executor (forced,
    and by default) decode the same tokens."""
    results = {}
    variants = (
        ("old", "0", "0", None),
        ("serial", "0", None, None),
        ("serial, blocking hand-off", "0", None, "0"),
        ("inline", "1", None, None),
        ("default", None, None, None),
    )
    for name, inline, serial, spin in variants:
        switches = (
            ("HYBRIDMOE_CPU_INLINE", inline),
            ("HYBRIDMOE_SERIAL_TORCH", serial),
            ("HYBRIDMOE_SPIN_US", spin),
        )
        for var, value in switches:
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, value)
        results[name] = _generate(demo_checkpoint, decode_target)
    assert [used for _, used in results.values()] == [False, False, False, True, True]
    tokens = [ids for ids, _ in results.values()]
    assert all(ids == tokens[0] for ids in tokens[1:])


@pytest.mark.parametrize("inline", [False, True])
def test_routes_counted_or_taken_from_the_caller(banks, inline):
    """stats.routes counts ids >= 0 unless the submitter says how many (a router's ids: all);
    ids all < 0 give zeros inline too (no early exit there: the job runs and skips them)."""
    with CpuMoeExecutor(banks, expert_fn=bank_moe, inline=inline) as executor:
        x, ids, weights = make_inputs(2, 3, seed=1, cpu_fraction=1.0)  # every id a route
        ids[0, 1] = -1  # but one, computed elsewhere
        executor.decode_submit(0, x, ids, weights)
        counted = executor.decode_sync(0)
        assert executor.stats[0].routes == ids.numel() - 1
        executor.decode_submit(1, x, ids, weights, routes=4)
        executor.decode_sync(1)
        assert executor.stats[1].routes == 4
        executor.decode_submit(0, x, torch.full_like(ids, -1), weights)
        assert torch.equal(executor.decode_sync(0), torch.zeros_like(counted))
        assert executor.stats[0].routes == ids.numel() - 1  # + 0


@pytest.mark.parametrize("inline", [False, True])
def test_decode_is_submit_then_sync(banks, inline):
    """decode() (the `cpu` target's call) gives submit + sync's bits and stats, inline without
    a job on the caller, and its failures are sync's: CpuExpertError naming the layer, the
    cause chained, nothing left pending."""
    fails = [True]

    def fn(x, ids, weights, bank):
        if fails[0]:
            fails[0] = False
            raise ValueError("kernel exploded")
        return fused_cpu_moe(x, ids, weights, bank)

    with (
        CpuMoeExecutor(banks, expert_fn=fused_cpu_moe) as reference,
        CpuMoeExecutor(banks, expert_fn=fn, inline=inline) as executor,
    ):
        x, ids, weights = make_inputs(2, 3, seed=4, cpu_fraction=1.0)
        with pytest.raises(CpuExpertError, match=r"layer 1.*kernel exploded") as caught:
            executor.decode(1, x, ids, weights)
        assert isinstance(caught.value.__cause__, ValueError)
        for layer, routes in ((1, None), (2, 5), (1, None)):
            out = executor.decode(layer, x, ids, weights, routes=routes)
            reference.decode_submit(layer, x, ids, weights, routes=routes)
            assert torch.equal(out, reference.decode_sync(layer))
        for layer in (1, 2):
            ours, theirs = executor.stats[layer], reference.stats[layer]
            assert (ours.jobs, ours.routes) == (theirs.jobs, theirs.routes)
        assert executor.stats[1].routes == 2 * ids.numel() and executor.stats[2].routes == 5
        assert executor.stats[1].jobs == 2  # the failed call counts no job
        executor.decode_submit(0, x, ids, weights)
        with pytest.raises(RuntimeError, match="already has CPU work in flight"):
            executor.decode(0, x, ids, weights)
        executor.decode_sync(0)
        with pytest.raises(CpuExpertError, match="layer 0") as caught:
            executor.decode(0, x, torch.full_like(ids, EXPERTS), weights)
        assert isinstance(caught.value.__cause__, IndexError)
