"""HardwareProfile: what `hybridmoe bench-hw` measured (bench_hw.py), stored as JSON.

Expert times are linear fits over three expert sizes, per weight format and tokens per call:
seconds = fixed_s + per_mib_s * MiB of the expert's weights. Orchestration is the per-MoE-layer
time each decode target adds beyond its modelled compute (fitted on the demo model's decode).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

PROFILE_VERSION = 1
TOKENS = (1, 2, 4, 8, 16)  # tokens per call at which expert times are measured


@dataclass(frozen=True)
class ExpertTime:
    """Seconds of one expert's math at TOKENS[i] tokens: fixed_s[i] + per_mib_s[i] * MiB."""

    fixed_s: tuple[float, ...]
    per_mib_s: tuple[float, ...]

    def seconds(self, nbytes: int, tokens: int = 1) -> float:
        """Linear in tokens between the measured points (clamped to TOKENS' range)."""
        mib = nbytes / 2**20
        points = [f + p * mib for f, p in zip(self.fixed_s, self.per_mib_s, strict=True)]
        t = min(max(tokens, TOKENS[0]), TOKENS[-1])
        for i in range(len(TOKENS) - 1):
            t0, t1 = TOKENS[i], TOKENS[i + 1]
            if t0 <= t <= t1:
                return points[i] + (points[i + 1] - points[i]) * (t - t0) / (t1 - t0)
        return points[0]


@dataclass(frozen=True)
class HardwareProfile:
    device: str  # the accelerator tier: "cpu" (no accelerator) or "cuda"
    dram_read_gbps: float  # host memory read bandwidth (torch's sum over a large array)
    cpu_threads: int  # threads the CPU expert kernel used
    cpu_expert: dict[str, ExpertTime]  # weight format -> the numba kernel's time per expert
    cpu_job_s: float  # a CPU executor job's fixed round trip (submit + wake + sync)
    accel_expert: dict[str, ExpertTime]  # format -> the accelerator tier's time per expert
    # dtype name (float32, bfloat16) -> the accelerator tier's weight read speed in a
    # [1, H] x [H, N] matmul of that dtype
    dense_gbps: dict[str, float]
    h2d_gbps: float  # host -> accelerator copy of an expert (cpu device: a host memcpy)
    # decode target -> seconds per MoE layer call beyond modelled compute, and per other layer
    layer_overhead_s: dict[str, float] = field(default_factory=dict)
    notes: str = ""

    def save(self, path: str | Path) -> None:
        data = {"version": PROFILE_VERSION, **dataclasses.asdict(self)}
        Path(path).write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        """ValueError naming the file and field when it is no profile of this version."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--hw {path}: cannot read a hardware profile: {exc}") from exc
        if data.pop("version", None) != PROFILE_VERSION:
            raise ValueError(f"--hw {path}: not a version {PROFILE_VERSION} hardware profile")
        try:
            for key in ("cpu_expert", "accel_expert"):
                data[key] = {k: _expert_time(v) for k, v in data[key].items()}
            return cls(**data)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"--hw {path}: bad hardware profile: {exc}") from exc


def _expert_time(raw: dict) -> ExpertTime:
    fixed, per_mib = tuple(raw["fixed_s"]), tuple(raw["per_mib_s"])
    if len(fixed) != len(TOKENS) or len(per_mib) != len(TOKENS):
        raise TypeError(f"expert times need {len(TOKENS)} points (tokens {TOKENS})")
    return ExpertTime(fixed, per_mib)


def bandwidth_time(gbps: float, fixed_s: float) -> ExpertTime:
    """An expert time that reads its weights once at `gbps` (the same at every TOKENS: decode's
    few tokens are bound by the weight read), plus `fixed_s` per expert."""
    per_mib = 2**20 / (gbps * 1e9)
    return ExpertTime((fixed_s,) * len(TOKENS), (per_mib,) * len(TOKENS))


def default_profile() -> HardwareProfile:
    """A built-in profile for `plan` without --hw: a desktop with dual-channel DDR5 (60 GB/s,
    the kernel reaching 60 % of it) and a GPU of 1 TB/s on PCIe 4.0 x16 (25 GB/s pinned), with
    eager-mode orchestration costs of this engine's order. Assumptions, not measurements: run
    `hybridmoe bench-hw` for this machine's figures."""
    cpu = bandwidth_time(0.6 * 60.0, 5e-6)
    gpu = bandwidth_time(0.7 * 1000.0, 10e-6)
    formats = ("f32", "bf16", "q8_0", "q4_0")
    overhead = {
        "per_layer": 150e-6,
        "resident": 50e-6,
        "offload": 120e-6,
        "cpu": 100e-6,
        "hybrid": 200e-6,
    }
    return HardwareProfile(
        device="cuda",
        dram_read_gbps=60.0,
        cpu_threads=8,
        cpu_expert=dict.fromkeys(formats, cpu),
        cpu_job_s=20e-6,
        accel_expert=dict.fromkeys(formats, gpu),
        dense_gbps={"float32": 700.0, "bfloat16": 700.0},
        h2d_gbps=25.0,
        layer_overhead_s=overhead,
        notes="built-in assumptions (hardware.default_profile), not measured",
    )
