"""Running a cluster until SIGINT or SIGTERM: the replicas (`hybridmoe serve` subprocesses),
the router in front (sglang-router, a subprocess) and the stats server (a thread), tended from
the main thread: a replica that exits is removed from the router at once and started again;
one that answers /health is added to the router."""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time

from hybridmoe.cluster.config import ClusterConfig
from hybridmoe.cluster.replicas import Replica, spawn, stop
from hybridmoe.cluster.router import RouterWorkers, is_healthy, require_router, router_argv
from hybridmoe.cluster.stats import StatsServer, fetch_stats, total
from hybridmoe.errors import HybridMoeError

POLL_S = 0.2
ROUTER_START_TIMEOUT_S = 60.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _connect_host(host: str) -> str:
    """Where this machine reaches a server bound to `host` (a wildcard: loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def _http(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Cluster:
    """The replicas of `model_id`, each `serve_argv` (a `hybridmoe serve` command line without
    --host/--port) on a loopback port, behind the router on (host, port). `api_key`: the key
    the replicas require (`serve --api-key`), for their /v1/stats."""

    def __init__(
        self,
        config: ClusterConfig,
        host: str,
        port: int,
        serve_argv: list[str],
        model_id: str,
        api_key: str | None = None,
    ) -> None:
        self.config, self.model_id, self.api_key = config, model_id, api_key
        self.host, self.port = host, port or free_port(host)
        self.front = _http(_connect_host(host), self.port)
        self.metrics_port = free_port(host)
        self.replicas = [
            Replica(i, p, [*serve_argv, "--host", "127.0.0.1", "--port", str(p)])
            for i, p in enumerate(self._replica_ports())
        ]
        self.workers = RouterWorkers(self.front)
        self.router = None
        self.ready = False
        self.stats = StatsServer(host, config.stats_port, self.snapshot, api_key)

    def _replica_ports(self) -> list[int]:
        base = self.config.replica_base_port
        n = self.config.replicas
        return [base + i for i in range(n)] if base else [free_port("127.0.0.1") for _ in range(n)]

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()
        self.router = spawn(router_argv(self.config, self.host, self.port, self.metrics_port))
        self.stats.start()
        self._wait_for_router()
        for url in self.config.worker_urls:
            self.workers.add(url, self.model_id)
        _say(f"cluster of {len(self.replicas)} replicas (+{len(self.config.worker_urls)} remote) "
             f"at {self.front}/v1, policy {self.config.policy}; stats at "
             f"{_http(_connect_host(self.host), self.stats.port)}/v1/stats")  # fmt: skip

    def _wait_for_router(self) -> None:
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while not is_healthy(self.front):
            if self.router.poll() is not None:
                raise HybridMoeError(f"the router exited with {self.router.returncode} at start")
            if time.monotonic() > deadline:
                raise HybridMoeError(f"the router did not answer within {ROUTER_START_TIMEOUT_S} s")
            time.sleep(POLL_S)

    def step(self) -> None:
        """One round of tending: raises HybridMoeError if the router has exited."""
        if self.router.poll() is not None:
            raise HybridMoeError(f"the router exited with {self.router.returncode}")
        now = time.monotonic()
        for replica in self.replicas:
            self._tend(replica, now)
        if not self.ready and all(r.state() == "serving" for r in self.replicas):
            self.ready = self._all_routed()
            if self.ready:
                remote = len(self.config.worker_urls)
                _say(f"cluster ready: {len(self.replicas)} replicas (+{remote} remote) routed")

    def _tend(self, replica: Replica, now: float) -> None:
        if replica.exited() and not replica.was_ready:  # bad flags, a port taken, no memory
            raise HybridMoeError(
                f"replica {replica.index} exited with {replica.process.returncode} before it "
                "was ready (its messages are above); not starting it again"
            )
        if replica.exited() and replica.restart_at_s is None:
            self._unregister(replica)
            replica.restart_at_s = now + self.config.restart_delay_s
            _say(f"replica {replica.index} (pid {replica.pid}) exited with "
                 f"{replica.process.returncode}; starting it again")  # fmt: skip
        elif replica.restart_at_s is not None and now >= replica.restart_at_s:
            replica.restarts += 1
            replica.start()
        elif replica.state() == "starting" and is_healthy(replica.url, timeout_s=0.5):
            replica.worker_id = self.workers.add(replica.url, self.model_id)
            replica.was_ready = True
            _say(f"replica {replica.index} at {replica.url} added to the router")

    def _unregister(self, replica: Replica) -> None:
        if replica.worker_id is None:
            return
        self.ready, worker_id, replica.worker_id = False, replica.worker_id, None
        try:
            self.workers.remove(worker_id)
        except HybridMoeError as exc:  # the router's health check removes it from routing too
            _say(f"warning: {exc}")

    def _all_routed(self) -> bool:
        healthy = {w["url"] for w in self.workers.listed() if w["is_healthy"]}
        return all(r.url in healthy for r in self.replicas)

    def snapshot(self) -> dict:
        """The body of the cluster's GET /v1/stats."""
        try:
            routed = {w["url"]: w for w in self.workers.listed()}
        except HybridMoeError:
            routed = {}
        key = self.api_key
        rows = [self._row(r.url, routed, key, r.state(), r.index, r.pid, r.restarts)
                for r in self.replicas]  # fmt: skip
        rows += [self._row(url, routed, key, "remote") for url in self.config.worker_urls]
        return {
            "front": f"{self.front}/v1",
            "policy": self.config.policy,
            "ready": self.ready,
            "router_metrics": f"{_http(_connect_host(self.host), self.metrics_port)}/metrics",
            "replicas": rows,
            "total": total([row["stats"] for row in rows]),
        }

    @staticmethod
    def _row(url: str, routed: dict, api_key, state: str, index=None, pid=None, restarts=None):
        router = routed.get(url)
        in_router = None if router is None else {k: router[k] for k in ("is_healthy", "load")}
        stats = None if state == "restarting" else fetch_stats(url, api_key)
        return {"index": index, "url": url, "state": state, "pid": pid, "restarts": restarts,
                "router": in_router, "stats": stats}  # fmt: skip

    def close(self) -> None:
        self.stats.close()
        stop([p for p in (self.router,) if p is not None], timeout_s=10.0)
        stop([r.process for r in self.replicas if r.process is not None])


def _say(message: str) -> None:
    print(f"hybridmoe: {message}", file=sys.stderr, flush=True)


def run_cluster(
    config: ClusterConfig,
    host: str,
    port: int,
    serve_argv: list[str],
    model_id: str,
    api_key: str | None = None,
) -> None:
    """Run the cluster until SIGINT/SIGTERM, then stop the router and every replica. Call from
    the main thread. Raises HybridMoeError if sglang-router is missing, the router fails or a
    replica exits before it was ever ready."""
    require_router()
    cluster = Cluster(config, host, port, serve_argv, model_id, api_key)
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in STOP_SIGNALS}
    try:
        cluster.start()
        while not stopping.wait(POLL_S):
            cluster.step()
    finally:
        cluster.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
