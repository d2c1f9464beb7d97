"""benchmarks/bench_decode_overhead.py at the tiny shape: both variants run, decode the same
tokens, and every counter is measured (finite, and the ones a decode step must have are > 0)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from bench_decode_overhead import COUNTERS, main, table  # noqa: E402


def test_quick_run_measures_every_counter(capsys) -> None:
    results = main(["--quick", "--tokens", "2", "--threads", "2", "--variants", "before,after"])
    assert list(results) == ["before", "after"]
    assert results["before"]["ids"] == results["after"]["ids"]
    for name, result in results.items():
        counters = result["counters"]
        assert set(counters) >= {key for key, _, _ in COUNTERS}, name
        assert all(math.isfinite(v) for v in counters.values()), (name, counters)
        # a decode step launches kernels, runs aten ops and Python code
        for key in ("launches", "aten_ops", "py_calls"):  # thread ticks are 10 ms: may be 0
            assert counters[key] > 0, (name, key, counters)
    printed = capsys.readouterr().out
    assert "load average" in printed and "tokens identical across variants: True" in printed
    assert table(results).count("\n") == len(COUNTERS)
