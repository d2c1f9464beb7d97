"""HybridDecodeExecutor's contract with fakes (order, route split, in-place rewrite, stats),
its wiring beside OffloadMoeCache, delegation from OffloadMoELayer, failures with a real
CpuMoeExecutor.
Every wait has a timeout, so a broken executor fails instead of hanging."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.moe_runtime import MoeRuntime, create_moe_runtime
from hybridmoe.errors import CpuExpertError
from hybridmoe.models.loading import load_model
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.cpu_experts import bank_moe
from hybridmoe.moe.hybrid_decode import HybridDecodeExecutor, HybridDecodeRequest
from hybridmoe.moe.offload_cache import OffloadMoeCache
from hybridmoe.quant.bank import ExpertBank

HIDDEN, INTER, EXPERTS = 8, 4, 64
WAIT_S = 10.0  # upper bound on any wait; only reached when the code under test is broken
OVERLAPPED = ["ensure_experts_hybrid", "decode_submit", "copy_missing", "gpu_runner", "decode_sync"]
SERIALIZED = ["ensure_experts_hybrid", "decode_submit", "decode_sync", "copy_missing", "gpu_runner"]


class FakeCache:
    """Rewrites ids by `slot_of` (absent: -1, the CPU) and records its calls in `log`; returns
    the count of the CPU's routes (`counts`), else None."""

    def __init__(self, slot_of: dict[int, int], log: list[str], counts: bool = True):
        self.slot_of, self.log, self.seen_ids, self.counts = slot_of, log, [], counts

    def ensure_experts_hybrid(self, layer_idx: int, topk_ids: torch.Tensor) -> int | None:
        self.log.append("ensure_experts_hybrid")
        self.seen_ids.append(topk_ids)
        rows = topk_ids.tolist()
        slots = [[self.slot_of.get(e, -1) for e in row] for row in rows]
        topk_ids.copy_(torch.tensor(slots, dtype=topk_ids.dtype))
        on_cpu = sum(e >= 0 and self.slot_of.get(e) is None for row in rows for e in row)
        return on_cpu if self.counts else None

    def copy_missing(self) -> None:
        self.log.append("copy_missing")


class FakeCpuExecutor:
    """Records submit/sync; sync returns `partial`."""

    def __init__(self, partial: torch.Tensor, log: list[str]):
        self.partial, self.log, self.submits, self.syncs = partial, log, [], []
        self.routes: list[int | None] = []  # per submit: the count the caller handed over

    def decode_submit(self, layer_idx, hidden_states, cpu_expert_ids, topk_weights, routes=None):
        self.log.append("decode_submit")
        self.submits.append((layer_idx, hidden_states, cpu_expert_ids.clone(), topk_weights))
        self.routes.append(routes)

    def decode_sync(self, layer_idx: int) -> torch.Tensor:
        self.log.append("decode_sync")
        self.syncs.append(layer_idx)
        return self.partial


class FakeGpuRunner:
    """Records (hidden, slots, weights); returns `partial`."""

    def __init__(self, partial: torch.Tensor, log: list[str]):
        self.partial, self.log, self.calls = partial, log, []

    def __call__(self, hidden, slots, weights) -> torch.Tensor:
        self.log.append("gpu_runner")
        self.calls.append((hidden, slots.clone(), weights.clone()))
        return self.partial


def make_parts(slot_of: dict[int, int], tokens: int = 1, overlap: bool = True):
    log: list[str] = []
    cache = FakeCache(slot_of, log)
    cpu = FakeCpuExecutor(torch.full((tokens, HIDDEN), 2.0), log)
    runner = FakeGpuRunner(torch.full((tokens, HIDDEN), 0.5), log)
    return HybridDecodeExecutor(cache, cpu, overlap=overlap), cache, cpu, runner, log


def request(ids: list[list[int]], weights: list[list[float]], layer: int = 0):
    x = torch.randn(len(ids), HIDDEN, generator=torch.Generator().manual_seed(len(ids)))
    return HybridDecodeRequest(layer, x, torch.tensor(ids), torch.tensor(weights))


# --- order ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("overlap", "expected"), [(True, OVERLAPPED), (False, SERIALIZED)])
def test_event_order(overlap, expected):
    hybrid, _, _, runner, log = make_parts({11: 3}, overlap=overlap)
    hybrid.decode(request([[11, 42]], [[0.7, 0.3]]), runner)
    assert log == expected


@pytest.fixture
def small_demo(demo_checkpoint, demo_variant):
    """The demo checkpoint cut to 3 decoder layers: 2 MoE layers (layer 0 is dense). The
    weights of the other layers are left out (the loader refuses tensors a model does not use)."""
    directory = demo_variant({"num_hidden_layers": 3}, skip=("model.safetensors",))
    weights = load_file(str(demo_checkpoint / "model.safetensors"))

    def in_cut_layer(name: str) -> bool:  # model.layers.<i>.* with i >= 3
        return name.startswith("model.layers.") and int(name.split(".")[2]) >= 3

    kept = {name: t for name, t in weights.items() if not in_cut_layer(name)}
    save_file(kept, str(directory / "model.safetensors"))
    return directory


