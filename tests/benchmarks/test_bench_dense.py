"""bench_dense.py's comparison row at a tiny shape, for formats with a quantiser and for the
k-quants, whose weights it makes from seeded random blocks (they have no quantiser)."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_dense  # noqa: E402


class _FixedDram:
    def read_gbps(self) -> tuple[float, float]:
        return 10.0, 10.0


@pytest.mark.parametrize("fmt", ["bf16", "q4_0", "q4_k", "q6_k"])
def test_compare_prints_a_row_for_the_format(monkeypatch, capsys, fmt: str) -> None:
    monkeypatch.setattr(bench_dense, "WORKING_SET_BYTES", 1 << 16)  # a few copies
    bench_dense.compare("tiny.q", (8, 256), fmt, 1, 1, Namespace(reps=1), _FixedDram(), None)
    row = capsys.readouterr().out
    assert f"tiny.q {' ' * 16}{fmt:5s} T=1 thr=1" in row
    assert "| ours" in row and "| torch" in row and "x torch" in row
