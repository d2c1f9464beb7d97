"""benchmarks/bench_hybrid_overhead.py at a tiny shape: every pass runs (overlap on and off,
noop and real math, and the instrumented passes that wrap the executor's phases: they broke
once when a wrapped method was inlined), and each call's time and phases are measured."""

from __future__ import annotations

import math
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from bench_hybrid_overhead import PHASES, main  # noqa: E402


def test_every_pass_runs_and_measures() -> None:
    argv = ["--layers", "2", "--experts", "16", "--steps", "6", "--warmup", "2"]
    passes = main(argv)
    assert [(p.overlap, p.real, p.instrumented) for p in passes] == [
        (overlap, real, instrumented)
        for instrumented in (False, True)
        for real in (False, True)
        for overlap in (True, False)
    ]
    for p in passes:
        assert len(p.totals_ns) == 6 * 2 and all(t > 0 for t in p.totals_ns), p.name
        if p.instrumented:
            assert set(PHASES) <= set(p.phases_ns), p.name
            means = [sum(v) / len(v) for k, v in p.phases_ns.items() if k in PHASES]
            assert all(math.isfinite(m) for m in means), p.name
