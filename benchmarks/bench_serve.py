"""Aggregate decode tokens/s of `hybridmoe serve` at 1, 4 and 8 concurrent streaming clients,
as ratios to 1 client: what continuous batching buys when clients share decode steps.

    python benchmarks/bench_serve.py [--model DIR] [--clients 1,4,8] [--max-tokens 128]
                                     [--repeats 3] [--server-arg=--decode-target=hybrid ...]

The server runs as a subprocess on a free loopback port (the demo model by default). Each
client streams one completion of exactly --max-tokens tokens (`ignore_eos`); a round starts
all clients at once and ends when the last finishes. Client tokens/s = all tokens / round
wall time (prompts are a few tokens, so prefill is a sliver of it); the server's own decode
tokens/s over the round and its mean decode batch come from /v1/stats. Rounds of each client
count are interleaved (--repeats), medians reported. Target: 8 clients >= 3x 1 client.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np", "Once upon"]
STARTUP_TIMEOUT_S = 180
TARGET_RATIO = 3.0


@dataclass(frozen=True)
class Round:
    clients: int
    client_tok_s: float
    server_tok_s: float
    mean_batch: float


class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        self.port = _free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-serve-", suffix=".log")
        command = [sys.executable, "-m", "hybridmoe", "serve", "--port", str(self.port)]
        command += ["--model", args.model] if args.model else []
        command += args.server_arg
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self.model = self._wait_until_up()

    def _wait_until_up(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                sys.exit(f"server exited:\n{Path(self.log.name).read_text()}")
            try:
                if self.get("/health").get("status") == "ok":  # "loading" while warming up
                    return self.get("/v1/models")["data"][0]["id"]
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        sys.exit(f"server not up after {STARTUP_TIMEOUT_S} s")

    def get(self, path: str) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())

    def stream(self, prompt: str, max_tokens: int) -> int:
        """Streams one completion; returns its completion tokens (from the usage chunk)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        last = b""
        for line in conn.getresponse():
            if line.startswith(b"data: {"):
                last = line  # only the final (usage) event is parsed: keep the client light
        return json.loads(last[len(b"data: ") :])["usage"]["completion_tokens"]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_round(server: Server, clients: int, max_tokens: int) -> Round:
    tokens = [0] * clients
    barrier = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        barrier.wait()
        tokens[i] = server.stream(PROMPTS[i % len(PROMPTS)], max_tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    before = server.get("/v1/stats")
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - start
    after = server.get("/v1/stats")
    return Round(clients, sum(tokens) / wall_s, *_server_side(before, after))


def _server_side(before: dict, after: dict) -> tuple[float, float]:
    """(decode tokens/s, mean decode batch) of the server between two /v1/stats snapshots."""
    tokens = after["decode_tokens"] - before["decode_tokens"]
    seconds = after["decode_s"] - before["decode_s"]
    steps = after["decode_steps"] - before["decode_steps"]
    return (tokens / seconds if seconds else 0.0), (tokens / steps if steps else 0.0)


def main() -> None:
    args = parse_args()
    server = Server(args)
    try:
        run_round(server, max(args.clients), 16)  # warm-up: first-call costs out of the way
        rounds = [
            run_round(server, n, args.max_tokens) for _ in range(args.repeats) for n in args.clients
        ]
    finally:
        server.stop()
    report(args, rounds)


def report(args: argparse.Namespace, rounds: list[Round]) -> None:
    def median(n: int, field: str) -> float:
        return statistics.median(getattr(r, field) for r in rounds if r.clients == n)

    base = median(args.clients[0], "client_tok_s")
    print(f"model: {args.model or 'demo'} | max_tokens {args.max_tokens} | repeats {args.repeats}")
    head = f"{'clients':>7} {'tok/s':>9} {'x vs ' + str(args.clients[0]):>8}"
    print(f"{head} {'server decode tok/s':>20} {'mean batch':>11}")
    for n in args.clients:
        tok_s, server_tok_s = median(n, "client_tok_s"), median(n, "server_tok_s")
        row = f"{n:>7} {tok_s:>9.1f} {tok_s / base:>8.2f}"
        print(f"{row} {server_tok_s:>20.1f} {median(n, 'mean_batch'):>11.2f}")
    ratio = median(args.clients[-1], "client_tok_s") / base
    verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
    print(f"target {args.clients[-1]} clients >= {TARGET_RATIO:.0f}x: {verdict} ({ratio:.2f}x)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: demo)")
    parser.add_argument("--clients", default="1,4,8", type=lambda s: [int(n) for n in s.split(",")])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--server-arg", action="append", default=[], help="passed to serve")
    return parser.parse_args()


if __name__ == "__main__":
    main()
