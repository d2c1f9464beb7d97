"""The host syncs of a decode step (docs/host-syncs.md), counted with CUDA's sync debug mode:
make_batch and the step's input copies wait for nothing; a step of the `gpu` target waits once,
for its logits; every sync of an offloading target's step is one the document lists."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from hf_checkpoints import PROMPT_IDS, SHORT_PROMPT_IDS
from hybridmoe.engine import Engine, EngineConfig
from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.moe.config import OffloadConfig

from .device_helpers import sync_debug_mode

pytestmark = pytest.mark.cuda_only

SYNC_WARNING = "called a synchronizing CUDA operation"
# Where the syncs docs/host-syncs.md lists are issued from (the Python frame of the op): the
# logits, the cache policy's id read and write-back, the offload target's distinct-expert count,
# the grouped reference's route grouping, and a CPU worker's wait for its inputs.
DOCUMENTED_SYNC_FILES = {"transformer.py", "offload_cache.py", "moe.py", "routing.py", "cuda.py"}


def engine_for(directory: Path, device: torch.device, target: str) -> Engine:
    offload = OffloadConfig(decode_target=target, expert_cache_slots=4, max_fetch=1)
    config = EngineConfig(dtype="float32", device=str(device), offload=offload)
    return Engine.from_pretrained(directory, config)


def prefilled(engine: Engine, prompts: list[list[int]]) -> KVCache:
    model = engine.model
    cache = KVCache(model.cfg, len(prompts), 64, model.dtype, model.device)
    for row, prompt in enumerate(prompts):
        model.forward(
            torch.tensor([prompt]), model.make_batch(torch.arange(len(prompt))[None], [row], cache)
        )
    return cache


def decode_step(engine: Engine, prompts: list[list[int]], cache: KVCache, step: int):
    """One decode step of every prompt; returns its host logits [B, V]."""
    positions = torch.tensor([[len(p) + step] for p in prompts])
    ids = torch.tensor([[7 + row] for row in range(len(prompts))])
    batch = engine.model.make_batch(positions, list(range(len(prompts))), cache, is_decode=True)
    return engine.model.forward(ids, batch)


def syncs_of_a_decode_step(
    engine: Engine, prompts: list[list[int]]
) -> list[warnings.WarningMessage]:
    cache = prefilled(engine, prompts)
    decode_step(engine, prompts, cache, 0)  # warm: lazy initialisation, allocator growth
    torch.cuda.synchronize(engine.model.device)
    with warnings.catch_warnings(record=True) as caught, sync_debug_mode("warn"):
        warnings.simplefilter("always")
        decode_step(engine, prompts, cache, 1)
    return [w for w in caught if SYNC_WARNING in str(w.message)]


def where(syncs: list[warnings.WarningMessage]) -> list[str]:
    return [f"{Path(w.filename).name}:{w.lineno}" for w in syncs]


@pytest.mark.parametrize(
    "prompts", [[PROMPT_IDS], [PROMPT_IDS, SHORT_PROMPT_IDS]], ids=["B1", "B2"]
)
def test_make_batch_and_the_input_copies_never_wait(tiny_checkpoint, device, prompts) -> None:
    with engine_for(tiny_checkpoint, device, "gpu") as engine:
        cache = prefilled(engine, prompts)
        positions = torch.tensor([[len(p)] for p in prompts])
        with sync_debug_mode("error"):
            batch = engine.model.make_batch(positions, list(range(len(prompts))), cache, True)
        assert batch.positions.device == device and batch.row_index.device == device


@pytest.mark.parametrize(
    "prompts", [[PROMPT_IDS], [PROMPT_IDS, SHORT_PROMPT_IDS]], ids=["B1", "B2"]
)
def test_a_gpu_target_decode_step_waits_once_for_its_logits(tiny_checkpoint, device, prompts):
    with engine_for(tiny_checkpoint, device, "gpu") as engine:
        syncs = syncs_of_a_decode_step(engine, prompts)
    assert [Path(w.filename).name for w in syncs] == ["transformer.py"], where(syncs)


@pytest.mark.parametrize("target", ["offload", "hybrid", "cpu"])
def test_every_sync_of_an_offloading_step_is_a_documented_one(tiny_checkpoint, device, target):
    with engine_for(tiny_checkpoint, device, target) as engine:
        syncs = syncs_of_a_decode_step(engine, [PROMPT_IDS, SHORT_PROMPT_IDS])
    print(f"{target}: {len(syncs)} syncs at {where(syncs)}")
    assert {Path(w.filename).name for w in syncs} <= DOCUMENTED_SYNC_FILES, where(syncs)
    assert where(syncs)[-1].startswith("transformer.py")  # the logits, last