@pytest.fixture
def make_runtime(small_demo):
    """Runtimes over fresh demo models, closed at teardown even when the test fails."""
    made: list[MoeRuntime] = []

    def make(**offload) -> MoeRuntime:
        made.append(create_moe_runtime(load_model(small_demo), OffloadConfig(**offload)))
        return made[-1]

    yield make
    for runtime in made:
        runtime.close()


@pytest.mark.parametrize(
    ("env", "config_overlap", "overlap"),
    [(None, True, True), ("1", True, True), ("0", True, False), (None, False, False)],
)
def test_overlap_env_switch_serialises_the_runtime(
    make_runtime, monkeypatch, env, config_overlap, overlap
):
    monkeypatch.delenv("HYBRIDMOE_HYBRID_OVERLAP", raising=False)
    if env is not None:
        monkeypatch.setenv("HYBRIDMOE_HYBRID_OVERLAP", env)
    runtime = make_runtime(decode_target="hybrid", overlap=config_overlap)
    assert runtime.hybrid_executor.overlap is overlap


# --- route split ----------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False])
def test_worked_example_from_the_reference(overlap):
    hybrid, _, cpu, runner, _ = make_parts({11: 3}, overlap=overlap)
    req = request([[11, 42]], [[0.7, 0.3]])
    out = hybrid.decode(req, runner)
    [(layer, cpu_x, cpu_ids, cpu_weights)] = cpu.submits
    assert layer == 0 and cpu_x is req.hidden_states
    assert cpu_ids.tolist() == [[-1, 42]]
    assert cpu_weights is req.topk_weights  # the original weights; the CPU skips ids < 0
    [(gpu_x, gpu_slots, gpu_weights)] = runner.calls
    assert gpu_x is req.hidden_states
    assert gpu_slots.tolist() == [[3, -1]]  # the CPU's route is skipped on the accelerator
    torch.testing.assert_close(gpu_weights, torch.tensor([[0.7, 0.0]]))
    torch.testing.assert_close(out, runner.partial + cpu.partial)


def matrix(element: st.SearchStrategy, rows: int, cols: int) -> st.SearchStrategy:
    return st.lists(st.lists(element, min_size=cols, max_size=cols), min_size=rows, max_size=rows)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    tokens=st.integers(1, 6),
    top_k=st.integers(1, 4),
    slot_of=st.dictionaries(st.integers(0, EXPERTS - 1), st.integers(0, 15), max_size=EXPERTS),
)
def test_routes_are_complementary(data, tokens, top_k, slot_of):
    ids = data.draw(matrix(st.integers(0, EXPERTS - 1), tokens, top_k))
    weights = data.draw(matrix(st.floats(0.01, 1.0), tokens, top_k))  # nonzero router weights
    hybrid, _, cpu, runner, _ = make_parts(slot_of, tokens)
    req = request(ids, weights)
    hybrid.decode(req, runner)
    cpu_ids, (_, gpu_slots, gpu_weights) = cpu.submits[0][2], runner.calls[0]
    on_cpu, on_gpu = cpu_ids >= 0, gpu_weights != 0
    assert torch.equal(on_cpu ^ on_gpu, torch.ones_like(on_cpu)), "each route on exactly one side"
    assert torch.equal(gpu_slots < 0, on_cpu)  # the accelerator skips the CPU's routes
    original, w = torch.tensor(ids), torch.tensor(weights)
    expected_slots = [[slot_of.get(e, -1) for e in row] for row in ids]
    assert torch.equal(on_cpu, torch.tensor(expected_slots) < 0)
    assert torch.equal(cpu_ids[on_cpu], original[on_cpu])
    assert torch.equal(gpu_slots[on_gpu], req.topk_ids[on_gpu])
    assert torch.equal(gpu_weights[on_gpu], w[on_gpu])


def test_topk_ids_rewritten_in_place():
    hybrid, cache, _, runner, _ = make_parts({5: 1, 9: 0, 2: 7}, tokens=2)
    req = request([[5, 9], [2, 30]], [[0.5, 0.5], [0.6, 0.4]])
    ids = req.topk_ids
    hybrid.decode(req, runner)
    assert req.topk_ids is ids and cache.seen_ids[0] is ids
    assert ids.tolist() == [[1, 0], [7, -1]]


