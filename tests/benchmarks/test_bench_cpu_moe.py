"""benchmarks/bench_cpu_moe.py's --tile measurement of the float tile and of the q8 one
(FORMAT+q8: the 32-block integer dots, and a k-quant's super-block ints), a few short calls:
the loops compile and give a finite time. The tiles' values are the kernel tests' concern."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from bench_cpu_moe import tile_ns  # noqa: E402


@pytest.mark.parametrize("fmt", ["q4_0", "q4_0+q8", "q4_k+q8"])
def test_tile_timing_runs(fmt: str) -> None:
    ns = tile_ns(fmt, rows=8, weights=512, calls=3)
    assert math.isfinite(ns) and ns > 0
