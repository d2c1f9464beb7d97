"""One replica: a `hybridmoe serve` subprocess on its own loopback port, which the supervisor
starts, watches and starts again when it exits. Children die with the supervisor (child.py),
so a killed supervisor leaves no replica behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

STOP_TIMEOUT_S = 30.0  # SIGTERM's grace (the server drains in 5 s) before SIGKILL


def spawn(argv: list[str]) -> subprocess.Popen:
    """`argv` in a session of its own (a Ctrl-C at the terminal reaches the supervisor only,
    which stops the children in order), sharing the supervisor's stdout and stderr."""
    launcher = [sys.executable, "-m", "hybridmoe.cluster.child", str(os.getpid())]
    return subprocess.Popen(launcher + argv, start_new_session=True)


def stop(processes: list[subprocess.Popen], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM to all, then wait for all together; what is still running after `timeout_s`
    is killed."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Replica:
    """Replica `index` of the cluster, listening on 127.0.0.1:`port`; `argv` is its full
    `hybridmoe serve` command line. `worker_id` is its id in the router while registered."""

    index: int
    port: int
    argv: list[str]
    process: subprocess.Popen | None = None
    restarts: int = 0
    worker_id: str | None = None
    restart_at_s: float | None = None  # time.monotonic() at which it is started again
    was_ready: bool = False  # registered once: an exit before that is a setup error

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        self.process, self.restart_at_s = spawn(self.argv), None

    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def state(self) -> str:
        """starting (loading or warming up), serving (registered with the router) or
        restarting (exited; started again at restart_at_s)."""
        if self.restart_at_s is not None or self.exited():
            return "restarting"
        return "serving" if self.worker_id is not None else "starting"
