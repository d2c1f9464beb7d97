"""GET /v1/stats of the cluster on its own port: each replica's own /v1/stats (load, tokens,
prefix-cache hits) beside its state and restarts, and their sum. The router's front answers
the OpenAI API only; its Prometheus metrics (per-worker requests and health) are linked.
With an API key, the replicas are asked with it and the cluster's stats require it too."""

from __future__ import annotations

import hmac
import json
import threading
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_FETCH_TIMEOUT_S = 2.0
# counters and gauges of a replica's /v1/stats that add up over replicas
SUMMED = (
    "requests_served", "requests_failed", "requests_cancelled", "requests_running",
    "requests_waiting", "prompt_tokens", "completion_tokens",
)  # fmt: skip


def bearer(api_key: str | None) -> dict[str, str]:
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


def fetch_stats(url: str, api_key: str | None = None) -> dict | None:
    """`url`/v1/stats, or None when the replica does not answer (down, or still loading)."""
    request = urllib.request.Request(url + "/v1/stats", headers=bearer(api_key))
    try:
        with urllib.request.urlopen(request, timeout=_FETCH_TIMEOUT_S) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def total(replica_stats: list[dict | None]) -> dict:
    """The sum of SUMMED and of the prefix caches' hit and queried tokens over the replicas
    that answered, and the hit rate of that sum."""
    answered = [s for s in replica_stats if s is not None]
    summed = {name: sum(s[name] for s in answered) for name in SUMMED}
    caches = [s["prefix_cache"] for s in answered if s.get("prefix_cache")]
    hit = sum(c["hit_tokens"] for c in caches)
    queried = sum(c["queried_tokens"] for c in caches)
    rate = round(hit / queried, 4) if queried else 0.0
    cache = {"hit_tokens": hit, "queried_tokens": queried, "hit_rate": rate}
    return {"replicas_answering": len(answered), **summed, "prefix_cache": cache}


class StatsServer:
    """Serves GET /v1/stats as `snapshot()` on (host, port) from a daemon thread, to requests
    bearing `api_key` when one is given (else 401); port 0 binds a free one (`port` says which)."""

    def __init__(
        self, host: str, port: int, snapshot: Callable[[], dict], api_key: str | None = None
    ) -> None:
        fields = {"snapshot": staticmethod(snapshot), "authorization": bearer(api_key)}
        handler = type("Handler", (_Handler,), fields)
        self._http = ThreadingHTTPServer((host, port), handler)
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, name="cluster-stats")

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever, which must be running
            self._http.shutdown()
        self._http.server_close()


class _Handler(BaseHTTPRequestHandler):
    snapshot: Callable[[], dict]
    authorization: dict[str, str]  # {} or {"Authorization": "Bearer KEY"}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        expected = self.authorization.get("Authorization")
        given = self.headers.get("Authorization") or ""
        if expected is not None and not hmac.compare_digest(given.encode(), expected.encode()):
            self._send(401, {"error": {"message": "missing or wrong API key"}})
            return
        if self.path != "/v1/stats":
            self._send(404, {"error": {"message": f"no route {self.path}; try /v1/stats"}})
            return
        self._send(200, self.snapshot())

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # polled often; the replicas log their own requests
