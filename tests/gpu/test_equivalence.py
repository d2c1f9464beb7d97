"""On the accelerator, every decode target (and both prefill modes) gives the greedy tokens of
the `gpu` target there, and decode logits close to the cpu device's reference, for a float and
two quantised expert formats (DESIGN.md: exactness)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hf_checkpoints import PROMPT_IDS, SHORT_PROMPT_IDS, top2_gap
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.stats import GenerationStats
from hybridmoe.moe.config import OffloadConfig

from .decoding import decode_logits

PROMPTS = [PROMPT_IDS, SHORT_PROMPT_IDS]
N_TOKENS = 12
GREEDY = SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)
FORMATS = ["f32", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]  # blocks of 32: the tiny model's widths
# fp32 with TF32 off: the device and the cpu reference run the same math from the same stored
# weights, in a different summation order and with different kernels.
LOGITS_TOL = dict(atol=2e-4, rtol=1e-4)
# A greedy choice closer than this to a tie could flip on rounding noise: below it the test's
# premise (one right answer) fails, not the engine.
MIN_TOP2_GAP = 1e-3

# The tiny model has 2 MoE layers x 8 experts, top-3: 4 slots of 16 experts miss often.
HYBRID = dict(decode_target="hybrid", expert_cache_slots=4)
TARGETS: dict[str, dict] = {
    "offload-min-slots": dict(decode_target="offload", expert_cache_slots=3),
    "cpu": dict(decode_target="cpu"),
    "hybrid-fetch0": dict(HYBRID, max_fetch=0),
    "hybrid-fetch1": dict(HYBRID, max_fetch=1),
    "hybrid-fetch1-no-overlap": dict(HYBRID, max_fetch=1, overlap=False),
    "hybrid-prefill-stream": dict(HYBRID, max_fetch=1, prefill="stream"),
    "hybrid-prefill-cpu": dict(HYBRID, max_fetch=1, prefill="cpu"),
}


@dataclass
class Run:
    tokens: list[list[int]]  # greedy tokens of PROMPTS decoded together
    logits: torch.Tensor  # [len(PROMPTS) * N_TOKENS, V] decode logits, one prompt at a time
    stats: GenerationStats  # of the generate call
    layers_streamed: int | None  # prefill's layer copies; None without a streamer
    overlap: bool | None  # the hybrid executor's overlap; None without one


def run(directory: Path, device: torch.device, offload: OffloadConfig) -> Run:
    config = EngineConfig(dtype="float32", device=str(device), offload=offload)
    with Engine.from_pretrained(directory, config) as engine:
        runtime = engine.moe_runtime
        if runtime.cache is not None:
            assert runtime.cache.slot_bank.gate_up.device == device
            assert all(bank.gate_up.device.type == "cpu" for bank in runtime.banks)
        if offload.decode_target == "gpu" and device.type != "cpu":  # every expert resident
            stores = [layer.experts.store for layer in engine.model.moe_layers]
            assert all(store.gate_up.device == device for store in stores)
        tokens = engine.generate_ids(PROMPTS, GREEDY)
        stats = engine.stats
        logits = decode_logits(engine, PROMPTS, N_TOKENS)
        streamer = getattr(runtime.prefill, "streamer", None)  # stream/auto prefill only
        hybrid = runtime.hybrid_executor
    return Run(
        tokens,
        logits,
        stats,
        None if streamer is None else streamer.layers_copied,
        None if hybrid is None else hybrid.overlap,
    )


@dataclass
class Reference:
    fmt: str
    cpu: Run  # the `gpu` target on the cpu device: the reference logits
    device: Run  # the `gpu` target on the accelerator: the reference tokens


@pytest.fixture(scope="module", params=FORMATS)
def reference(request, tiny_checkpoint: Path, device: torch.device) -> Reference:
    offload = OffloadConfig(expert_format=request.param)
    cpu = run(tiny_checkpoint, torch.device("cpu"), offload)
    return Reference(request.param, cpu, run(tiny_checkpoint, device, offload))


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    max_diff = (actual - expected).abs().max().item()
    torch.testing.assert_close(
        actual, expected, **LOGITS_TOL, msg=lambda m: f"{what}: max |diff| {max_diff:.2e}\n{m}"
    )


def test_gpu_target_matches_the_cpu_reference(reference: Reference) -> None:
    gap = top2_gap(reference.cpu.logits).min().item()
    assert gap >= MIN_TOP2_GAP, f"{reference.fmt}: a greedy choice is {gap:.1e} from a tie"
    assert reference.device.tokens == reference.cpu.tokens, reference.fmt
    assert_logits_close(reference.device.logits, reference.cpu.logits, f"{reference.fmt}/gpu")


@pytest.mark.parametrize("name", list(TARGETS))
def test_target_matches_the_gpu_target(
    reference: Reference, name: str, tiny_checkpoint: Path, device: torch.device
) -> None:
    offload = OffloadConfig(expert_format=reference.fmt, **TARGETS[name])
    case = f"{reference.fmt}/{name}"
    got = run(tiny_checkpoint, device, offload)
    assert got.tokens == reference.device.tokens, case
    assert_logits_close(got.logits, reference.cpu.logits, case)
    check_the_case_does_what_it_is_named_for(got, offload, case)


def check_the_case_does_what_it_is_named_for(got: Run, offload: OffloadConfig, case: str) -> None:
    experts = got.stats.experts
    assert experts is not None and experts.routes > 0, case
    if offload.decode_target == "offload":
        assert experts.cpu_routes == 0 and experts.fetched > 0, case
    if offload.decode_target == "cpu":
        assert experts.cpu_routes == experts.routes, case
    if offload.decode_target == "hybrid":
        assert experts.cpu_routes > 0, case  # misses reached the CPU
        assert (experts.fetched > 0) == (offload.max_fetch > 0), case
        assert got.overlap == offload.overlap, case
    if offload.prefill == "stream":
        assert got.layers_streamed, case
    if offload.prefill == "cpu":
        assert got.layers_streamed is None, case
