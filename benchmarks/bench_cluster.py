"""`hybridmoe cluster` figures: aggregate decode tokens/s of 2 replicas vs 1 under N concurrent
streaming clients, and the time to first token of a repeated long-prefix request with
prefix-aware routing (cache_aware) vs round_robin.

    python benchmarks/bench_cluster.py [--model DIR] [--clients 8] [--max-tokens 64]
                                       [--repeats 3] [--prefixes 6] [--prefix-words 140]

Clusters run as subprocesses on free loopback ports (the demo model by default); all of a
figure's clusters are up at once and their rounds interleave, so the machine's load hits both
sides alike. Throughput: a round starts --clients streams of exactly --max-tokens tokens
(`ignore_eos`, distinct short prompts, round_robin) and ends when the last one ends; tokens/s
= all tokens / wall time; medians over --repeats rounds. TTFT: each of --prefixes distinct
system prompts of --prefix-words words is sent twice in a row; the second ("repeated") is
timed to its first streamed token; medians, with the cached tokens the replicas report.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import openai

STARTUP_TIMEOUT_S = 300
WORDS = "river stone lantern orchard copper meadow harbor violet candle thunder".split()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    def __init__(self, model: str | None, replicas: int, policy: str, max_seq_len: int) -> None:
        self.port, self.stats_port = free_port(), free_port()
        argv = [sys.executable, "-m", "hybridmoe", "cluster", "--replicas", str(replicas)]
        argv += ["--policy", policy, "--port", str(self.port), "--stats-port", str(self.stats_port)]
        argv += ["--max-seq-len", str(max_seq_len)] + (["--model", model] if model else [])
        self.log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        self.name = f"{replicas} replica{'s' if replicas > 1 else ''}, {policy}"

    def stats(self) -> dict:
        url = f"http://127.0.0.1:{self.stats_port}/v1/stats"
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                sys.exit(f"{self.name}: exited; see {self.log.name}")
            try:
                if self.stats()["ready"]:
                    self.model_id = self.stats()["replicas"][0]["stats"]["model"]
                    return
            except OSError:
                pass
            time.sleep(0.5)
        sys.exit(f"{self.name}: not ready in {STARTUP_TIMEOUT_S} s; see {self.log.name}")

    def client(self) -> openai.OpenAI:
        url = f"http://127.0.0.1:{self.port}/v1"
        return openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)

    def stream(self, messages: list[dict], max_tokens: int) -> tuple[float, int]:
        """(seconds to the first content token, tokens streamed)."""
        start, first, tokens = time.perf_counter(), None, 0
        stream = self.client().chat.completions.create(
            model=self.model_id, messages=messages, max_tokens=max_tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - start
                tokens += 1  # one token per content chunk (the server streams token by token)
        return first, tokens

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
        os.unlink(self.log.name)


def throughput_round(cluster: Cluster, clients: int, max_tokens: int) -> float:
    counts: list[int] = []
    questions = [
        [{"role": "user", "content": f"{WORDS[i % 10]} story {i}"}] for i in range(clients)
    ]
    threads = [
        threading.Thread(target=lambda m=m: counts.append(cluster.stream(m, max_tokens)[1]))
        for m in questions
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - start)


def system_prompt(index: int, words: int) -> str:
    return f"Document {index}: " + " ".join(WORDS[(index * 7 + i * 3) % 10] for i in range(words))


def ttft_pairs(cluster: Cluster, prefixes: int, words: int, tag: int) -> list[float]:
    """TTFT of the second of two identical requests, per prefix (each unseen before)."""
    repeated = []
    for i in range(prefixes):
        system = system_prompt(tag * 1000 + i, words)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Sum up."}]
        cluster.stream(messages, 1)
        repeated.append(cluster.stream(messages, 1)[0])
    return repeated


def hit_tokens(cluster: Cluster) -> int:
    return cluster.stats()["total"]["prefix_cache"]["hit_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--prefix-words", type=int, default=140)
    args = parser.parse_args()
    one, two = (
        Cluster(args.model, 1, "round_robin", 512),
        Cluster(args.model, 2, "round_robin", 512),
    )
    aware, rr = (
        Cluster(args.model, 2, "cache_aware", 512),
        Cluster(args.model, 2, "round_robin", 512),
    )
    clusters = [one, two, aware, rr]
    try:
        for cluster in clusters:
            cluster.wait_ready()
        print(f"load average at start: {open('/proc/loadavg').read().strip()}")
        rates: dict[str, list[float]] = {one.name: [], two.name: []}
        for _ in range(args.repeats):
            for cluster in (one, two):
                rates[cluster.name].append(throughput_round(cluster, args.clients, args.max_tokens))
        medians = {name: statistics.median(r) for name, r in rates.items()}
        for name, median in medians.items():
            print(f"{args.clients} clients, {name}: {median:.1f} tok/s (rounds {rates[name]})")
        print(f"ratio 2 replicas / 1: {medians[two.name] / medians[one.name]:.2f}")
        ttft: dict[str, list[float]] = {aware.name: [], rr.name: []}
        hits = {}
        for tag, cluster in enumerate((aware, rr)):
            before = hit_tokens(cluster)
            ttft[cluster.name] = ttft_pairs(cluster, args.prefixes, args.prefix_words, tag)
            hits[cluster.name] = hit_tokens(cluster) - before
        for name, times in ttft.items():
            print(f"repeated long-prefix TTFT, {name}: median {statistics.median(times) * 1e3:.1f} "
                  f"ms (min {min(times) * 1e3:.1f}); cached tokens {hits[name]}")  # fmt: skip
        ratio = statistics.median(ttft[rr.name]) / statistics.median(ttft[aware.name])
        print(f"ratio round_robin / cache_aware: {ratio:.2f}")
        print(f"load average at end: {open('/proc/loadavg').read().strip()}")
    finally:
        for cluster in clusters:
            cluster.stop()


if __name__ == "__main__":
    main()
