"""Fixtures: one live server per test module (see tests/live_server.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from live_server import TEST_MAX_SEQ_LEN, LiveServer, start_server, stop_server


@pytest.fixture(scope="module")
def server(demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log_dir = tmp_path_factory.mktemp("server-log")
    live = start_server(demo_checkpoint, log_dir, "--max-seq-len", str(TEST_MAX_SEQ_LEN))
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()