def test_all_accelerator_step_still_submits_and_syncs_the_cpu_side():
    hybrid, _, cpu, runner, log = make_parts({1: 0, 2: 1, 3: 2}, tokens=2)
    out = hybrid.decode(request([[1, 2], [3, 1]], [[0.5, 0.5], [0.9, 0.1]]), runner)
    assert log == OVERLAPPED
    assert (cpu.submits[0][2] == -1).all() and cpu.syncs == [0]
    assert runner.calls[0][1].tolist() == [[0, 1], [2, 0]]
    torch.testing.assert_close(out, runner.partial + cpu.partial)


def test_all_cpu_step_still_runs_the_accelerator_with_zero_weights():
    hybrid, _, cpu, runner, log = make_parts({}, tokens=2)
    hybrid.decode(request([[1, 2], [3, 1]], [[0.5, 0.5], [0.9, 0.1]]), runner)
    assert log == OVERLAPPED
    _, gpu_slots, gpu_weights = runner.calls[0]
    assert not gpu_weights.any() and (gpu_slots == -1).all()
    assert cpu.submits[0][2].tolist() == [[1, 2], [3, 1]]


@pytest.mark.parametrize("counts", [True, False])
def test_the_caches_count_of_cpu_routes_reaches_the_cpu_executor(counts):
    hybrid, cache, cpu, runner, _ = make_parts({1: 0, 2: 1}, tokens=2)
    cache.counts = counts
    for ids in ([[1, 2], [2, 1]], [[1, 5], [6, 2]], [[7, 8], [9, 1]]):
        hybrid.decode(request(ids, [[0.5, 0.5]] * 2), runner)
    assert cpu.routes == ([0, 2, 3] if counts else [None] * 3)
    assert [int((ids >= 0).sum()) for _, _, ids, _ in cpu.submits] == [0, 2, 3]


def test_steps_without_cpu_routes_skip_the_worker_with_a_real_cache_and_executor():
    """OffloadMoeCache's count makes a real CpuMoeExecutor finish the calls without CPU
    routes at submit: its kernel runs once per call that has some; every output exact."""
    banks = [make_bank(seed) for seed in range(2)]
    cache = OffloadMoeCache(banks, num_slots=6, max_fetch=1)
    kernel_calls = []

    def counting_kernel(x, ids, weights, bank):
        kernel_calls.append(int((ids >= 0).sum()))
        return bank_moe(x, ids, weights, bank)

    g = torch.Generator().manual_seed(3)
    with CpuMoeExecutor(banks, expert_fn=counting_kernel) as cpu:
        submitted = []  # the routes argument of each submit: the cache's count, never None
        submit = cpu.decode_submit

        def recording_submit(*args):
            submitted.append(args[4])
            return submit(*args)

        cpu.decode_submit = recording_submit  # shadows the method on this instance
        hybrid = HybridDecodeExecutor(cache, cpu)
        cpu_routes = []
        for step in range(12):
            layer, ids = step % 2, torch.tensor([[1, 2], [2, 1 + step % 3]])
            x, weights = torch.randn(2, HIDDEN, generator=g), torch.rand(2, 2, generator=g)
            expected = bank_moe(x, ids, weights, banks[layer])
            before = cache.stats_by_layer[layer].cpu_routes
            slot_bank = cache.slot_bank_for(layer)
            out = hybrid.decode(
                HybridDecodeRequest(layer, x, ids, weights),
                lambda h, s, w, slot_bank=slot_bank: bank_moe(h, s, w, slot_bank),
            )
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
            cpu_routes.append(cache.stats_by_layer[layer].cpu_routes - before)
    assert 0 in cpu_routes and any(cpu_routes)  # both kinds of call occurred
    assert submitted == cpu_routes
    assert kernel_calls == [n for n in cpu_routes if n]


def test_stats_per_layer():
    hybrid, _, cpu, runner, _ = make_parts({1: 0, 2: 1}, tokens=2)
    steps = [(0, [[1, 2], [3, 4]]), (1, [[1, 5], [6, 7]]), (0, [[1, 2], [2, 1]])]
    for layer, ids in steps:
        hybrid.decode(request(ids, [[0.5, 0.5]] * 2, layer), runner)
    counts = {layer: (s.steps, s.routes) for layer, s in hybrid.stats.items()}
    assert counts == {0: (2, 8), 1: (1, 4)}
    cpu_routes = {0: 0, 1: 0}  # where routes ran is the cache's to count; here: what the CPU got
    for layer, _, cpu_ids, _ in cpu.submits:
        cpu_routes[layer] += int((cpu_ids >= 0).sum())
    assert cpu_routes == {0: 2, 1: 3}


# --- wiring and delegation ------------------------------------------------------------------


