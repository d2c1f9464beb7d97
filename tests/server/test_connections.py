"""Connections that never finish their request (idle, half-sent headers, half-sent body) are
closed by the server after --read-timeout-s, and normal requests go on meanwhile."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

from live_server import LiveServer, start_server, stop_server

READ_TIMEOUT_S = 1.0
HANG_GUARD_S = 60  # a connection still open after this was never going to be closed
HALF_SENT = {
    "idle": b"",
    "half headers": b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le",
    "half body": (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model": '
    ),
    "unfinished chunks": (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"mod\r\n'
    ),
}


@pytest.fixture(scope="module")
def server(demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log_dir = tmp_path_factory.mktemp("server-log")
    live = start_server(demo_checkpoint, log_dir, "--read-timeout-s", str(READ_TIMEOUT_S))
    yield live
    stop_server(live)


def connect(server: LiveServer, data: bytes) -> socket.socket:
    url = urlparse(server.url)
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(data)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends before it closes the connection."""
    sock.settimeout(HANG_GUARD_S)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


@pytest.mark.parametrize("kind", sorted(HALF_SENT))
def test_an_unfinished_request_is_closed_after_the_read_timeout(server, kind):
    with connect(server, HALF_SENT[kind]) as sock:
        answer = read_until_closed(sock)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer


def test_normal_requests_go_on_while_many_connections_hang(server):
    hanging = [connect(server, HALF_SENT[kind]) for kind in sorted(HALF_SENT) for _ in range(25)]
    try:
        for _ in range(3):
            assert server.get("/health") == (200, {"status": "ok"})
            status, body = server.post(
                "/v1/completions", {"model": server.model_id, "prompt": "hi", "max_tokens": 2}
            )
            assert status == 200, body
    finally:
        for sock in hanging:
            sock.close()
    log = server.log()
    assert "Traceback" not in log, log
