"""A live server under bad input, vanishing clients and shutdown: errors in OpenAI's shape with
the right status, slots freed at once, and the server still answering afterwards."""

from __future__ import annotations

import json
import signal
import socket
import time
from urllib.parse import urlparse

import openai
import pytest

from live_server import STOP_TIMEOUT_S, TEST_MAX_SEQ_LEN, LiveServer, start_server

POLL_TIMEOUT_S = 60  # only so a slot that is never freed fails the test instead of hanging


def assert_error(status: int, body: dict, expected_status: int, param: str | None) -> dict:
    assert status == expected_status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["message"]
    return error


def completion_body(model: str, **fields) -> dict:
    return {"model": model, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0} | fields


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"stream": "yes"}, "stream"),
        ({"prompt": 42}, "prompt"),
        ({"stop": [""]}, "stop"),
        ({"seed": -3}, "seed"),
        ({"n": 2}, "n"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"echo": True}, "echo"),
    ],
)
def test_invalid_field_is_a_400_naming_it(server, fields, param):
    status, body = server.post("/v1/completions", completion_body(server.model_id, **fields))
    error = assert_error(status, body, 400, param)
    assert param in error["message"]
    assert error["type"] == "invalid_request_error"


def test_invalid_json_is_a_400(server):
    status, body = server.post("/v1/completions", b'{"model": "x", "prompt": ')
    assert "not valid JSON" in assert_error(status, body, 400, None)["message"]
    status, body = server.post("/v1/chat/completions", b"[1, 2]")
    assert "JSON object" in assert_error(status, body, 400, None)["message"]


def test_chat_fields_are_checked(server):
    bad_messages = {"model": server.model_id, "messages": [{"role": "user", "content": 5}]}
    status, body = server.post("/v1/chat/completions", bad_messages)
    assert_error(status, body, 400, "messages.0.content")
    status, body = server.post("/v1/chat/completions", {"model": server.model_id})
    assert_error(status, body, 400, "messages")


def test_n_above_one_is_refused_through_the_client(client, server):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": "hi"}], n=2
        )
    assert caught.value.param == "n" and "n=1" in caught.value.message


def test_unknown_model_is_a_404(client, server):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert (caught.value.param, caught.value.code) == ("model", "model_not_found")
    assert "no-such-model" in caught.value.message and server.model_id in caught.value.message


def test_unknown_route_is_a_404_in_openai_shape(server):
    status, body = server.get("/v1/engines")
    assert_error(status, body, 404, None)


def test_prompt_plus_max_tokens_beyond_the_context_is_a_400(client, server):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=server.model_id, prompt="hi", max_tokens=TEST_MAX_SEQ_LEN)
    assert (caught.value.param, caught.value.code) == ("max_tokens", "context_length_exceeded")
    assert str(TEST_MAX_SEQ_LEN) in caught.value.message
    long_prompt = " ".join(["token"] * (TEST_MAX_SEQ_LEN + 10))
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=server.model_id, prompt=long_prompt, max_tokens=1)
    assert caught.value.param == "prompt"


def test_token_ids_outside_the_vocabulary_are_a_400(server):
    body = completion_body(server.model_id, prompt=[1, 2, 10**9])
    assert_error(*server.post("/v1/completions", body), 400, "prompt")


def wait_until_idle(server: LiveServer) -> dict:
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while time.monotonic() < deadline:
        stats = server.stats()
        if stats["requests_running"] == 0 and stats["requests_waiting"] == 0:
            return stats
        time.sleep(0.05)
    pytest.fail(f"requests still running after {POLL_TIMEOUT_S} s: {server.stats()}")


LONG_MAX_TOKENS = TEST_MAX_SEQ_LEN - 16  # fills the context: far more than a test reads


def long_stream(client: openai.OpenAI, server: LiveServer):
    """A streaming completion after its first chunk: it holds a KV row now."""
    stream = client.completions.create(
        model=server.model_id,
        prompt="def f(x):",
        max_tokens=LONG_MAX_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    return stream


def test_streaming_client_that_disconnects_frees_its_slot(client, server):
    before = wait_until_idle(server)
    long_stream(client, server).close()
    after = wait_until_idle(server)
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    assert after["requests_served"] == before["requests_served"]
    assert client.completions.create(**completion_body(server.model_id)).choices[0].text


def test_non_streaming_client_that_disconnects_frees_its_slot(client, server):
    before = wait_until_idle(server)
    url = urlparse(server.url)
    body = completion_body(server.model_id, max_tokens=LONG_MAX_TOKENS, ignore_eos=True)
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(head.encode() + payload)
        deadline = time.monotonic() + POLL_TIMEOUT_S
        while (stats := server.stats())["requests_running"] == 0:  # running: disconnect now
            assert stats["requests_served"] == before["requests_served"], (
                "the request ended before it was seen running"
            )
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    after = wait_until_idle(server)
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    assert server.get("/health") == (200, {"status": "ok"})


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_a_stream_shuts_down_cleanly(demo_checkpoint, tmp_path, stop_signal):
    server = start_server(demo_checkpoint, tmp_path, "--max-seq-len", str(TEST_MAX_SEQ_LEN))
    try:
        stream = long_stream(server.client(), server)
        server.process.send_signal(stop_signal)
        # Open streams may finish within the grace period; past it they end in an error event.
        try:
            finish = [c.choices[0].finish_reason for c in stream][-1]
        except openai.APIError as error:
            finish = error.message
        assert finish == "length" or "shutting down" in finish
        exit_code = server.process.wait(timeout=STOP_TIMEOUT_S)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    log = server.log()
    assert exit_code == 0, log
    assert "Traceback" not in log
