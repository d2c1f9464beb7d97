"""Device memory planning: the slot count a `--gpu-memory` budget gives, and clear refusals of
what does not fit. On the cpu device a budget is planned only when given explicitly."""

from __future__ import annotations

import pytest

from hf_checkpoints import PROMPT_IDS, write_hf_checkpoint
from hybridmoe.cli import main
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.engine.placement import GIB, DeviceMemoryPlan
from hybridmoe.errors import DeviceMemoryError
from hybridmoe.loader.checkpoint import load_model
from hybridmoe.moe.config import OffloadConfig

FOUR_TOKENS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_hf_checkpoint("qwen3_moe", "gqa_head_dim", tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def sizes(checkpoint) -> dict[str, int]:
    """What the plan for a float32 engine with max_batch 2 should count."""
    with Engine.from_pretrained(checkpoint, EngineConfig(dtype="float32")) as engine:
        model = engine.model
        bank = engine.moe_runtime.banks[0] if engine.moe_runtime.banks else None
    model = load_model(checkpoint, None, False)
    cfg = model.cfg
    expert_nbytes = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    assert bank is None or bank.expert_nbytes == expert_nbytes
    return {
        "fixed": model.dense_nbytes() + KVCache.nbytes(cfg, 2, 256, model.dtype),
        "expert": expert_nbytes,
        "layer": cfg.num_experts * expert_nbytes,
        "total": cfg.num_experts * len(cfg.moe_layer_ids),
    }


def budget_gib(sizes: dict[str, int], experts: int, extra: int = 0) -> float:
    """A budget that leaves room for exactly `experts` experts (plus `extra` bytes)."""
    reserve = DeviceMemoryPlan(0, 0, 0).reserve_bytes
    return (sizes["fixed"] + reserve + experts * sizes["expert"] + extra + 1) / GIB


def engine_config(gib: float, **offload) -> EngineConfig:
    offload_config = OffloadConfig(**offload)
    return EngineConfig(
        dtype="float32", max_batch=2, max_seq_len=256, gpu_memory=gib, offload=offload_config
    )


def test_kv_cache_nbytes_is_what_it_allocates(checkpoint):
    model = load_model(checkpoint, None, False)
    cache = KVCache(model.cfg, 3, 17, model.dtype)
    allocated = sum(t.nbytes for t in cache.k + cache.v)
    assert KVCache.nbytes(model.cfg, 3, 17, model.dtype) == allocated


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
        (3, {"decode_target": "gpu"}, r"decode target 'gpu'.*--decode-target hybrid"),
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
            assert layer.experts is None and layer.bank.num_experts == num_experts
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