def make_bank(seed: int) -> ExpertBank:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2
    return ExpertBank(gate_up, torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.2)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_runtime_owns_one_hybrid_executor_over_its_cache_and_cpu_executor(
    make_runtime, overlap
):
    runtime = make_runtime(decode_target="hybrid", overlap=overlap)
    hybrid = runtime.hybrid_executor
    assert isinstance(hybrid, HybridDecodeExecutor) and hybrid.overlap is overlap
    assert hybrid.cache is runtime.cache and hybrid.cpu_executor is runtime.cpu_executor
    assert all(layer.experts.executor is hybrid for layer in runtime.layers)
    assert not hasattr(runtime.cache, "hybrid_executor")  # the cache knows no executor


class SpyHybridExecutor:
    """Wraps the real executor; records (layer_idx, runner, tokens) per decode call."""

    def __init__(self, real: HybridDecodeExecutor):
        self.real, self.calls = real, []
        self.stats = real.stats

    def decode(self, request, gpu_expert_runner):
        self.calls.append((request.layer_idx, gpu_expert_runner, request.hidden_states.shape[0]))
        return self.real.decode(request, gpu_expert_runner)


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_layer_delegates_decode_steps_to_the_hybrid_executor(small_demo, max_tokens):
    model = load_model(small_demo)
    offload = OffloadConfig(decode_target="hybrid", expert_cache_slots=4, max_fetch=1)
    with Engine(model, None, EngineConfig(offload=offload)) as engine:
        runtime = engine.moe_runtime
        runtime.cpu_executor.timeout_s = WAIT_S
        spy = SpyHybridExecutor(runtime.hybrid_executor)
        layers = model.moe_layers
        for layer in layers:
            layer.experts.executor = spy
        assert len(layers) == 2
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        [out] = engine.generate_ids([[1, 2, 3]], params)
        assert len(out) == max_tokens
        decode_steps = max_tokens - 1  # the first token comes from prefill, which never delegates
        assert [layer for layer, _, _ in spy.calls] == list(range(len(layers))) * decode_steps
        for layer_idx, runner, tokens in spy.calls:
            assert runner == layers[layer_idx].experts.run_on_slots and tokens == 1
        if decode_steps:
            assert spy.real.stats[0].steps == decode_steps


# --- failures with a real CpuMoeExecutor ---------------------------------------------------

CACHED = [3, 7]  # experts of layer 1 in accelerator slots 0 and 1
IDS, WEIGHTS = [[3, 12], [7, 3]], [[0.6, 0.4], [0.3, 0.7]]


def assert_next_decode_works(hybrid: HybridDecodeExecutor, bank: ExpertBank) -> None:
    slot_bank = ExpertBank(bank.gate_up[CACHED], bank.down[CACHED])
    req = request(IDS, WEIGHTS, layer=1)
    expected = bank_moe(req.hidden_states, req.topk_ids.clone(), req.topk_weights, bank)
    out = hybrid.decode(req, lambda h, s, w: bank_moe(h, s, w, slot_bank))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overlap", [True, False])
def test_worker_failure_surfaces_from_decode_and_the_next_decode_works(overlap):
    banks, failures = [make_bank(0), make_bank(1)], ["kernel exploded"]

    def flaky(x, ids, weights, bank):
        if failures:
            raise ValueError(failures.pop())
        return bank_moe(x, ids, weights, bank)

    with CpuMoeExecutor(banks, timeout_s=WAIT_S, expert_fn=flaky) as cpu:
        cache = FakeCache({e: slot for slot, e in enumerate(CACHED)}, [])
        hybrid = HybridDecodeExecutor(cache, cpu, overlap=overlap)
        runner = FakeGpuRunner(torch.zeros(2, HIDDEN), [])
        with pytest.raises(CpuExpertError, match=r"layer 1.*kernel exploded") as caught:
            hybrid.decode(request(IDS, WEIGHTS, layer=1), runner)
        assert isinstance(caught.value.__cause__, ValueError)
        assert_next_decode_works(hybrid, banks[1])


@pytest.mark.parametrize("overlap", [True, False])
def test_accelerator_failure_leaves_no_cpu_work_in_flight(overlap):
    """A runner (or copy) exception must not strand the layer's submitted CPU job: the next
    decode of that layer has to work, e.g. a server's next request. FAILS with overlap=True:
    decode() never syncs the CPU side, so the next submit says 'already has CPU work'."""
    banks = [make_bank(0), make_bank(1)]
    with CpuMoeExecutor(banks, timeout_s=WAIT_S) as cpu:
        cache = FakeCache({e: slot for slot, e in enumerate(CACHED)}, [])
        hybrid = HybridDecodeExecutor(cache, cpu, overlap=overlap)

        def out_of_memory(h, s, w):
            raise RuntimeError("accelerator out of memory")

        with pytest.raises(RuntimeError, match="out of memory"):
            hybrid.decode(request(IDS, WEIGHTS, layer=1), out_of_memory)
        assert_next_decode_works(hybrid, banks[1])
