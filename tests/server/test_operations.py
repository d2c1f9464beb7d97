"""Operating a server: API keys, the waiting-queue cap, request timeouts, /metrics, the prompt
tokenised off the event loop, and /health saying "loading" until the kernels are warm."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from hybridmoe.engine import Engine, EngineConfig
from hybridmoe.loader.tokenizer import Tokenizer
from hybridmoe.server.app import create_app, mark_ready
from hybridmoe.server.config import ServerConfig
from live_server import TEST_MAX_SEQ_LEN, LiveServer, start_server, stop_server
from server import inprocess

HANG_GUARD_S = 60  # only so a wedged server fails the test instead of hanging it
PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def engine(demo_checkpoint: Path) -> Iterator[Engine]:
    config = EngineConfig(max_seq_len=TEST_MAX_SEQ_LEN, max_batch=2)
    with Engine.from_pretrained(demo_checkpoint, config) as engine:
        yield engine


@pytest.fixture
def engine_without_scheduler(demo_checkpoint: Path) -> Iterator[Engine]:
    """A fresh engine (its scheduler not started: a test may leave it so)."""
    with Engine.from_pretrained(demo_checkpoint, EngineConfig(max_seq_len=64)) as engine:
        yield engine


def test_the_prompt_is_tokenised_off_the_event_loop(engine, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    released_in_time: list[bool] = []
    encode = engine.encode

    def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if text == PROMPT:  # held until /health has answered (on the loop: it cannot)
            entered.set()
            released_in_time.append(release.wait(HANG_GUARD_S))
        return encode(text, add_special_tokens)

    monkeypatch.setattr(engine, "encode", slow_encode)
    answers: list[str] = []
    with inprocess.serving(create_app(engine, "m")) as url:
        client = inprocess.client(url)

        def complete() -> None:
            answers.append(client.completions.create(model="m", prompt=PROMPT).choices[0].text)

        big = threading.Thread(target=complete)
        big.start()
        try:
            assert entered.wait(HANG_GUARD_S)
            with urllib.request.urlopen(f"{url}/health", timeout=HANG_GUARD_S) as health:
                assert health.status == 200
            assert not answers
        finally:
            release.set()
            big.join()
    assert len(answers) == 1
    assert released_in_time == [True]  # /health answered while the prompt was being tokenised


def test_the_warm_up_request_is_not_counted(engine_without_scheduler):
    with inprocess.serving(create_app(engine_without_scheduler, "m")) as url:  # warms up
        with urllib.request.urlopen(f"{url}/v1/stats", timeout=HANG_GUARD_S) as response:
            stats = json.loads(response.read())
        with urllib.request.urlopen(f"{url}/metrics", timeout=HANG_GUARD_S) as response:
            metrics = response.read().decode()
    assert (stats["requests_served"], stats["prompt_tokens"], stats["decode_steps"]) == (0, 0, 0)
    assert 'vllm:prompt_tokens_total{model_name="m"} 0.0' in metrics.splitlines()


def test_health_says_loading_until_ready(engine_without_scheduler):
    app = create_app(engine_without_scheduler, "m", start_scheduler=False)
    with inprocess.serving(app) as url:
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"{url}/health", timeout=HANG_GUARD_S)
        assert caught.value.code == 503 and b'"loading"' in caught.value.read()
        with pytest.raises(openai.InternalServerError) as refused:
            inprocess.client(url).completions.create(model="m", prompt="hi", max_tokens=1)
        assert refused.value.status_code == 503 and "loading" in refused.value.message
        assert refused.value.response.headers["retry-after"]


def waiting(engine: Engine, count: int) -> None:
    for _ in range(int(HANG_GUARD_S / 0.01)):
        if len(engine.scheduler.waiting) >= count:
            return
        threading.Event().wait(0.01)
    pytest.fail(f"{count} requests never queued")


def test_a_full_queue_is_a_503_with_retry_after(engine_without_scheduler):
    engine = engine_without_scheduler
    app = create_app(engine, "m", start_scheduler=False, config=ServerConfig(max_queue=2))
    mark_ready(app)
    with inprocess.serving(app) as url:
        client = inprocess.client(url)
        errors: list[Exception] = []

        def queued() -> None:
            try:
                client.completions.create(model="m", prompt="hi", max_tokens=2)
            except openai.APIError as error:  # the scheduler closes when the server stops
                errors.append(error)

        holders = [threading.Thread(target=queued) for _ in range(2)]
        for thread in holders:
            thread.start()
        waiting(engine, 2)
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model="m", prompt="hi", max_tokens=2)
        assert refused.value.status_code == 503 and "--max-queue" in refused.value.message
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert len(engine.scheduler.waiting) == 2
        engine.scheduler.close()  # as serve() drains: the queued requests end with a 503
    for thread in holders:
        thread.join()
    assert len(errors) == 2 and all("shutting down" in e.message for e in errors)


def test_a_request_past_its_timeout_is_cancelled(engine_without_scheduler):
    engine = engine_without_scheduler
    app = create_app(engine, "m", start_scheduler=False, config=ServerConfig(request_timeout_s=0.5))
    mark_ready(app)
    with inprocess.serving(app) as url:
        client = inprocess.client(url)
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model="m", prompt="hi", max_tokens=2)
        assert caught.value.status_code == 504 and caught.value.code == "request_timeout"
        assert "--request-timeout-s" in caught.value.message
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
        with pytest.raises(openai.APIError) as ended:
            list(stream)
        assert "--request-timeout-s" in ended.value.message
        assert len(engine.scheduler.waiting) == 2
        assert all(request.cancelled for request in engine.scheduler.waiting)
        engine.scheduler.close()


@pytest.fixture(scope="module")
def keyed_server(demo_checkpoint, tmp_path_factory) -> Iterator[LiveServer]:
    log_dir = tmp_path_factory.mktemp("keyed-log")
    key_file = log_dir / "api-key"
    key_file.write_text("s3cret\n")  # from a file: the key stays out of the process list
    live = start_server(
        demo_checkpoint, log_dir, "--api-key-file", str(key_file), "--max-seq-len", "64"
    )
    yield live
    stop_server(live)


def test_an_api_key_is_required_on_v1_but_not_on_health(keyed_server):
    client = keyed_server.client()  # api_key="x"
    with pytest.raises(openai.AuthenticationError) as caught:
        client.models.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    assert caught.value.body["message"] and "param" in caught.value.body
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=keyed_server.model_id, prompt="hi", max_tokens=1)
    assert keyed_server.get("/health") == (200, {"status": "ok"})
    keyed = client.with_options(api_key="s3cret")
    assert [m.id for m in keyed.models.list().data] == [keyed_server.model_id]
    reply = keyed.completions.create(model=keyed_server.model_id, prompt="hi", max_tokens=2)
    assert reply.usage.completion_tokens == 2


def scrape(server: LiveServer) -> dict[str, float]:
    """Sample name{labels} -> value of /metrics, comments left out."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=HANG_GUARD_S) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        lines = response.read().decode().splitlines()
    samples = (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def metric(samples: dict[str, float], name: str) -> float:
    (value,) = [v for key, v in samples.items() if key.split("{")[0] == name]
    return value


def test_metrics_count_in_prometheus_format_with_vllm_names(keyed_server):
    client = keyed_server.client().with_options(api_key="s3cret")
    before = scrape(keyed_server)  # open without the key, as /health
    client.completions.create(
        model=keyed_server.model_id, prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True}
    )
    after = scrape(keyed_server)
    prompt_tokens = len(Tokenizer.from_dir(keyed_server_dir(keyed_server)).encode(PROMPT))
    for name, grown in [
        ("vllm:prompt_tokens_total", prompt_tokens),
        ("vllm:generation_tokens_total", 5),
        ("vllm:time_to_first_token_seconds_count", 1),
        ("vllm:e2e_request_latency_seconds_count", 1),
    ]:
        assert metric(after, name) - metric(before, name) == grown, name
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:num_requests_waiting") == 0
    assert metric(after, "vllm:e2e_request_latency_seconds_sum") > 0


def keyed_server_dir(server: LiveServer) -> Path:
    return Path(server.process.args[server.process.args.index("--model") + 1])
