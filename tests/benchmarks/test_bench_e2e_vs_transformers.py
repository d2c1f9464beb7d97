"""benchmarks/bench_hybrid_attention.py and bench_gpt_oss.py at their tiny shapes, a few tokens:
each builds its checkpoints (gpt-oss's MXFP4 one as published, and its exact bf16
dequantisation), runs both engines at batch 1 and 4 and reports every line; no timing is
asserted (a shared machine), the tokens are: at this shape both engines agree."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_gpt_oss  # noqa: E402
import bench_hybrid_attention  # noqa: E402

RUN = ["--shape", "tiny", "--tokens", "3", "--repeats", "1", "--threads", "1"]
ROW = re.compile(
    r"batch (\d): hybridmoe .* tok/s, transformers .* tok/s, ratio .*x \(CPU time .*\); "
    r"(\d)/(\d) sequences with identical tokens; load average"
)


def _rows(text: str) -> list[tuple[str, str, str]]:
    return ROW.findall(text)


def test_hybrid_attention_bench(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bench_hybrid_attention.main([*RUN, "--checkpoint-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "MiB per sequence" in out and "this tiny checkpoint" in out
    assert _rows(out) == [("1", "1", "1"), ("4", "4", "4")]


def test_gpt_oss_bench_bf16_and_mxfp4(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bench_gpt_oss.main([*RUN, "--checkpoint-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert _rows(out) == [("1", "1", "1"), ("4", "4", "4")] * 2
    assert out.index("bf16 experts, batch 1") < out.index("mxfp4 experts, batch 1")
    with safe_open(tmp_path / "mxfp4" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
