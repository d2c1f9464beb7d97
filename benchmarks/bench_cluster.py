"""`hybridmoe cluster` figures: aggregate decode tokens/s of 2 replicas vs 1 under N concurrent
streaming clients (and of 2 replicas with one CPU thread each, which do not oversubscribe the
cores), and the time to first token of a repeated long-prefix request with prefix-aware routing
(cache_aware) vs round_robin.

    python benchmarks/bench_cluster.py [--model DIR] [--clients 8] [--max-tokens 64]
                                       [--repeats 3] [--prefixes 6] [--prefix-words 140]

Clusters run as subprocesses on free loopback ports (the demo model by default); all of a
figure's clusters are up at once and their rounds interleave, so the machine's load hits both
sides alike. Throughput: a round starts --clients streams of exactly --max-tokens tokens
(`ignore_eos`, distinct short prompts, round_robin) and ends when the last one ends; tokens/s
= all tokens / wall time; medians over --repeats rounds. TTFT: each of --prefixes distinct
system prompts of --prefix-words words is sent twice in a row; the second ("repeated") is
timed to its first streamed token; medians, with the cached tokens the replicas report.
Ratios are to the first cluster of each figure.
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
    def __init__(
        self, model: str | None, replicas: int, policy: str, max_seq_len: int, *extra: str
    ) -> None:
        self.port, self.stats_port = free_port(), free_port()
        argv = [sys.executable, "-m", "hybridmoe", "cluster", "--replicas", str(replicas)]
        argv += ["--policy", policy, "--port", str(self.port), "--stats-port", str(self.stats_port)]
        argv += ["--max-seq-len", str(max_seq_len), *extra] + (["--model", model] if model else [])
        self.log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        self.name = f"{replicas} replica{'s' if replicas > 1 else ''}, {policy} {' '.join(extra)}"

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


def repeated_ttft(cluster: Cluster, index: int, words: int) -> float:
    """TTFT of the second of two identical requests whose long system prompt is new."""
    system = system_prompt(index, words)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Sum up."}]
    cluster.stream(messages, 1)
    return cluster.stream(messages, 1)[0]


def hit_tokens(cluster: Cluster) -> int:
    return cluster.stats()["total"]["prefix_cache"]["hit_tokens"]


def report_throughput(clusters: list[Cluster], args: argparse.Namespace) -> None:
    rates: dict[str, list[float]] = {c.name: [] for c in clusters}
    for _ in range(args.repeats):
        for cluster in clusters:  # interleaved: the machine's load hits every cluster alike
            rates[cluster.name].append(throughput_round(cluster, args.clients, args.max_tokens))
    base = statistics.median(rates[clusters[0].name])
    for name, rounds in rates.items():
        median = statistics.median(rounds)
        print(f"{args.clients} clients, {name}: {median:.1f} tok/s, {median / base:.2f}x the "
              f"first (rounds {', '.join(f'{r:.1f}' for r in rounds)})")  # fmt: skip


def report_ttft(clusters: list[Cluster], args: argparse.Namespace) -> None:
    times: dict[str, list[float]] = {c.name: [] for c in clusters}
    before = {c.name: hit_tokens(c) for c in clusters}
    for index in range(args.prefixes):
        for cluster in clusters:  # the same prompts, interleaved
            times[cluster.name].append(repeated_ttft(cluster, index, args.prefix_words))
    base = statistics.median(times[clusters[0].name])
    for cluster in clusters:
        median = statistics.median(times[cluster.name])
        hits = hit_tokens(cluster) - before[cluster.name]
        print(f"repeated long-prefix TTFT, {cluster.name}: median {median * 1e3:.1f} ms, "
              f"{median / base:.2f}x the first; cached tokens {hits}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--prefix-words", type=int, default=140)
    args = parser.parse_args()
    throughput = [
        Cluster(args.model, 1, "round_robin", 512),
        Cluster(args.model, 2, "round_robin", 512),
        Cluster(args.model, 2, "round_robin", 512, "--cpu-threads", "1"),
    ]
    ttft = [Cluster(args.model, 2, p, 512) for p in ("cache_aware", "round_robin")]
    try:
        for cluster in throughput + ttft:
            cluster.wait_ready()
        print(f"load average at start: {open('/proc/loadavg').read().strip()}")
        report_throughput(throughput, args)
        report_ttft(ttft, args)
        print(f"load average at end: {open('/proc/loadavg').read().strip()}")
    finally:
        for cluster in throughput + ttft:
            cluster.stop()


if __name__ == "__main__":
    main()
