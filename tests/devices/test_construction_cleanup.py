"""A failed Engine construction releases what it had created: the CPU expert workers are joined
and the platform is closed (which unpins the host banks on an accelerator), whichever step
failed, also when closing the MoE runtime fails itself."""

from __future__ import annotations

import threading

import pytest
import torch

from hf_checkpoints import write_hf_checkpoint
from hybridmoe.engine import Engine, EngineConfig
from hybridmoe.engine import engine as engine_module
from hybridmoe.engine.moe_runtime import MoeRuntime
from hybridmoe.models.transformer import MoeCausalLM
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.platform.cpu import CpuPlatform

HYBRID = EngineConfig(dtype="float32", offload=OffloadConfig(decode_target="hybrid"))


class ClosingPlatform(CpuPlatform):
    def __init__(self):
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_hf_checkpoint("qwen3_moe", "gqa_head_dim", tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def platform(monkeypatch) -> ClosingPlatform:
    platform = ClosingPlatform()
    monkeypatch.setattr(engine_module, "create_platform", lambda _: platform)
    return platform


def cpu_workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("hybridmoe-cpu-experts")}


def out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a test)")


@pytest.mark.parametrize("failing", ["MoeCausalLM.to", "plan_device_memory", "create_moe_runtime"])
def test_a_failed_construction_joins_the_workers_and_closes_the_platform(
    checkpoint, platform, monkeypatch, failing
):
    if failing == "MoeCausalLM.to":
        monkeypatch.setattr(MoeCausalLM, "to", out_of_memory)
    else:
        monkeypatch.setattr(engine_module, failing, out_of_memory)
    workers_before = cpu_workers()
    with pytest.raises(torch.OutOfMemoryError, match="a test"):
        Engine.from_pretrained(checkpoint, HYBRID)
    assert cpu_workers() == workers_before  # no worker left running
    assert platform.closed >= 1


def test_the_platform_is_closed_when_closing_the_runtime_fails(checkpoint, platform, monkeypatch):
    def failing_close(runtime: MoeRuntime) -> None:
        runtime.cpu_executor.close()
        raise RuntimeError("closing the runtime failed (a test)")

    monkeypatch.setattr(MoeCausalLM, "to", out_of_memory)
    monkeypatch.setattr(MoeRuntime, "close", failing_close)
    with pytest.raises(RuntimeError, match="closing the runtime failed") as raised:
        Engine.from_pretrained(checkpoint, HYBRID)
    assert isinstance(raised.value.__context__, torch.OutOfMemoryError)  # the cause is kept
    assert platform.closed == 1
