"""benchmarks/bench_engine_ab.py: two engines in one process on the demo checkpoint, a setting
made only while B loads (and put back), tokens compared, and bad settings refused by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_engine_ab  # noqa: E402
from bench_engine_ab import Setting, applied, main  # noqa: E402

from hybridmoe.kernels import numba_dense  # noqa: E402

PARALLEL_ALWAYS = "hybridmoe.kernels.numba_dense.MIN_PARALLEL_BYTES=0"


def test_two_engines_alternate_and_the_setting_is_put_back(
    demo_checkpoint: Path, monkeypatch, capsys
) -> None:
    """B loads with every dense projection on the pool (the same bits as the serial calls), so
    both decode the same tokens; the threshold is the module's own again afterwards."""
    from hybridmoe.engine import Engine

    before, seen, real_load = numba_dense.MIN_PARALLEL_BYTES, [], Engine.from_pretrained

    def recording_load(path, config):
        seen.append(numba_dense.MIN_PARALLEL_BYTES)  # the threshold in force while it loads
        return real_load(path, config)

    monkeypatch.setattr(Engine, "from_pretrained", recording_load)
    result = main(
        ["--model", str(demo_checkpoint), "--b", PARALLEL_ALWAYS, "--tokens", "3",
         "--rounds", "2", "--dtype", "float32"]
    )  # fmt: skip
    assert numba_dense.MIN_PARALLEL_BYTES == before and seen == [before, 0]
    assert result["same_tokens"] and len(result["a"]) == len(result["b"]) == 2
    assert len(result["ratios"]) == 2 and all(r > 0 for r in result["ratios"])
    printed = capsys.readouterr().out
    assert f"B: {PARALLEL_ALWAYS}:" in printed and "A: the defaults:" in printed
    assert "B / A, the time a token:" in printed and "load average before" in printed


def test_the_setting_is_in_force_while_loading_only() -> None:
    before = numba_dense.MIN_PARALLEL_BYTES
    with pytest.raises(RuntimeError, match="load failed"):
        with applied([Setting.parse(PARALLEL_ALWAYS)]):
            assert numba_dense.MIN_PARALLEL_BYTES == 0
            raise RuntimeError("load failed")
    assert numba_dense.MIN_PARALLEL_BYTES == before


class _FixedTokens:
    def __init__(self, ids: list[int]):
        self.ids = ids

    def generate_ids(self, prompts, params):
        return [self.ids for _ in prompts]

    def close(self) -> None:
        pass


def test_engines_decoding_differently_are_refused(monkeypatch, capsys) -> None:
    engines = iter([_FixedTokens([1, 2]), _FixedTokens([1, 3])])
    monkeypatch.setattr(bench_engine_ab, "load", lambda args, settings: next(engines))
    argv = ["--model", "unused", "--tokens", "2", "--rounds", "1"]
    with pytest.raises(SystemExit, match="A and B decode different tokens"):
        main(argv)
    engines = iter([_FixedTokens([1, 2]), _FixedTokens([1, 3])])
    result = main([*argv, "--allow-different"])
    assert result["same_tokens"] is False
    assert "tokens identical: False" in capsys.readouterr().out


@pytest.mark.parametrize(
    "spec, message",
    [
        ("MIN_PARALLEL_BYTES", "is not MODULE.ATTR=VALUE"),
        ("MIN_PARALLEL_BYTES=0", "is not MODULE.ATTR=VALUE"),
        ("hybridmoe.kernels.numba_dense.MIN_PARALLEL_BYTES=big", "'big' is not a Python literal"),
    ],
)
def test_a_malformed_setting_is_refused_by_name(spec: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        Setting.parse(spec)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("hybridmoe.no_such_module.X=1", "No module named 'hybridmoe.no_such_module'"),
        ("hybridmoe.kernels.numba_dense.NO_SUCH=1", "numba_dense has no attribute 'NO_SUCH'"),
    ],
)
def test_a_setting_of_nothing_is_refused_by_name(spec: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        with applied([Setting.parse(spec)]):
            pass
