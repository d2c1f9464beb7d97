"""The parts of `hybridmoe cluster` that need no router: its config's checks, the error that
names the extra when sglang-router is missing, the sum of the replicas' /v1/stats and the
stats server's API key."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

import pytest

from hybridmoe import cli
from hybridmoe.cluster.config import ClusterConfig
from hybridmoe.cluster.router import require_router
from hybridmoe.cluster.stats import StatsServer, total
from hybridmoe.errors import HybridMoeError


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"replicas": -1}, "replicas must be >= 0"),
        ({"replicas": 0}, "would front nothing"),
        ({"policy": "fastest"}, "policy must be one of"),
        ({"stats_port": 70000}, "stats_port must be in"),
        ({"replica_base_port": 65535, "replicas": 2}, "leaves no room"),
        ({"worker_urls": ("m2:8000",)}, "not an http:// or https:// URL"),
        ({"health_check_interval_s": 0}, "health_check_interval_s must be >= 1"),
        ({"restart_delay_s": float("nan")}, "restart_delay_s must be >= 0"),
    ],
)
def test_bad_configs_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**fields)


def test_remote_workers_alone_are_a_cluster():
    config = ClusterConfig(replicas=0, worker_urls=["http://m2:8000"])
    assert config.worker_urls == ("http://m2:8000",)


def test_a_missing_router_is_an_error_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sglang_router", None)  # as if not installed
    with pytest.raises(HybridMoeError, match=r"pip install 'hybridmoe\[cluster\]'"):
        require_router()
    assert cli.main(["cluster", "--replicas", "1"]) == 2  # before any replica starts
    assert "hybridmoe[cluster]" in capsys.readouterr().err


def replica_stats(served: int, hit: int, queried: int) -> dict:
    counters = dict.fromkeys(("requests_failed", "requests_cancelled", "requests_running"), 0)
    counters |= {"requests_waiting": 0, "prompt_tokens": queried, "completion_tokens": served}
    cache = {"hit_tokens": hit, "queried_tokens": queried, "hit_rate": 0.0}
    return {"requests_served": served, **counters, "prefix_cache": cache}


def test_the_total_sums_the_replicas_that_answer():
    summed = total([replica_stats(3, 100, 400), None, replica_stats(1, 0, 100)])
    assert summed["replicas_answering"] == 2
    assert (summed["requests_served"], summed["prompt_tokens"]) == (4, 500)
    assert summed["prefix_cache"] == {"hit_tokens": 100, "queried_tokens": 500, "hit_rate": 0.2}
    assert total([None])["prefix_cache"]["hit_rate"] == 0.0


def get(url: str, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_stats_server_answers_with_the_key_only():
    server = StatsServer("127.0.0.1", 0, lambda: {"ready": True}, api_key="k")
    server.start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        assert get(f"{url}/v1/stats", {"Authorization": "Bearer k"}) == (200, {"ready": True})
        assert get(f"{url}/v1/stats")[0] == 401
        assert get(f"{url}/v1/stats", {"Authorization": "Bearer wrong"})[0] == 401
        assert get(f"{url}/other", {"Authorization": "Bearer k"})[0] == 404
    finally:
        server.close()
    StatsServer("127.0.0.1", 0, dict).close()  # never started: closes without waiting
