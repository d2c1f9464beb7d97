"""`hybridmoe cluster` end to end, on loopback: two replicas of the demo model behind
sglang-router, driven with the official `openai` client. Every request is answered as one
server (a replica asked directly) and the engine alone answer it; requests sharing a long
system prompt land on one replica (its prefix cache counts their shared tokens, the other's
nothing); a replica killed mid-load fails its requests in flight cleanly while new ones are
served, and the supervisor brings it back; one that cannot start stops the cluster."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.config import PREFIX_BLOCK_TOKENS as BLOCK
from live_cluster import STARTUP_TIMEOUT_S, LiveCluster, child_pids, start_cluster, stop_cluster
from live_server import REQUEST_TIMEOUT_S, TEST_MAX_SEQ_LEN, free_port

pytest.importorskip(
    "sglang_router", reason="the optional extra hybridmoe[cluster] (sglang-router) is missing"
)

SYSTEMS = (
    "You are a careful librarian. Answer in one short sentence, then stop. " * 4,
    "Zebras graze quietly while the old lighthouse keeper counts passing ships. " * 4,
    "A tired chef writes recipes for soups, breads and slow roasted vegetables. " * 4,
)
EXACT = {"ignore_eos": True}
MAX_TOKENS = 8
LONG_TOKENS = 96  # a stream still running when its replica is killed


@pytest.fixture(scope="module")
def cluster(demo_checkpoint, tmp_path_factory):
    live = start_cluster(demo_checkpoint, tmp_path_factory.mktemp("cluster-log"))
    leaked: list[int] = []
    try:
        yield live
    finally:
        leaked = stop_cluster(live, child_pids(live.process.pid))
    assert not leaked, f"processes outlived `hybridmoe cluster`: {leaked}"


@pytest.fixture(scope="module")
def engine(demo_checkpoint) -> Engine:
    """The reference: the same checkpoint alone, in-process, without a prefix cache."""
    config = EngineConfig(dtype="float32", max_seq_len=TEST_MAX_SEQ_LEN, prefix_cache_tokens=0)
    with Engine.from_pretrained(demo_checkpoint, config) as engine:
        yield engine


def reference(engine: Engine, messages: list[dict], max_tokens: int = MAX_TOKENS) -> str:
    text = engine.tokenizer.apply_chat_template(messages)
    ids = engine.encode(text, add_special_tokens=False)
    (completion,) = engine.generate_ids([ids], SamplingParams(max_tokens, ignore_eos=True))
    return engine.tokenizer.decode(completion)


def chat(cluster: LiveCluster, messages: list[dict], **kwargs):
    kwargs = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": EXACT} | kwargs
    client = cluster.client()
    return client.chat.completions.create(model=cluster.model_id, messages=messages, **kwargs)


def with_system(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def counts(cluster: LiveCluster) -> list[tuple[int, int]]:
    """(requests served, prefix-cache hit tokens) of each replica."""
    rows = cluster.stats()["replicas"]
    return [(r["stats"]["requests_served"], r["stats"]["prefix_cache"]["hit_tokens"]) for r in rows]


def deltas(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]


def test_every_request_is_answered_as_one_server_answers_it(cluster, engine):
    conversations = [[{"role": "user", "content": f"Tell me about item {i}."}] for i in range(8)]
    before = counts(cluster)
    with ThreadPoolExecutor(len(conversations)) as pool:  # 8 concurrent clients
        replies = list(pool.map(lambda m: chat(cluster, m), conversations))
    assert sum(served for served, _ in deltas(before, counts(cluster))) == len(conversations)
    single = one_server(cluster)  # a replica asked directly: one `hybridmoe serve`
    for messages, reply in zip(conversations, replies, strict=True):
        alone = single.chat.completions.create(
            model=cluster.model_id, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body=EXACT,
        )  # fmt: skip
        assert reply.choices[0].message.content == alone.choices[0].message.content
        assert reply.choices[0].message.content == reference(engine, messages)


def one_server(cluster: LiveCluster) -> openai.OpenAI:
    url = cluster.stats()["replicas"][0]["url"]
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def test_requests_sharing_a_system_prompt_land_on_one_replica(cluster):
    for system in SYSTEMS[:2]:
        before = counts(cluster)
        replies = [chat(cluster, with_system(system, f"Question {i}?")) for i in range(4)]
        cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
        assert cached[0] == 0 and min(cached[1:]) >= 4 * BLOCK, cached  # the system prompt
        served, hits = zip(*deltas(before, counts(cluster)), strict=True)
        assert sorted(served) == [0, 4], served  # all four on one replica...
        assert sorted(hits) == [0, sum(cached)], hits  # ...whose prefix cache answered them


def test_a_killed_replica_fails_its_requests_cleanly_and_comes_back(cluster, engine):
    messages = with_system(SYSTEMS[2], "Write a long story.")
    before = counts(cluster)
    chat(cluster, messages)  # the prefix's replica: the victim
    (victim,) = [i for i, (served, _) in enumerate(deltas(before, counts(cluster))) if served]
    old_pid = cluster.stats()["replicas"][victim]["pid"]
    outcomes = stream_while_killing(cluster, messages, victim, old_pid)
    failed = [o for o in outcomes if isinstance(o, Exception)]
    assert failed, "no request was in flight on the killed replica"
    assert all(isinstance(o, openai.APIError) for o in failed), failed  # clean: no hang
    for finished in (o for o in outcomes if isinstance(o, str)):
        assert finished == reference(engine, messages, LONG_TOKENS)
    for i in range(4):  # new requests are served meanwhile, by the replica left
        question = [{"role": "user", "content": f"After the crash, question {i}."}]
        assert chat(cluster, question).choices[0].message.content == reference(engine, question)

    def back(stats: dict) -> bool:
        return stats["ready"] and stats["replicas"][victim]["restarts"] == 1

    replica = cluster.wait_until(back, "the killed replica back")["replicas"][victim]
    assert replica["pid"] != old_pid and replica["state"] == "serving"


def stream_while_killing(cluster, messages, victim: int, pid: int) -> list[str | Exception]:
    """Four streams of `messages` (routed to replica `victim`, whose process is `pid`); once
    one of them has its first token from the victim, SIGKILL. Each outcome: the streamed
    text, or the client's error. The first token, not the replica's stats, marks the moment:
    on a fast machine the four streams ran to the end between two polls of the stats."""
    outcomes: list[str | Exception] = []
    streaming = threading.Event()

    def run() -> None:
        try:
            stream = chat(cluster, messages, max_tokens=LONG_TOKENS, stream=True)
            text = []
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    streaming.set()
                    text.append(chunk.choices[0].delta.content)
            outcomes.append("".join(text))
        except openai.APIError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    assert streaming.wait(REQUEST_TIMEOUT_S), f"the streams never started: {outcomes}"
    os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=REQUEST_TIMEOUT_S)
        assert not thread.is_alive(), "a request in flight on the killed replica hung"
    return outcomes


def test_a_replica_that_cannot_start_stops_the_cluster_with_an_error(demo_checkpoint):
    # Its port is taken: restarting it would loop forever, so the cluster exits, router too.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = free_port()
        command = [sys.executable, "-m", "hybridmoe", "cluster", "--model", str(demo_checkpoint)]
        command += ["--replicas", "1", "--replica-base-port", str(taken.getsockname()[1])]
        command += ["--port", str(port), "--max-seq-len", str(TEST_MAX_SEQ_LEN)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "replica 0 exited with 2 before it was ready" in done.stderr
    with socket.socket() as front:
        front.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # past TIME_WAIT, not a listener
        front.bind(("127.0.0.1", port))
        front.listen()  # the router is gone: nothing listens on its port any more
