"""The planner and its inputs: model shapes from config.json or GGUF metadata only, hardware
profiles as JSON,
the cost model's structure, the plan's rows, and the `plan` command (with and without the
plot extra)."""

from __future__ import annotations

import builtins
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gguf_checkpoints import write_gguf
from hybridmoe.cli_planning import run_plan
from hybridmoe.engine import Engine, EngineConfig
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.planning.cost_model import CallMix, CostModel, ModelShape
from hybridmoe.planning.hardware import HardwareProfile, default_profile
from hybridmoe.planning.planner import check_trace_matches, outcome_uniform, plan
from hybridmoe.planning.trace import RoutingTrace

ROOT = Path(__file__).parents[2]
QWEN = ROOT / "benchmarks" / "configs" / "qwen3-30b-a3b.json"
TRACE = ROOT / "tests" / "data" / "demo_trace.npz"


def test_shape_reads_the_config_only(tmp_path):
    (tmp_path / "config.json").write_text(QWEN.read_text())  # no weights beside it
    shape = ModelShape.from_config(tmp_path)
    assert (shape.moe_layers, shape.num_experts, shape.top_k) == (48, 128, 8)
    assert shape.expert_nbytes("bf16") == 3 * 2048 * 768 * 2
    # Qwen3-30B-A3B: ~3.3 B active parameters, of which 48 x 8 experts are 1.8 B
    active = shape.dense_params + 48 * 8 * 3 * 2048 * 768
    assert 3.0e9 < active < 3.6e9


def test_shape_reads_a_gguf_files_metadata(demo_checkpoint, tmp_path, capsys):
    path = write_gguf(demo_checkpoint, tmp_path / "demo-Q8_0.gguf", "Q8_0")
    expected = replace(ModelShape.from_config(demo_checkpoint), name="demo-Q8_0")
    assert ModelShape.from_config(path) == replace(expected, stored_format="q8_0")
    args = type("Args", (), dict(model=str(path), hw=None, expert_format=None, trace=None,
                                 gpu_memory=None, plot=None))  # fmt: skip
    run_plan(args)  # plans the file's own expert format
    assert "MiB per q8_0 expert" in capsys.readouterr().out


def test_expert_bytes_match_the_engines_banks(demo_checkpoint):
    shape = ModelShape.from_config(demo_checkpoint)
    for fmt in ("f32", "q8_0"):
        offload = OffloadConfig(decode_target="cpu", expert_format=fmt)
        with Engine.from_pretrained(demo_checkpoint, EngineConfig(offload=offload)) as engine:
            assert shape.expert_nbytes(fmt) == engine.moe_runtime.banks[0].expert_nbytes


def test_profile_round_trips_and_names_a_bad_file(tmp_path):
    profile = default_profile()
    profile.save(tmp_path / "hw.json")
    assert HardwareProfile.load(tmp_path / "hw.json") == profile
    (tmp_path / "bad.json").write_text(json.dumps({"version": 1, "device": "cpu"}))
    with pytest.raises(ValueError, match="bad.json: bad hardware profile"):
        HardwareProfile.load(tmp_path / "bad.json")


def qwen_model(fmt: str = "bf16") -> CostModel:
    return CostModel(ModelShape.from_config(QWEN), default_profile(), fmt, "bfloat16")


def test_more_hits_never_cost_more_and_formats_scale():
    model = qwen_model()
    slow = model.step("offload", CallMix(((1.0, 0, 8, 0),))).seconds
    fast = model.step("offload", CallMix(((1.0, 8, 0, 0),))).seconds
    assert fast < slow
    assert (
        qwen_model("q4_0").step("cpu", CallMix(((1.0, 0, 0, 8),))).seconds
        < model.step("cpu", CallMix(((1.0, 0, 0, 8),))).seconds
    )


def test_uniform_outcome_is_binomial():
    model = qwen_model()
    total = model.shape.total_experts
    o = outcome_uniform(total // 4, 1, model)
    assert o.hit_rate == pytest.approx(0.25)
    assert sum(share for share, *_ in o.mix.calls) == pytest.approx(1.0)
    # at most one fetch per call, so CPU share = E[misses - min(1, misses)] / K
    assert o.cpu_share == pytest.approx((8 * 0.75 - (1 - 0.25**8)) / 8)
    assert outcome_uniform(total // 4, 0, model).hit_rate == 0.0  # a cache that never fills


def test_plan_rows_respect_the_memory_budget():
    model = qwen_model()
    rows = plan(model, gpu_memory_gib=16)
    targets = {r.target for r in rows}
    assert targets == {"cpu", "offload", "hybrid"}  # 57 GiB of experts: resident does not fit
    fits = (16 * 2**30 - model.shape.dense_params * 2) // model.shape.expert_nbytes("bf16")
    assert max(r.slots for r in rows) <= fits
    hybrid = [r for r in rows if r.target == "hybrid"]
    assert all(r.max_fetch is not None for r in hybrid)
    assert "resident" in {r.target for r in plan(model)}


def test_plan_with_a_trace_of_another_model_is_refused():
    trace = RoutingTrace.load(TRACE)
    with pytest.raises(ValueError, match="record a trace of this model"):
        check_trace_matches(trace, qwen_model())


def test_plan_command_prints_every_target(demo_checkpoint):
    argv = ["plan", "--model", str(demo_checkpoint), "--trace", str(TRACE)]
    result = subprocess.run(
        [sys.executable, "-m", "hybridmoe", *argv], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    for word in ("cpu", "resident", "offload", "hybrid", "--max-fetch", "tok/s", "bottleneck"):
        assert word in result.stdout


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    args = type("Args", (), dict(model=str(QWEN), hw=None, expert_format=None, trace=None,
                                 gpu_memory=24.0, plot=str(tmp_path / "p.png")))  # fmt: skip
    with pytest.raises(ImportError, match=r"hybridmoe\[plot\]"):
        run_plan(args)


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    args = type("Args", (), dict(model=str(QWEN), hw=None, expert_format=None, trace=None,
                                 gpu_memory=24.0, plot=str(tmp_path / "p.png")))  # fmt: skip
    run_plan(args)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
