"""Memory planning on the device: a `--gpu-memory` budget gives the slot count that fits beside
the dense weights, the KV cache, the reserve (activations and the decode expert kernel's peak)
and prefill's layer buffers, and the engine then allocates no more than planned; what does not
fit is refused naming the flag to change. gathered_moe's temporaries stay within the peak the
plan sets aside for them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hf_checkpoints import PROMPT_IDS
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.config import PREFIX_BLOCK_TOKENS
from hybridmoe.engine.kv_cache import KVBlockPool, KVCache
from hybridmoe.engine.placement import ACTIVATION_RESERVE_BYTES, GIB, expert_kernel_bytes
from hybridmoe.errors import DeviceMemoryError
from hybridmoe.kernels import torch_moe
from hybridmoe.kernels.torch_moe import gathered_moe, gathered_moe_peak_bytes
from hybridmoe.models.loading import load_model
from hybridmoe.moe.config import OffloadConfig

from .test_gathered_moe import make_bank, make_routes

MAX_BATCH, MAX_SEQ_LEN = 2, 128
SLOTS = 5
FOUR_TOKENS = SamplingParams(max_tokens=4, ignore_eos=True)
# The allocator rounds every block up to 512 bytes: slack for the tiny model's ~60 dense tensors.
ROUNDING_SLACK_BYTES = 64 * 1024


@dataclass(frozen=True)
class Sizes:
    """What the plan of a float32 engine with MAX_BATCH x MAX_SEQ_LEN counts, in bytes."""

    dense: int
    kv: int
    expert: int
    total_experts: int
    prefill: int  # prefill's two layer buffers: on an accelerator `auto` streams long prompts
    kernel: int  # gathered_moe's peak temporaries at MAX_BATCH tokens

    def budget(self, experts: int, with_prefill: bool) -> int:
        """A budget with room for `experts` experts (and half of one more)."""
        reserve = ACTIVATION_RESERVE_BYTES + self.kernel
        fixed = self.dense + self.kv + reserve + (self.prefill if with_prefill else 0)
        return fixed + experts * self.expert + self.expert // 2


@pytest.fixture(scope="module")
def sizes(tiny_checkpoint: Path, device: torch.device) -> Sizes:
    model = load_model(tiny_checkpoint, torch.float32, False)
    cfg = model.cfg
    expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    layer = cfg.num_experts * expert
    return Sizes(
        dense=model.dense_nbytes(),
        # the KV cache and the prefix cache's default pool (MAX_SEQ_LEN tokens)
        kv=KVCache.nbytes(cfg, MAX_BATCH, MAX_SEQ_LEN, torch.float32)
        + KVBlockPool.nbytes(
            cfg, MAX_SEQ_LEN // PREFIX_BLOCK_TOKENS, PREFIX_BLOCK_TOKENS, torch.float32
        ),
        expert=expert,
        total_experts=cfg.num_experts * len(cfg.moe_layer_ids),
        prefill=2 * layer if device.type != "cpu" else 0,
        kernel=expert_kernel_bytes(model, OffloadConfig(decode_target="hybrid"), MAX_BATCH),
    )


def engine_config(device: torch.device, budget_bytes: int, **offload) -> EngineConfig:
    return EngineConfig(
        dtype="float32",
        device=str(device),
        max_batch=MAX_BATCH,
        max_seq_len=MAX_SEQ_LEN,
        gpu_memory=budget_bytes / GIB,
        offload=OffloadConfig(**offload),
    )


def allocated_bytes(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def test_a_budget_gives_the_slots_that_fit(tiny_checkpoint: Path, device, sizes: Sizes) -> None:
    before = allocated_bytes(device)
    config = engine_config(device, sizes.budget(SLOTS, with_prefill=True), decode_target="hybrid")
    with Engine.from_pretrained(tiny_checkpoint, config) as engine:
        assert engine.moe_runtime.cache.num_slots == SLOTS
        # the engine allocates its KV cache (MAX_BATCH x MAX_SEQ_LEN) at construction
        planned = sizes.dense + sizes.kv + sizes.prefill + SLOTS * sizes.expert
        if device.type == "cuda":
            assert allocated_bytes(device) - before <= planned + ROUNDING_SLACK_BYTES
        engine.generate_ids([PROMPT_IDS], FOUR_TOKENS)


def test_gpu_target_that_fits_holds_every_expert(tiny_checkpoint: Path, device, sizes) -> None:
    before = allocated_bytes(device)
    budget = sizes.budget(sizes.total_experts, with_prefill=False)
    with Engine.from_pretrained(tiny_checkpoint, engine_config(device, budget)) as engine:
        planned = sizes.dense + sizes.kv + sizes.total_experts * sizes.expert
        if device.type == "cuda":
            assert allocated_bytes(device) - before <= planned + ROUNDING_SLACK_BYTES
        engine.generate_ids([PROMPT_IDS], FOUR_TOKENS)


@pytest.mark.parametrize(
    ("case", "offload", "message"),
    [
        ("below-the-reserve", {"decode_target": "hybrid"}, r"does not fit.*--gpu-memory"),
        ("gpu-target-too-big", {"decode_target": "gpu"}, r"'resident'.*--decode-target hybrid"),
        (
            "slots-beyond-the-budget",
            {"decode_target": "hybrid", "expert_cache_slots": SLOTS + 1},
            r"--expert-cache-slots",
        ),
    ],
)
def test_what_does_not_fit_is_refused(tiny_checkpoint: Path, device, sizes, case, offload, message):
    budgets = {
        "below-the-reserve": GIB // 10,
        "gpu-target-too-big": sizes.budget(sizes.total_experts - 1, with_prefill=False),
        "slots-beyond-the-budget": sizes.budget(SLOTS, with_prefill=True),
    }
    before = allocated_bytes(device)
    with pytest.raises(DeviceMemoryError, match=message):
        Engine.from_pretrained(tiny_checkpoint, engine_config(device, budgets[case], **offload))
    assert allocated_bytes(device) == before  # a refused engine leaves nothing on the device


@pytest.mark.cuda_only
@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16", "q8_0", "q4_0", "q5_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks", ["one", "several"])
def test_gathered_moe_stays_within_its_planned_peak(device, monkeypatch, fmt, dtype, chunks):
    tokens, top_k = 16, 4
    bank_dev = make_bank(fmt).to(device)
    if chunks == "several":  # 5 routes a chunk
        expert_bytes = 3 * bank_dev.intermediate_size * bank_dev.hidden_size * 4
        monkeypatch.setattr(torch_moe, "GATHER_CHUNK_BYTES", 5 * expert_bytes)
    ids, weights = make_routes(tokens, top_k, seed=5)
    x = torch.randn(tokens, bank_dev.hidden_size).to(dtype)
    x_dev, ids_dev, weights_dev = (t.to(device) for t in (x, ids, weights.to(dtype)))
    gathered_moe(x_dev, ids_dev, weights_dev, bank_dev)  # warm: cuBLAS workspace, kernels
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = gathered_moe(x_dev, ids_dev, weights_dev, bank_dev)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    planned = gathered_moe_peak_bytes(bank_dev, tokens, top_k, dtype) + out.nbytes
    slack = 64 * 512  # the allocator rounds each of a few dozen blocks up to 512 bytes
    assert peak <= planned + slack, f"{fmt} {dtype}: peak {peak} B > planned {planned} B"
