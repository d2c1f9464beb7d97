"""A live `hybridmoe serve` subprocess on a free loopback port, started as a user starts it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

STARTUP_TIMEOUT_S = 180  # only so a server that never comes up fails instead of hanging CI
STOP_TIMEOUT_S = 60
REQUEST_TIMEOUT_S = 120
TEST_MAX_SEQ_LEN = 256  # keeps the context-filling requests of the tests short


@dataclass
class LiveServer:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    model_id: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self) -> openai.OpenAI:
        # No retries: a failing request must show up as the failure it is.
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S
        )

    def get(self, path: str) -> tuple[int, Any]:
        return self.request("GET", path)

    def post(self, path: str, body: bytes | dict) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.request("POST", path, data)

    def request(self, method: str, path: str, data: bytes | None = None) -> tuple[int, Any]:
        """(status, parsed JSON body) of a plain HTTP request, error statuses included."""
        headers = {"Content-Type": "application/json"}
        req = urllib.request.Request(self.url + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def stats(self) -> dict[str, Any]:
        status, body = self.get("/v1/stats")
        assert status == 200, body
        return body


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir: Path, log_dir: Path, *extra_args: str) -> LiveServer:
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    command = [sys.executable, "-m", "hybridmoe", "serve", "--model", str(model_dir)]
    command += ["--port", str(port), *extra_args]
    # The log goes to a file, not a pipe nobody reads, which would block the server when full.
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
    server = LiveServer(process, f"http://127.0.0.1:{port}", model_dir.name, log_path)
    _wait_until_healthy(server)
    return server


def _wait_until_healthy(server: LiveServer) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if server.get("/health")[0] == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.2)
    stop_server(server)
    pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{server.log()}")


def stop_server(server: LiveServer) -> int:
    """SIGTERM, then wait; a server that does not stop is killed (and reported by the caller)."""
    if server.process.poll() is None:
        server.process.terminate()
    try:
        return server.process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        return -9
