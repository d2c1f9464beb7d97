"""The benchmark tests' shared run: a tiny worker run's arguments, parsed by the bench worker's
own parser (benchmarks/llamacpp_workers.py), so they hold every field its `measure` reads."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from llamacpp_workers import parse_worker_args  # noqa: E402

TINY = ["--tokens", "6", "--prompt-tokens", "5", "--prefill-tokens", "12", "--batch", "2"]


@pytest.fixture
def worker_run() -> Namespace:
    """6 tokens after a 5-token prompt, batches of 2, a 12-token prefill, float activations,
    SDPA (the worker's defaults); `engine`, `gguf` and `threads` are measure()'s own arguments."""
    return parse_worker_args(["hybridmoe", "unused.gguf", "--threads", "1", *TINY])
