"""Routing traces: recording leaves every decode target's tokens unchanged and records the
router's expert ids (the same on every target); the .npz round-trips; the CLI writes one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridmoe.cli_planning import record_trace
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.planning.trace import RecordingExperts, RoutingTrace

PROMPTS = [[5, 17, 300, 41, 9], [1000, 7, 77]]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
TARGETS = [
    OffloadConfig(decode_target="resident"),
    OffloadConfig(decode_target="offload", expert_cache_slots=4),
    OffloadConfig(decode_target="cpu"),
    OffloadConfig(decode_target="hybrid", expert_cache_slots=3, max_fetch=1),
    OffloadConfig(decode_target="hybrid", expert_cache_slots=3, max_fetch="auto"),
]


@pytest.fixture(scope="module")
def resident_run(demo_checkpoint: Path) -> tuple[RoutingTrace, list[list[int]]]:
    with Engine.from_pretrained(demo_checkpoint, EngineConfig(max_batch=1)) as engine:
        return record_trace(engine, PROMPTS, PARAMS)


@pytest.mark.parametrize("offload", TARGETS, ids=lambda c: f"{c.decode_target}-{c.max_fetch}")
def test_tracing_changes_no_token_and_records_the_router(demo_checkpoint, resident_run, offload):
    config = EngineConfig(max_batch=1, offload=offload)
    with Engine.from_pretrained(demo_checkpoint, config) as engine:
        plain = engine.generate_ids(PROMPTS, PARAMS)
        trace, traced = record_trace(engine, PROMPTS, PARAMS)
        assert not any(
            isinstance(layer.experts, RecordingExperts) for layer in engine.model.moe_layers
        )
    reference_trace, reference_tokens = resident_run
    assert traced == plain == reference_tokens
    # the ids before the cache rewrote them: the router's, equal on every target
    np.testing.assert_array_equal(trace.expert_ids, reference_trace.expert_ids)
    # one row per decode step: every generated token but the prefill's first
    assert trace.num_rows == sum(len(t) - 1 for t in traced)
    assert trace.num_layers == 5 and trace.top_k == 2 and trace.num_experts == 8


def test_trace_rows_and_weights(resident_run):
    trace, _ = resident_run
    assert (np.diff(trace.step) == 1).all()  # one sequence per step (max_batch 1)
    sums = trace.weights.astype(np.float32).sum(-1)  # norm_topk_prob: weights sum to 1
    np.testing.assert_allclose(sums, 1.0, atol=2e-3)
    assert len(list(trace.calls())) == trace.num_rows * trace.num_layers


def test_save_load_round_trip(resident_run, tmp_path):
    trace, _ = resident_run
    trace.save(tmp_path / "t.npz")
    loaded = RoutingTrace.load(tmp_path / "t.npz")
    np.testing.assert_array_equal(loaded.expert_ids, trace.expert_ids)
    np.testing.assert_array_equal(loaded.step, trace.step)
    assert loaded.num_experts == trace.num_experts and loaded.meta == trace.meta


def test_load_names_a_bad_file(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="bad.npz: not a routing trace"):
        RoutingTrace.load(bad)


def test_cli_trace_writes_a_trace(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def fibonacci(n):\n\nimport os\n")
    out = tmp_path / "trace.npz"
    argv = ["trace", "--prompts", str(prompts), "--max-tokens", "4", "-o", str(out)]
    argv += ["--decode-target", "hybrid", "--max-fetch", "auto"]
    result = subprocess.run(
        [sys.executable, "-m", "hybridmoe", *argv], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    trace = RoutingTrace.load(out)
    assert trace.meta["decode_target"] == "hybrid" and trace.meta["prompts"] == 2
    assert 0 < trace.num_rows <= 6
