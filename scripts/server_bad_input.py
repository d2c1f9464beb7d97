"""The bad-input table: fires bad and odd requests at a live `hybridmoe serve` and tabulates,
per group, how many were tried and how many got a clear 4xx (OpenAI's error shape), a 2xx, a
5xx, or no HTTP answer at all. A 5xx or a missing answer is a defect.

Run: python scripts/server_bad_input.py [--url http://127.0.0.1:8000] [--verbose]
     (without --url it starts `hybridmoe serve` on the demo model on a free port and stops it)
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from urllib.parse import urlparse

SURROGATE = "\ud800"
BIG = 20_000_000
DEEP_SURROGATE = json.loads("[" * 900 + json.dumps(SURROGATE) + "]" * 900)


def completion(**fields) -> dict:
    return {"model": "{model}", "prompt": "def f(x):", "max_tokens": 2, "temperature": 0} | fields


def chat(**fields) -> dict:
    messages = [{"role": "user", "content": "hi"}]
    return {"model": "{model}", "messages": messages, "max_tokens": 2} | fields


CASES: dict[str, list[tuple[str, str, object]]] = {  # group -> (method, path, body)
    "invalid JSON / not an object": [
        ("POST", "/v1/completions", b'{"model": '),
        ("POST", "/v1/completions", b"[1, 2]"),
        ("POST", "/v1/completions", b"null"),
        ("POST", "/v1/completions", b"\xff\xfe garbage"),
        ("POST", "/v1/chat/completions", b""),
        ("POST", "/v1/chat/completions", b'"just a string"'),
        ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000),  # deeper than json allows
    ],
    "wrong types": [
        ("POST", "/v1/completions", completion(max_tokens="ten")),
        ("POST", "/v1/completions", completion(prompt=42)),
        ("POST", "/v1/completions", completion(prompt=[1, "a"])),
        ("POST", "/v1/completions", completion(stream="yes")),
        ("POST", "/v1/completions", completion(stop=[""])),
        ("POST", "/v1/completions", completion(stop=5)),
        ("POST", "/v1/completions", completion(seed=-3)),
        ("POST", "/v1/completions", completion(seed=2**70)),
        ("POST", "/v1/completions", completion(model=5)),
        ("POST", "/v1/chat/completions", chat(messages=[])),
        ("POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}])),
        ("POST", "/v1/chat/completions", chat(messages=[{"content": "no role"}])),
        ("POST", "/v1/chat/completions", chat(messages="hi")),
        ("POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [1]}])),
    ],
    "out-of-range sampling": [
        ("POST", "/v1/completions", completion(temperature=float("inf"))),
        ("POST", "/v1/completions", completion(temperature=float("-inf"))),
        ("POST", "/v1/completions", completion(temperature=float("nan"))),
        ("POST", "/v1/completions", completion(temperature=-1)),
        ("POST", "/v1/completions", completion(temperature=1e300)),
        ("POST", "/v1/completions", completion(top_p=0)),
        ("POST", "/v1/completions", completion(top_p=1.5)),
        ("POST", "/v1/completions", completion(top_p=float("nan"))),
        ("POST", "/v1/completions", completion(top_k=-1)),
        ("POST", "/v1/completions", completion(max_tokens=0)),
        ("POST", "/v1/completions", completion(max_tokens=-5)),
        ("POST", "/v1/completions", completion(max_tokens=10**30)),
        ("POST", "/v1/completions", completion(n=2)),
        ("POST", "/v1/completions", completion(presence_penalty=float("nan"))),
        ("POST", "/v1/completions", completion(stream=True, temperature=float("inf"))),
        ("POST", "/v1/chat/completions", chat(stream=True, top_p=-1)),
    ],
    "odd but valid sampling (2xx expected)": [
        ("POST", "/v1/completions", completion(temperature=1e-300)),
        ("POST", "/v1/completions", completion(temperature=2.0, seed=1)),
        ("POST", "/v1/completions", completion(top_k=10**9, temperature=1.0)),
        ("POST", "/v1/completions", completion(top_p=1e-9, temperature=1.0)),
    ],
    "unicode": [
        ("POST", "/v1/completions", completion(prompt=f"hi {SURROGATE}")),
        ("POST", "/v1/completions", completion(stop=[SURROGATE])),
        ("POST", "/v1/completions", completion(model=f"m{SURROGATE}")),
        ("POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": SURROGATE}])),
        ("POST", "/v1/chat/completions", chat(messages=[{"role": SURROGATE, "content": "hi"}])),
        ("POST", "/v1/chat/completions", chat(user={SURROGATE: 1})),
        ("POST", "/v1/chat/completions", chat(user=DEEP_SURROGATE)),
    ],
    "stream_options / unsupported fields": [
        ("POST", "/v1/completions", completion(stream=True, stream_options="x")),
        ("POST", "/v1/completions", completion(stream=True, stream_options=5)),
        ("POST", "/v1/completions", completion(stream=True, stream_options={"include_usage": 1})),
        ("POST", "/v1/completions", completion(echo=True)),
        ("POST", "/v1/completions", completion(best_of=3)),
        ("POST", "/v1/completions", completion(logit_bias={"1": 5})),
        ("POST", "/v1/chat/completions", chat(n=3)),
    ],
    "context and vocabulary": [
        ("POST", "/v1/completions", completion(max_tokens=10**6)),
        ("POST", "/v1/completions", completion(prompt="tok " * 100_000)),
        ("POST", "/v1/completions", completion(prompt=[1, 2, 10**9])),
        ("POST", "/v1/completions", completion(prompt=[-1])),
        ("POST", "/v1/completions", completion(prompt=[])),
        ("POST", "/v1/completions", completion(prompt="")),
    ],
    "size": [
        ("POST", "/v1/completions", completion(prompt="x" * BIG)),
        ("POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "x" * BIG}])),
    ],
    "routes, models, methods": [
        ("GET", "/v1/engines", None),
        ("GET", "/v1/models/no-such-model", None),
        ("DELETE", "/v1/models", None),
        ("GET", "/v1/completions", None),
        ("POST", "/v1/completions", completion(model="no-such-model")),
        ("POST", "/health", None),
    ],
}


def send(url: str, method: str, path: str, body: object, host: str | None = None):
    """(status or None, parsed JSON or the error text)."""
    parsed = urlparse(url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=300)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Host": host} if host else {})
    try:
        connection.request(method, path, data, headers)
        response = connection.getresponse()
        raw = response.read()
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, raw[:200]
    except OSError as error:
        return None, repr(error)
    finally:
        connection.close()


def clear_error(answer: object) -> bool:
    error = answer.get("error") if isinstance(answer, dict) else None
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


def outcome(status: int | None, answer: object) -> str:
    if status is None:
        return "no answer"
    if status >= 500:
        return "5xx"
    if status >= 400:
        return "clear 4xx" if clear_error(answer) else "unclear 4xx"
    return "2xx"


HALF_SENT = (
    b"",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 9\r\n\r\n{",
)


def raw_connection_cases(url: str) -> list[str]:
    """Half-sent requests: each must be closed by the server (408 or EOF) within 5 minutes."""
    parsed = urlparse(url)
    outcomes = []
    for data in HALF_SENT:
        with socket.create_connection((parsed.hostname, parsed.port)) as sock:
            sock.sendall(data)
            sock.settimeout(300)
            try:
                received = b"".join(iter(lambda: sock.recv(65536), b""))
                outcomes.append("clear 4xx" if b" 408 " in received[:20] else "closed")
            except TimeoutError:
                outcomes.append("no answer")
    return outcomes


def run(url: str, verbose: bool) -> int:
    model = json.loads(urllib.request.urlopen(f"{url}/v1/models").read())["data"][0]["id"]
    table: dict[str, Counter] = {}
    for group, cases in CASES.items():
        counts = table.setdefault(group, Counter())
        for method, path, body in cases:
            if isinstance(body, dict):
                body = json.loads(json.dumps(body).replace('"{model}"', json.dumps(model)))
            status, answer = send(url, method, path, body)
            counts["tried"] += 1
            counts[outcome(status, answer)] += 1
            if verbose:
                print(f"{status} {method} {path} {str(body)[:70]!r} -> {str(answer)[:120]}")
    hosts = table.setdefault("foreign Host header", Counter())
    for host in ("evil.example", "evil.example:80", "127.0.0.2"):
        hosts["tried"] += 1
        hosts[outcome(*send(url, "GET", "/v1/models", None, host=host))] += 1
    half = table.setdefault("half-sent connections (408/closed)", Counter())
    for result in raw_connection_cases(url):
        half["tried"] += 1
        half[result] += 1
    return print_table(table)


def print_table(table: dict[str, Counter]) -> int:
    columns = ["tried", "clear 4xx", "2xx", "closed", "unclear 4xx", "5xx", "no answer"]
    total = sum(table.values(), Counter())
    print(f"| group | {' | '.join(columns)} |")
    print(f"|---|{'---|' * len(columns)}")
    for group, counts in [*table.items(), ("**total**", total)]:
        print(f"| {group} | {' | '.join(str(counts[c]) for c in columns)} |")
    return 1 if total["5xx"] or total["no answer"] or total["unclear 4xx"] else 0


def serve_demo() -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "hybridmoe", "serve", "--port", str(port)]
    command += ["--max-seq-len", "256", "--read-timeout-s", "2"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(900):
        try:
            if urllib.request.urlopen(f"{url}/health").status == 200:
                return process, url
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("the server did not become healthy")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start the demo model)")
    parser.add_argument("--verbose", action="store_true", help="print every request's answer")
    args = parser.parse_args()
    if args.url:
        return run(args.url.rstrip("/"), args.verbose)
    process, url = serve_demo()
    try:
        return run(url, args.verbose)
    finally:
        process.terminate()
        process.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
