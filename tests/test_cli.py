"""The command line, run in a subprocess exactly as a user runs it, on the embedded demo model,
with a fresh cache directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hybridmoe.demo import require_demo_checkpoint
from hybridmoe.kernels.compile_progress import DESCRIPTION

PROMPT = "def fibonacci(n):"
GENERATE = ["generate", PROMPT, "--max-tokens", "8"]
STATS_WORDS = ("prompt tokens", "prefill", "decode", "tok/s")
SUBPROCESS_TIMEOUT_S = 300  # only so a hung CLI fails the test instead of hanging the suite


@dataclass(frozen=True)
class GreedyRuns:
    first: subprocess.CompletedProcess
    second: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybridmoe-cache")


def run_cli(
    args: list[str], cache_dir: Path, stdin: str | None = None, program: list[str] | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYBRIDMOE_CACHE_DIR=str(cache_dir))
    return subprocess.run(
        (program or [sys.executable, "-m", "hybridmoe"]) + args,
        input=stdin,
        capture_output=True,
        encoding="utf-8",
        env=env,
        timeout=SUBPROCESS_TIMEOUT_S,
    )


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\nstderr:\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def greedy_runs(cache_dir: Path) -> GreedyRuns:
    """`generate` twice with the same flags, on the default (demo) model."""
    return GreedyRuns(ok(run_cli(GENERATE, cache_dir)), ok(run_cli(GENERATE, cache_dir)))


def generated_text(result: subprocess.CompletedProcess) -> str:
    assert result.stdout.endswith("\n")
    return result.stdout[:-1]


def test_generate_prints_text_and_stats(greedy_runs):
    assert generated_text(greedy_runs.first).strip()
    stats_line = greedy_runs.first.stderr.strip().splitlines()[-1]
    for word in STATS_WORDS:
        assert word in stats_line


def test_the_first_run_shows_its_kernel_compilation_and_a_cached_run_nothing(greedy_runs):
    # the module's cache directory starts empty: the first run compiles the CPU kernels, with a
    # counter on stderr, while loading and warming up (not inside the timed request); the
    # second loads them from the cache
    assert DESCRIPTION in greedy_runs.first.stderr
    assert DESCRIPTION not in greedy_runs.second.stderr


def test_greedy_generate_is_deterministic(greedy_runs):
    assert greedy_runs.second.stdout == greedy_runs.first.stdout


def test_demo_is_read_from_the_package(greedy_runs, cache_dir):
    # never generated into the cache, as the random-weight demo (v1) was
    assert not [p.name for p in cache_dir.iterdir() if p.name.startswith("demo-")]


def test_console_script(greedy_runs, cache_dir):
    script = shutil.which("hybridmoe")
    if script is None:
        pytest.skip("the hybridmoe console script is not on PATH")
    result = ok(run_cli(GENERATE, cache_dir, program=[script]))
    assert result.stdout == greedy_runs.first.stdout


def test_seeded_sampling_is_reproducible(greedy_runs, cache_dir):
    args = GENERATE + ["--temperature", "0.8", "--seed", "3"]
    first, second = ok(run_cli(args, cache_dir)), ok(run_cli(args, cache_dir))
    assert generated_text(first).strip()
    assert second.stdout == first.stdout


def test_model_dir_flag(greedy_runs, cache_dir):
    result = ok(run_cli(GENERATE + ["--model", str(require_demo_checkpoint())], cache_dir))
    assert result.stdout == greedy_runs.first.stdout  # the default model is the shipped demo


def test_stop_string_cuts_output(greedy_runs, cache_dir):
    text = generated_text(greedy_runs.first)
    stop = text[len(text) // 2 :][:3]  # occurs in the unstopped output by construction
    result = ok(run_cli(GENERATE + [f"--stop={stop}"], cache_dir))
    assert generated_text(result) == text[: text.index(stop)]


def test_chat_replies_then_exits(greedy_runs, cache_dir):
    result = ok(run_cli(["chat", "--max-tokens", "8"], cache_dir, stdin="hello\n/exit\n"))
    prompts = result.stdout.split("> ")
    assert prompts[0] == "" and len(prompts) == 3, result.stdout
    assert prompts[1].strip(), "chat printed no reply"
    assert "prompt tokens" in result.stderr


def test_missing_model_dir_is_a_usage_error(tmp_path, cache_dir):
    missing = tmp_path / "no-such-model"
    result = run_cli(GENERATE + ["--model", str(missing)], cache_dir)
    assert result.returncode == 2
    assert str(missing) in result.stderr
    assert "Traceback" not in result.stderr


def test_invalid_top_p_is_a_usage_error(cache_dir):
    result = run_cli(GENERATE + ["--top-p", "2"], cache_dir)
    assert result.returncode == 2
    assert "top_p" in result.stderr
    assert "Traceback" not in result.stderr


def test_expert_format_flag_quantises_the_experts(greedy_runs, cache_dir):
    args = GENERATE + ["--decode-target", "cpu", "--expert-format", "q4_0", "--cpu-threads", "1"]
    result = ok(run_cli(args, cache_dir))
    assert generated_text(result).strip()
    assert "experts -> q4_0" in result.stderr  # the conversion's progress bar


def test_bad_cpu_threads_is_a_usage_error(cache_dir):
    result = run_cli(GENERATE + ["--decode-target", "cpu", "--cpu-threads", "0"], cache_dir)
    assert result.returncode == 2
    assert "cpu_threads" in result.stderr
    assert "Traceback" not in result.stderr


def test_huge_pages_flag_reaches_the_loader(cache_dir):
    """`--huge-pages` on the demo model (a Hugging Face checkpoint): the loader's refusal,
    in one line (its GGUF loads: tests/loader/test_huge_pages.py)."""
    result = run_cli(GENERATE + ["--huge-pages"], cache_dir)
    assert result.returncode != 0
    assert "--huge-pages applies to GGUF files" in result.stderr
    assert "Traceback" not in result.stderr
