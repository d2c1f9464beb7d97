"""benchmarks/bench_cpu_moe.py's --tile measurement of the float tile and of the q8 one
(FORMAT+q8: the 32-block integer dots, and a k-quant's super-block ints), a few short calls:
the loops compile and give a finite time. The tiles' values are the kernel tests' concern."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from bench_cpu_moe import tile_ns  # noqa: E402


@pytest.mark.parametrize("fmt", ["q4_0", "q4_0+q8", "q4_k+q8"])
def test_tile_timing_runs(fmt: str) -> None:
    ns = tile_ns(fmt, rows=8, weights=512, calls=3)
    assert math.isfinite(ns) and ns > 0


def test_llamacpp_column_runs(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """--llamacpp: llama.cpp's layer timed beside ours on the same bank (ggml_moe.py; skipped
    without llama-cpp-python), its ratio printed on every row."""
    import bench_cpu_moe
    import ggml_moe

    if not ggml_moe.available():
        pytest.skip("llama-cpp-python absent")
    monkeypatch.setattr(bench_cpu_moe, "FLUSH_BYTES", 2**20)
    argv = ["bench_cpu_moe.py", "--shapes", "small", "--formats", "q4_k+q8", "--llamacpp"]
    monkeypatch.setattr(sys, "argv", [*argv, "--reps", "2", "--torch-reps", "0"])
    bench_cpu_moe.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if " µs " in line]
    assert len(rows) == 3 and all("x llama.cpp" in row for row in rows)


def test_interleaved_calls_share_routes_and_prepare_untimed() -> None:
    """time_interleaved: every fn gets each rep's routes; a fn's prepare() runs before the
    flush (untimed) on those same routes, then the timed call."""
    from bench_cpu_moe import SHAPES, time_interleaved

    events = []

    class Memory:
        flushes, best = True, 0.0

        def flush(self) -> None:
            events.append(("flush",))

    def first(x, ids, weights, bank):
        events.append(("first", ids.tolist()))

    def second(x, ids, weights, bank):
        events.append(("second", ids.tolist()))

    second.prepare = lambda x, ids, weights, bank: events.append(("prepare", ids.tolist()))
    bank = type("Bank", (), {"expert_nbytes": 10})()
    times, nbytes = time_interleaved((first, second), bank, SHAPES["small"], 1, True, 3, Memory())
    assert len(times) == 2 and nbytes == 10 * SHAPES["small"].top_k
    timed = events[3:]  # after the warm-up: first, prepare, second
    assert [e[0] for e in events[:3]] == ["first", "prepare", "second"]
    for rep in range(3):  # a flush, the first call; the second's prepare, a flush, its call
        flush, a, prep, flush2, b = timed[5 * rep : 5 * rep + 5]
        assert (flush, a[0], prep[0], flush2, b[0]) == (
            ("flush",),
            "first",
            "prepare",
            ("flush",),
            "second",
        )
        assert a[1] == prep[1] == b[1]


def test_bank_words_are_the_banks_own_bytes() -> None:
    """bank_words: the denominator's buffers are the bank's memory itself (the same pages the
    kernel reads), every whole 8-byte word of each tensor, none copied."""
    from bench_cpu_moe import SHAPES, bank_words, make_bank

    bank = make_bank(SHAPES["small"], "q4_k")
    words = bank_words(bank)
    tensors = bank.tensors()
    assert len(words) == len(tensors)
    for word, tensor in zip(words, tensors, strict=True):
        assert word.dtype == torch.int64 and word.data_ptr() == tensor.data_ptr()
        assert word.nbytes == tensor.nbytes // 8 * 8


def test_warm_code_calls_other_experts_after_the_flush() -> None:
    """--warm-code: after each flush, an untimed call on routes sharing no expert with the
    timed call's (each token's distinct), the fn's inputs handed over again, then the timed
    call on the rep's routes."""
    from bench_cpu_moe import SHAPES, time_interleaved

    shape, events = SHAPES["1gb"], []

    class Memory:
        flushes, best = True, 0.0

        def flush(self) -> None:
            events.append(("flush", None))

    def fn(x, ids, weights, bank):
        events.append(("call", ids.clone()))

    fn.prepare = lambda x, ids, weights, bank: events.append(("prepare", ids.clone()))
    bank = type("Bank", (), {"expert_nbytes": 1})()
    time_interleaved((fn,), bank, shape, 4, False, 3, Memory(), warm_code=True)
    timed = events[2:]  # after the warm-up's prepare and call
    for rep in range(3):
        prep, flush, warm_prep, warm, again, call = timed[6 * rep : 6 * rep + 6]
        assert [e[0] for e in (prep, flush, warm_prep, warm, again, call)] == [
            "prepare", "flush", "prepare", "call", "prepare", "call"
        ]  # fmt: skip
        ids, other = call[1], warm[1]
        assert torch.equal(prep[1], ids) and torch.equal(again[1], ids)
        assert torch.equal(warm_prep[1], other) and other.shape == ids.shape
        assert not set(other.flatten().tolist()) & set(ids.flatten().tolist())
        assert all(len(set(row.tolist())) == shape.top_k for row in other)
