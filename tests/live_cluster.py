"""A live `hybridmoe cluster` subprocess on free loopback ports, started as a user starts it,
and stopped with every process it started (checked: none may outlive the test)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from live_server import REQUEST_TIMEOUT_S, TEST_MAX_SEQ_LEN, free_port

STARTUP_TIMEOUT_S = 300  # two replicas load on two shared cores; only so CI cannot hang
STOP_TIMEOUT_S = 60


@dataclass
class LiveCluster:
    process: subprocess.Popen
    front: str  # http://127.0.0.1:PORT, the router
    stats_url: str
    model_id: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.front}/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S
        )

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.stats_url, timeout=REQUEST_TIMEOUT_S) as response:
            return json.loads(response.read())

    def wait_until(self, ready: Any, what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> dict:
        """Polls the cluster's stats until `ready(stats)`; fails the test after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"cluster exited with {self.process.returncode}:\n{self.log()}")
            try:
                stats = self.stats()
                if ready(stats):
                    return stats
            except OSError:
                pass  # the stats server is not listening yet
            time.sleep(0.3)
        pytest.fail(f"cluster: {what} not within {timeout_s} s:\n{self.log()[-4000:]}")


def start_cluster(model_dir: Path, log_dir: Path, *extra_args: str) -> LiveCluster:
    port, stats_port = free_port(), free_port()
    log_path = log_dir / f"cluster-{port}.log"
    command = [sys.executable, "-m", "hybridmoe", "cluster", "--model", str(model_dir)]
    command += ["--port", str(port), "--stats-port", str(stats_port)]
    command += ["--max-seq-len", str(TEST_MAX_SEQ_LEN), *extra_args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
    url = f"http://127.0.0.1:{stats_port}/v1/stats"
    cluster = LiveCluster(process, f"http://127.0.0.1:{port}", url, model_dir.name, log_path)
    try:
        cluster.wait_until(lambda s: s["ready"], "all replicas routed")
    except BaseException:
        stop_cluster(cluster, set())
        raise
    return cluster


def child_pids(pid: int) -> set[int]:
    """Every process below `pid` (the replicas and the router under the supervisor)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)": state ppid
        except OSError:
            continue  # exited meanwhile
        parents[int(stat.parent.name)] = int(fields[1])
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        kids = {child for child, ppid in parents.items() if ppid == parent}
        found |= kids
        todo += kids
    return found


def stop_cluster(cluster: LiveCluster, children: set[int]) -> list[int]:
    """SIGTERM to the supervisor, which stops its children; whatever of `children` is still
    alive afterwards is killed and returned (a leak the caller reports)."""
    if cluster.process.poll() is None:
        cluster.process.send_signal(signal.SIGTERM)
    try:
        cluster.process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        cluster.process.kill()
        cluster.process.wait()
    leaked = [pid for pid in children if _alive(pid)]
    for pid in leaked:
        os.kill(pid, signal.SIGKILL)
    return leaked


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")  # a zombie is dead, only not yet reaped
    return not (status.exists() and "\nState:\tZ" in status.read_text())
