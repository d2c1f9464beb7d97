"""A live server under the odd input of issue 19: huge bodies, non-finite sampling values, lone
surrogates, a foreign Host header, a malformed stream_options; and the one-model route."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest

from live_server import TEST_MAX_SEQ_LEN, LiveServer, start_server, stop_server
from server.test_faults import assert_error, completion_body

BODY_LIMIT_BYTES = 1_000_000


@pytest.fixture(scope="module")
def server(demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log_dir = tmp_path_factory.mktemp("server-log")
    args = ("--max-seq-len", str(TEST_MAX_SEQ_LEN), "--max-body-bytes", str(BODY_LIMIT_BYTES))
    live = start_server(demo_checkpoint, log_dir, *args)
    yield live
    stop_server(live)


def raw_request(server: LiveServer, method: str, path: str, body: bytes = b"", **headers):
    """(status, headers, parsed body) over http.client, which sends the Host header we give."""
    url = urlparse(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        connection.putrequest(method, path, skip_host="Host" in headers)
        for name, value in {"Content-Type": "application/json", **headers}.items():
            connection.putheader(name, value)
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read() or b"{}")
    finally:
        connection.close()


def test_a_body_over_the_limit_is_a_413_naming_it(server):
    body = json.dumps(completion_body(server.model_id, prompt="x" * 20_000_000)).encode()
    status, _, answer = raw_request(server, "POST", "/v1/completions", body)
    error = assert_error(status, answer, 413, None)
    assert str(BODY_LIMIT_BYTES) in error["message"] and "--max-body-bytes" in error["message"]
    assert server.get("/health") == (200, {"status": "ok"})


def test_a_prompt_that_cannot_fit_is_refused_by_its_length_in_characters(client, server):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=server.model_id, prompt="ab " * 300_000, max_tokens=1)
    assert (caught.value.param, caught.value.code) == ("prompt", "context_length_exceeded")
    assert "characters" in caught.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_out_of_range_sampling_values_are_a_400_before_any_stream(server, fields, param, stream):
    body = json.dumps(completion_body(server.model_id, stream=stream, **fields)).encode()
    status, _, answer = raw_request(server, "POST", "/v1/completions", body)
    assert param in assert_error(status, answer, 400, param)["message"]


def test_a_tiny_temperature_is_greedy(client, server):
    def text(temperature: float) -> str:
        body = completion_body(server.model_id, max_tokens=12, temperature=temperature)
        return client.completions.create(**body).choices[0].text

    greedy = text(0)
    assert text(1e-300) == greedy and text(1e-6) == greedy


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi \ud800"}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop": ["\udfff"]}, "stop.0"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
         "messages.0.content"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
         "messages.0.content.0.text"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, "messages.0.name"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    payload = json.dumps({"model": server.model_id, "max_tokens": 2} | body).encode()
    status, _, answer = raw_request(server, "POST", path, payload)
    assert "surrogate" in assert_error(status, answer, 400, param)["message"]


def test_a_lone_surrogate_in_the_model_name_is_a_400(server):
    payload = json.dumps({"model": "m\ud800", "prompt": "hi"}).encode()
    status, _, answer = raw_request(server, "POST", "/v1/completions", payload)
    assert_error(status, answer, 400, "model")


@pytest.mark.parametrize("value", ["x", 5, [1]])
def test_a_malformed_stream_options_names_the_field(server, value):
    body = completion_body(server.model_id, stream=True, stream_options=value)
    error = assert_error(*server.post("/v1/completions", body), 400, "stream_options")
    assert "stream_options" in error["message"]


def test_models_retrieve(client, server):
    model = client.models.retrieve(server.model_id)
    assert (model.id, model.object, model.owned_by) == (server.model_id, "model", "hybridmoe")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found" and "no-such-model" in caught.value.message


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "127.0.0.2", "[::2]"])
def test_a_foreign_host_header_is_refused(server, host):
    status, _, answer = raw_request(server, "GET", "/v1/models", Host=host)
    error = assert_error(status, answer, 421, None)
    assert "--allowed-hosts" in error["message"]


@pytest.mark.parametrize("name", ["localhost", "127.0.0.1", "LOCALHOST", "[::1]"])
def test_loopback_host_names_are_accepted(server, name):
    port = urlparse(server.url).port
    for host in (name, f"{name}:{port}"):
        assert raw_request(server, "GET", "/v1/models", Host=host)[0] == 200


def test_allowed_hosts_replace_the_default(demo_checkpoint, tmp_path):
    live = start_server(demo_checkpoint, tmp_path, "--allowed-hosts", "api.example")
    try:
        assert raw_request(live, "GET", "/v1/models", Host="api.example:443")[0] == 200
        assert raw_request(live, "GET", "/v1/models", Host="localhost")[0] == 421
        assert raw_request(live, "GET", "/health", Host="api.example")[0] == 200
    finally:
        stop_server(live)
