"""Server configuration and request preparation, in-process: config validation, the context
window (the engine config's max_seq_len), a checkpoint without a chat template, and `serve`
refusing bad flags."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.config import DEFAULT_MAX_SEQ_LEN
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.server.app import create_app, stats_body
from hybridmoe.server.config import ServerConfig
from hybridmoe.server.errors import ApiError
from hybridmoe.server.generation import ServedModel, start_chat
from hybridmoe.server.protocol import ChatCompletionRequest
from hybridmoe.server.security import allowed_host_names, host_name


@pytest.mark.parametrize(
    ("config", "fields", "word"),
    [
        (ServerConfig, {"port": 70000}, "port"),
        (EngineConfig, {"max_seq_len": 1}, "max_seq_len"),  # the engine's: its KV cache
        (ServerConfig, {"host": ""}, "host"),
        (ServerConfig, {"api_key": ""}, "api_key"),
        (ServerConfig, {"allowed_hosts": ("a", "")}, "allowed_hosts"),
        (ServerConfig, {"max_body_bytes": 0}, "max_body_bytes"),
        (ServerConfig, {"max_queue": 0}, "max_queue"),
        (ServerConfig, {"max_connections": -1}, "max_connections"),
        (ServerConfig, {"request_timeout_s": 0}, "request_timeout_s"),
        (ServerConfig, {"read_timeout_s": float("inf")}, "read_timeout_s"),
        (ServerConfig, {"keep_alive_timeout_s": float("nan")}, "keep_alive_timeout_s"),
    ],
)
def test_server_config_refuses_bad_values(config, fields, word):
    with pytest.raises(ValueError, match=word):
        config(**fields)


def test_the_api_key_can_come_from_a_file(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("  s3cret \nsecond line\n")
    assert ServerConfig(api_key_file=str(key_file)).api_key == "s3cret"
    with pytest.raises(ValueError, match="not both"):
        ServerConfig(api_key="x", api_key_file=str(key_file))
    with pytest.raises(ValueError, match="api_key_file .*missing.* cannot be read"):
        ServerConfig(api_key_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="api_key_file .*empty.*first line is empty"):
        ServerConfig(api_key_file=str(tmp_path / "empty"))


def test_max_seq_len_defaults_to_the_context_window_capped():
    assert EngineConfig().resolve_max_seq_len(2048) == 2048
    assert EngineConfig().resolve_max_seq_len(32768) == DEFAULT_MAX_SEQ_LEN == 4096
    assert EngineConfig(max_seq_len=512).resolve_max_seq_len(2048) == 512
    with pytest.raises(ValueError, match="context window"):
        EngineConfig(max_seq_len=4096).resolve_max_seq_len(2048)


@pytest.mark.parametrize("max_seq_len", [64, None])
def test_the_server_sizes_its_kv_cache_by_the_engine_config(demo_checkpoint, max_seq_len):
    config = EngineConfig(max_batch=2, max_seq_len=max_seq_len)
    with Engine.from_pretrained(demo_checkpoint, config) as engine:
        context = engine.model.cfg.max_position_embeddings
        scheduler = create_app(engine, "m").state.served.scheduler
        assert scheduler.max_seq_len == (max_seq_len or min(context, DEFAULT_MAX_SEQ_LEN))
        scheduler.close()


def test_chat_on_a_checkpoint_without_a_template_is_a_400(demo_variant):
    engine = Engine.from_pretrained(demo_variant(skip=("tokenizer_config.json",)))
    served = ServedModel("m", engine, created=0)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ApiError) as caught:
        start_chat(served, request)
    assert (caught.value.status, caught.value.param) == (400, "messages")
    assert "chat_template" in caught.value.message


def run_serve(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "hybridmoe", "serve", *args]
    return subprocess.run(command, capture_output=True, encoding="utf-8", timeout=300)


def test_serve_refuses_max_seq_len_beyond_the_model(demo_checkpoint):
    result = run_serve("--model", str(demo_checkpoint), "--max-seq-len", "100000", "--port", "0")
    assert result.returncode == 2
    assert "max_seq_len 100000" in result.stderr and "Traceback" not in result.stderr


def test_serve_reports_a_port_in_use(demo_checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_serve("--model", str(demo_checkpoint), "--port", str(port))
    assert result.returncode == 2
    assert "address already in use" in result.stderr and "did not start" in result.stderr
    assert "Traceback" not in result.stderr


def test_stats_report_the_expert_cache_when_hybrid(demo_checkpoint):
    # The torch CPU kernel: no JIT compile, and the kernel is not what this test is about.
    offload = OffloadConfig(decode_target="hybrid", expert_cache_ratio=0.25, cpu_kernel="torch")
    with Engine.from_pretrained(demo_checkpoint, EngineConfig(offload=offload)) as engine:
        served = ServedModel("m", engine, created=0)
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        for prompt in ("def f(x):", "hello"):
            engine.submit(engine.encode(prompt), params, lambda output: None)
        while not served.scheduler.idle:
            served.scheduler.step()
        body = stats_body(served)
    assert body["decode_target"] == "hybrid"
    assert (body["requests_served"], body["completion_tokens"]) == (2, 16)
    experts = body["experts"]
    assert set(experts) == {"hit_rate", "cpu_route_share", "fetched_per_token"}
    assert 0 <= experts["hit_rate"] <= 1 and 0 < experts["cpu_route_share"] <= 1
    assert experts["fetched_per_token"] >= 0


@pytest.mark.parametrize(
    ("host", "allowed", "names"),
    [
        ("127.0.0.1", (), {"127.0.0.1", "localhost", "[::1]"}),
        ("::1", (), {"127.0.0.1", "localhost", "[::1]"}),
        ("localhost", (), {"127.0.0.1", "localhost", "[::1]"}),
        ("10.0.0.5", (), {"10.0.0.5"}),
        ("0.0.0.0", (), None),
        ("0.0.0.0", ("API.example",), {"api.example"}),
        ("127.0.0.1", ("*",), None),
    ],
)
def test_allowed_host_names(host, allowed, names):
    config = ServerConfig(host=host, allowed_hosts=allowed)
    assert allowed_host_names(config) == (None if names is None else frozenset(names))


@pytest.mark.parametrize(
    ("header", "name"),
    [("Example.com:8000", "example.com"), ("[::1]:80", "[::1]"), ("[::1]", "[::1]"), ("x", "x")],
)
def test_host_name_drops_the_port(header, name):
    assert host_name(header) == name
