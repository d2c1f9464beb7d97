"""The hardware profile's pieces: expert-time interpolation, the two-size fit, and the cheap
measurements returning sane figures (no assertion on speed)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridmoe.planning import bench_hw
from hybridmoe.planning.hardware import TOKENS, ExpertTime
from hybridmoe.platform.cpu import CpuPlatform


def test_expert_time_interpolates_in_tokens_and_scales_in_bytes():
    t = ExpertTime(fixed_s=(1.0, 2.0, 3.0, 4.0, 5.0), per_mib_s=(0.5,) * len(TOKENS))
    assert t.seconds(2**20, 1) == pytest.approx(1.5)
    assert t.seconds(2 * 2**20, 3) == pytest.approx(2.5 + 1.0)  # halfway between T=2 and T=4
    assert t.seconds(0, 64) == pytest.approx(5.0)  # clamped to T=16


def test_the_fit_recovers_a_linear_cost(monkeypatch):
    """With a stand-in timer of 3 us + 7 us/MiB per route, the fit returns those figures."""

    timed: dict[str, float] = {}

    def run(x, ids, w, bank):
        timed["s"] = bench_hw.ROUTES * (3e-6 + 7e-6 * bank.expert_nbytes / 2**20)

    monkeypatch.setattr(bench_hw, "best_s", lambda fn, repeats, sync: (fn(), timed["s"])[1])
    fit = bench_hw.expert_time(run, "f32", 1, CpuPlatform().device, lambda: None)
    assert fit.fixed_s == pytest.approx((3e-6,) * len(TOKENS))
    assert fit.per_mib_s == pytest.approx((7e-6,) * len(TOKENS))


@pytest.mark.parametrize(
    ("fmt", "q8"), [("q8_0", True), ("q4_0", True), ("q4_1", False), ("bf16", False)]
)
def test_timed_banks_compute_as_the_engines_default(fmt: str, q8: bool):
    """The profile times each format as a model of it computes with no flags (activation_quant
    auto: q8 activations for formats with integer dots)."""
    bank = bench_hw.make_bank(64, 32, fmt)
    assert bank.fmt.name == fmt and bank.q8_activations is q8


def test_cheap_measurements_are_positive_and_finite():
    platform = CpuPlatform()
    figures = [
        bench_hw.dram_read_gbps(mib=8, repeats=1),
        bench_hw.cpu_job_s(repeats=3),
        bench_hw.dense_gbps(platform, torch.bfloat16, mib=4, repeats=1),
        bench_hw.h2d_gbps(platform, mib=4, repeats=1),
    ]
    assert all(math.isfinite(f) and f > 0 for f in figures), figures


@pytest.mark.parametrize("start", [{}, {"per_layer": 1.0, "cpu": 5.0}])
def test_orchestration_fit_reproduces_the_calibration_runs(monkeypatch, start):
    """With stand-in measurements, the fitted profile predicts each calibration run exactly,
    whatever overhead the profile carried before (a refit replaces it)."""
    import dataclasses

    from hybridmoe import cli_planning
    from hybridmoe.demo import require_demo_checkpoint
    from hybridmoe.planning.cost_model import CallMix, CostModel, ModelShape
    from hybridmoe.planning.hardware import default_profile

    runs = {"resident": (0.010, 2, 0, 0), "offload": (0.020, 1, 0.5, 0),
            "cpu": (0.030, 0, 0, 2), "hybrid": (0.025, 1, 0.2, 0.8)}  # fmt: skip

    def fake_decode(directory, offload, device, threads=None):
        seconds, *mix = runs[offload.decode_target]
        return seconds, CallMix(((1.0, *mix),))

    monkeypatch.setattr(cli_planning, "measured_decode", fake_decode)
    profile = dataclasses.replace(default_profile(), layer_overhead_s=start)
    fitted = cli_planning.calibrate_orchestration(profile, "cpu", None)
    model = CostModel(ModelShape.from_config(require_demo_checkpoint()), fitted, "f32")
    for target, (seconds, *mix) in runs.items():
        assert model.step(target, CallMix(((1.0, *mix),))).seconds == pytest.approx(seconds)
