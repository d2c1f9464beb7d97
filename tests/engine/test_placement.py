"""Device memory planning: the slot count a `--gpu-memory` budget (or a device's free memory)
gives, with the decode expert kernel's peak set aside, and clear refusals of what does not fit.
On the cpu device a budget is planned only when given explicitly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hf_checkpoints import PROMPT_IDS, write_hf_checkpoint
from hybridmoe.cli import main
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine import engine as engine_module
from hybridmoe.engine.config import PREFIX_BLOCK_TOKENS
from hybridmoe.engine.kv_cache import KVBlockPool, KVCache
from hybridmoe.engine.placement import ACTIVATION_RESERVE_BYTES, GIB, resolve_decode_target
from hybridmoe.errors import DeviceMemoryError
from hybridmoe.kernels.torch_moe import gathered_moe_peak_bytes
from hybridmoe.models.loading import load_model
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.platform.cpu import CpuPlatform

FOUR_TOKENS = SamplingParams(max_tokens=4, ignore_eos=True)
MAX_BATCH, MAX_SEQ_LEN = 2, 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_hf_checkpoint("qwen3_moe", "gqa_head_dim", tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def quant_checkpoint(tmp_path_factory):
    """Hidden 64 and expert width 32: whole q8_0/q4_0 blocks."""
    return write_hf_checkpoint("qwen3_moe", "mha_tied_top1", tmp_path_factory.mktemp("quant"))


class BudgetPlatform(CpuPlatform):
    """The cpu tier reporting `free_bytes` of free memory, as an accelerator does."""

    def __init__(self, free_bytes: int):
        self.free_bytes = free_bytes

    def memory_bytes(self) -> tuple[int, int]:
        return self.free_bytes, self.free_bytes


def planned_sizes(checkpoint, expert_format: str | None = None) -> dict[str, int]:
    """What the plan of a float32 engine with MAX_BATCH x MAX_SEQ_LEN counts, from a built
    engine's own bank: `fixed` (dense weights, KV cache, the prefix cache's default of
    MAX_SEQ_LEN tokens, activation reserve), `kernel`
    (gathered_moe's peak at MAX_BATCH tokens), one `expert`, a `layer`, the `total` experts."""
    offload = OffloadConfig(decode_target="hybrid", expert_format=expert_format)
    with Engine.from_pretrained(checkpoint, EngineConfig(dtype="float32", offload=offload)) as e:
        bank, cfg, dense = e.moe_runtime.banks[0], e.model.cfg, e.model.dense_nbytes()
    kv = KVCache.nbytes(cfg, MAX_BATCH, MAX_SEQ_LEN, torch.float32)
    prefix = prefix_cache_nbytes(cfg, MAX_SEQ_LEN)
    return {
        "fixed": dense + kv + prefix + ACTIVATION_RESERVE_BYTES,
        "kernel": gathered_moe_peak_bytes(bank, MAX_BATCH, cfg.top_k, torch.float32),
        "expert": bank.expert_nbytes,
        "layer": bank.num_experts * bank.expert_nbytes,
        "total": bank.num_experts * len(cfg.moe_layer_ids),
    }


@pytest.fixture(scope="module")
def sizes(checkpoint) -> dict[str, int]:
    found = planned_sizes(checkpoint)
    cfg = load_model(checkpoint, None, False).cfg
    assert found["expert"] == 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    return found


def prefix_cache_nbytes(cfg, tokens: int) -> int:
    blocks = tokens // PREFIX_BLOCK_TOKENS
    return KVBlockPool.nbytes(cfg, blocks, PREFIX_BLOCK_TOKENS, torch.float32)


def budget_gib(sizes: dict[str, int], experts: int, extra: int = 0) -> float:
    """A budget that leaves room for exactly `experts` experts (plus `extra` bytes)."""
    fixed = sizes["fixed"] + sizes["kernel"]
    return (fixed + experts * sizes["expert"] + extra + 1) / GIB


def engine_config(gib: float | None, **offload) -> EngineConfig:
    offload_config = OffloadConfig(**offload)
    return EngineConfig(
        dtype="float32",
        max_batch=MAX_BATCH,
        max_seq_len=MAX_SEQ_LEN,
        gpu_memory=gib,
        offload=offload_config,
    )


def on_free_memory(monkeypatch, free_bytes: int) -> None:
    """Engines built next plan for a device with exactly `free_bytes` free."""
    monkeypatch.setattr(engine_module, "create_platform", lambda _: BudgetPlatform(free_bytes))


@pytest.mark.parametrize("expert_format", [None, "q8_0", "q4_0"])
def test_a_budget_exactly_enough_gives_its_slots_and_one_byte_less_one_fewer(
    quant_checkpoint, monkeypatch, expert_format
):
    sizes = planned_sizes(quant_checkpoint, expert_format)
    enough = sizes["fixed"] + sizes["kernel"] + 3 * sizes["expert"]
    config = engine_config(None, decode_target="hybrid", expert_format=expert_format)
    for free_bytes, slots in [(enough, 3), (enough - 1, 2)]:
        on_free_memory(monkeypatch, free_bytes)
        with Engine.from_pretrained(quant_checkpoint, config) as engine:
            assert engine.moe_runtime.cache.num_slots == slots, sizes
    on_free_memory(monkeypatch, enough - 2 * sizes["expert"] - 1)
    with pytest.raises(DeviceMemoryError, match=r"no expert slot fits.*expert kernel"):
        Engine.from_pretrained(quant_checkpoint, config)


def test_the_cpu_target_sets_no_expert_kernel_memory_aside(quant_checkpoint, monkeypatch):
    sizes = planned_sizes(quant_checkpoint, "q8_0")
    assert sizes["kernel"] > 0
    on_free_memory(monkeypatch, sizes["fixed"])
    config = engine_config(None, decode_target="cpu", expert_format="q8_0")
    with Engine.from_pretrained(quant_checkpoint, config) as engine:
        assert engine.moe_runtime.cpu_executor is not None  # planned, and it fits


def test_kv_cache_nbytes_is_what_it_allocates(checkpoint):
    model = load_model(checkpoint, None, False)
    cache = KVCache(model.cfg, 3, 17, model.dtype)
    allocated = sum(t.nbytes for t in cache.k + cache.v)
    assert KVCache.nbytes(model.cfg, 3, 17, model.dtype) == allocated


def test_kv_block_pool_nbytes_is_what_it_allocates(checkpoint):
    model = load_model(checkpoint, None, False)
    pool = KVBlockPool(model.cfg, 5, PREFIX_BLOCK_TOKENS, model.dtype)
    allocated = sum(t.nbytes for t in pool.k + pool.v)
    assert KVBlockPool.nbytes(model.cfg, 5, PREFIX_BLOCK_TOKENS, model.dtype) == allocated


def test_the_prefix_cache_takes_its_bytes_from_the_expert_slots(checkpoint, sizes):
    """A budget of 3 slots at the default prefix cache (MAX_SEQ_LEN tokens): without the prefix
    cache its bytes become slots; a larger one costs slots, as many as its extra bytes need."""
    cfg = load_model(checkpoint, None, False).cfg
    default_bytes = prefix_cache_nbytes(cfg, MAX_SEQ_LEN)
    larger_tokens = MAX_SEQ_LEN + 2 * PREFIX_BLOCK_TOKENS
    extra_bytes = prefix_cache_nbytes(cfg, larger_tokens) - default_bytes
    expert = sizes["expert"]
    cases = [(None, 3), (0, min(3 + default_bytes // expert, sizes["total"]))]
    cases.append((larger_tokens, 3 - -(-extra_bytes // expert)))
    for tokens, slots in cases:
        config = replace(
            engine_config(budget_gib(sizes, 3), decode_target="hybrid"),
            prefix_cache_tokens=tokens,
        )
        with Engine.from_pretrained(checkpoint, config) as engine:
            assert engine.moe_runtime.cache.num_slots == slots, tokens


def test_budget_gives_the_slots_that_fit(checkpoint, sizes):
    config = engine_config(budget_gib(sizes, 3), decode_target="hybrid")
    with Engine.from_pretrained(checkpoint, config) as engine:
        assert engine.moe_runtime.cache.num_slots == 3
        engine.generate_ids([PROMPT_IDS], FOUR_TOKENS)


def test_slots_never_exceed_the_experts(checkpoint, sizes):
    config = engine_config(budget_gib(sizes, sizes["total"] + 50), decode_target="offload")
    with Engine.from_pretrained(checkpoint, config) as engine:
        assert engine.moe_runtime.cache.num_slots == sizes["total"]


def test_a_ratio_that_fits_is_kept(checkpoint, sizes):
    budget = budget_gib(sizes, sizes["total"])
    config = engine_config(budget, decode_target="hybrid", expert_cache_ratio=0.5)
    with Engine.from_pretrained(checkpoint, config) as engine:
        assert engine.moe_runtime.cache.num_slots == round(0.5 * sizes["total"])


def test_streamed_prefill_buffers_come_out_of_the_budget(checkpoint, sizes):
    config = engine_config(
        budget_gib(sizes, 3, extra=2 * sizes["layer"]), decode_target="hybrid", prefill="stream"
    )
    with Engine.from_pretrained(checkpoint, config) as engine:
        assert engine.moe_runtime.cache.num_slots == 3


@pytest.mark.parametrize(
    ("experts", "offload", "message"),
    [
        (0, {"decode_target": "hybrid"}, r"no expert slot fits.*--gpu-memory"),
        (3, {"decode_target": "gpu"}, r"decode target 'resident'.*--decode-target hybrid"),
        (3, {"decode_target": "hybrid", "expert_cache_slots": 4}, r"cache of 4 slots"),
        (3, {"decode_target": "hybrid", "expert_cache_ratio": 1.0}, r"--expert-cache-ratio"),
        (-(10**6), {"decode_target": "hybrid"}, r"does not fit on the device even without experts"),
    ],
)
def test_what_does_not_fit_is_refused(checkpoint, sizes, experts, offload, message):
    gib = max(budget_gib(sizes, experts), 1e-6)
    with pytest.raises(DeviceMemoryError, match=message):
        Engine.from_pretrained(checkpoint, engine_config(gib, **offload))


def test_gpu_target_that_fits_keeps_every_expert_on_the_device_tier(checkpoint, sizes):
    config = engine_config(budget_gib(sizes, sizes["total"]), decode_target="gpu")
    with Engine.from_pretrained(checkpoint, config) as engine:
        num_experts = engine.model.cfg.num_experts
        for layer in engine.model.moe_layers:
            assert layer.experts.store.num_experts == num_experts  # a bank on the device
        tokens = engine.generate_ids([PROMPT_IDS], FOUR_TOKENS)
    with Engine.from_pretrained(checkpoint, EngineConfig(dtype="float32")) as unplanned:
        assert unplanned.generate_ids([PROMPT_IDS], FOUR_TOKENS) == tokens


def test_cli_refuses_a_device_torch_cannot_use(checkpoint, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    code = main(["generate", "hi", "--model", str(checkpoint), "--device", "cuda"])
    assert code == 2
    assert "--device 'cuda'" in capsys.readouterr().err


class AcceleratorBudget(BudgetPlatform):
    """What resolve_decode_target sees of an accelerator with `free_bytes` free."""

    device = torch.device("cuda")  # only its type is read; nothing runs on it


@pytest.mark.parametrize(
    ("platform", "experts", "expected"),
    [
        ("cpu", None, "cpu"),  # the fused CPU kernel, whatever the budget
        ("cpu", "all", "cpu"),
        ("accelerator", "all", "resident"),  # every expert fits: nothing to fetch
        ("accelerator", "all but one", "hybrid"),
    ],
)
def test_auto_decode_target_follows_the_device_and_what_fits(
    checkpoint, sizes, platform, experts, expected
):
    fits = {None: None, "all": sizes["total"], "all but one": sizes["total"] - 1}[experts]
    config = engine_config(None if fits is None else budget_gib(sizes, fits))
    assert config.offload.decode_target == "auto"
    platform = (AcceleratorBudget if platform == "accelerator" else BudgetPlatform)(0)
    model = load_model(checkpoint, torch.float32, False)
    resolved = resolve_decode_target(model, config, platform)
    assert resolved.offload.decode_target == expected
    assert resolved == replace(config, offload=replace(config.offload, decode_target=expected))


@pytest.mark.parametrize("target", ["resident", "offload", "cpu", "hybrid"])
def test_a_target_asked_for_is_kept(checkpoint, target):
    config = engine_config(None, decode_target=target)
    model = load_model(checkpoint, torch.float32, False)
    assert resolve_decode_target(model, config, AcceleratorBudget(0)) is config


def test_the_default_target_on_the_cpu_device_is_the_cpu_kernel(checkpoint):
    with Engine.from_pretrained(checkpoint, engine_config(None)) as engine:
        assert engine.config.offload.decode_target == "cpu"
        assert engine.moe_runtime.cpu_executor is not None  # the fused kernel runs the experts
