"""The router in front of the replicas: sglang-router's launcher as a subprocess, and its worker
registry over the router's HTTP API (POST /workers, DELETE /workers/<id>), through which the
supervisor adds a replica once it is healthy and removes it the moment its process exits."""

from __future__ import annotations

import importlib.util
import json
import sys
import urllib.error
import urllib.request

from hybridmoe.cluster.config import ClusterConfig
from hybridmoe.errors import HybridMoeError

EXTRA = "pip install 'hybridmoe[cluster]'"
_LAUNCHER = "sglang_router.launch_router"
_API_TIMEOUT_S = 10.0


def require_router() -> None:
    """Raises HybridMoeError naming the extra when sglang-router is not installed."""
    try:
        found = importlib.util.find_spec("sglang_router") is not None
    except (ImportError, ValueError):  # ValueError: blocked in sys.modules (as the tests do)
        found = False
    if not found:
        raise HybridMoeError(
            f"`hybridmoe cluster` needs the router, sglang-router, which is not installed: {EXTRA}"
        )


def router_argv(config: ClusterConfig, host: str, port: int, metrics_port: int) -> list[str]:
    """The router's command line: no workers yet (the supervisor registers them), a replica
    unhealthy after one failed /health probe, Prometheus metrics on `metrics_port`."""
    return [
        sys.executable, "-m", _LAUNCHER, "--host", host, "--port", str(port),
        "--policy", config.policy,
        "--health-check-interval-secs", str(config.health_check_interval_s),
        "--health-failure-threshold", "1",
        "--prometheus-host", host, "--prometheus-port", str(metrics_port),
        "--log-level", "warn",
    ]  # fmt: skip


class RouterWorkers:
    """The router's list of workers, changed through its HTTP API at `url` (http://host:port).
    The router applies additions and removals in the background, shortly after the call."""

    def __init__(self, url: str) -> None:
        self.url = url

    def add(self, worker_url: str, model_id: str) -> str:
        """Registers `worker_url` serving `model_id`; returns the router's id for it."""
        body = {"url": worker_url, "model_id": model_id}
        return self._call("POST", "/workers", body)["worker_id"]

    def remove(self, worker_id: str) -> None:
        self._call("DELETE", f"/workers/{worker_id}")

    def listed(self) -> list[dict]:
        """The router's workers: each with its url, is_healthy and load (requests in flight)."""
        return self._call("GET", "/workers")["workers"]

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        request = urllib.request.Request(self.url + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=_API_TIMEOUT_S) as response:
                return json.loads(response.read())
        except (OSError, ValueError) as exc:  # urllib.error.URLError is an OSError
            raise HybridMoeError(f"router {method} {path} at {self.url} failed: {exc}") from exc


def is_healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether `url`/health answers 200 (a replica still warming up answers 503)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, urllib.error.HTTPError):
        return False
