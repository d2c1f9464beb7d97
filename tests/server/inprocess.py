"""An app of create_app served by uvicorn on a thread of the test process, configured as
`hybridmoe serve` configures it (run.uvicorn_config): for tests that hold the scheduler still
or reach into the engine while real HTTP clients talk to it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import uvicorn
from fastapi import FastAPI

from hybridmoe.server.config import ServerConfig
from hybridmoe.server.run import uvicorn_config
from live_server import REQUEST_TIMEOUT_S, free_port

STARTUP_TIMEOUT_S = 120  # only so a server that never starts fails instead of hanging


@contextmanager
def serving(app: FastAPI, config: ServerConfig | None = None) -> Iterator[str]:
    """The base URL (http://127.0.0.1:PORT) of `app` served until the block ends."""
    config = config or ServerConfig()
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, config, host="127.0.0.1", port=port))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def client(url: str, api_key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S
    )
