"""Running the app until SIGINT or SIGTERM, then shutting down gracefully.

The scheduler's forward passes run on the main thread, the one that loaded the model (see
Scheduler.run for why); uvicorn serves HTTP from a second thread, and the main thread's
signal handlers tell it when to stop.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import threading
import time
from types import FrameType

import uvicorn

from hybridmoe.engine import Engine
from hybridmoe.engine.scheduler import Scheduler, SchedulerClosed
from hybridmoe.errors import HybridMoeError
from hybridmoe.server.app import create_app, mark_ready
from hybridmoe.server.config import ServerConfig
from hybridmoe.server.connections import MAX_HEADER_BYTES, read_deadline_protocol
from hybridmoe.server.warmup import warm_up

_DRAIN_POLL_S = 0.05
_CLOSE_CONNECTIONS_S = 5.0  # after the drain, for responses to send their last bytes
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    """uvicorn's server, printing the URL it listens on once bound, and draining the scheduler
    on shutdown: requests in flight get `grace_s` to finish, then end with an error event that
    says the server is shutting down (uvicorn alone would cut their connections)."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, model_id: str, grace_s: float):
        super().__init__(config)
        self.scheduler, self.model_id, self.grace_s = scheduler, model_id, grace_s

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            host = f"[{host}]" if ":" in host else host
            print(f"hybridmoe: serving {self.model_id} at http://{host}:{port}/v1", file=sys.stderr)
            sys.stderr.flush()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections while the requests in flight drain
        deadline = time.monotonic() + self.grace_s
        while not self.scheduler.idle and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(_DRAIN_POLL_S)
        self.scheduler.close()  # fails what is left: each stream ends with an error event
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Called by our own handlers on the main thread; uvicorn's loop polls these flags.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for requests in flight
        self.should_exit = True


def serve(engine: Engine, config: ServerConfig, model_id: str) -> None:
    """Serve `engine` as `model_id` until SIGINT/SIGTERM; returns after a graceful shutdown
    (requests in flight get `config.shutdown_timeout_s` to finish). Call from the main thread.
    Raises HybridMoeError if the HTTP server could not start (e.g. the port is taken).
    The engine warms up while the server already listens (/health: 503 "loading")."""
    app = create_app(engine, model_id, start_scheduler=False, config=config)
    scheduler = app.state.served.scheduler
    uv_config = uvicorn_config(app, config, config.host, config.port)
    server = _Server(uv_config, scheduler, model_id, config.shutdown_timeout_s)
    http = threading.Thread(target=_serve_http, args=(server, scheduler), name="hybridmoe-http")
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in STOP_SIGNALS}
    try:
        http.start()
        _warm_up_and_run(app, engine, scheduler)
        http.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise HybridMoeError("the HTTP server did not start (see uvicorn's message above)")


def uvicorn_config(app: object, config: ServerConfig, host: str, port: int) -> uvicorn.Config:
    """uvicorn's settings for `app` under `config`: the connection limit, the keep-alive and
    read timeouts (connections.py) and the header size limit."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=read_deadline_protocol(config.read_timeout_s),
        timeout_keep_alive=config.keep_alive_timeout_s,
        limit_concurrency=config.max_connections,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_graceful_shutdown=_CLOSE_CONNECTIONS_S,  # a backstop: the drain ends requests
        log_level="info",
    )


def _warm_up_and_run(app: object, engine: Engine, scheduler: Scheduler) -> None:
    """Warm up on this (the main) thread, then run the scheduler here until the HTTP side
    shuts down. A scheduler closed meanwhile (the HTTP server failed to start, or a signal
    came) ends the warm-up: serve() reports what happened."""
    try:
        baseline = warm_up(engine)
    except SchedulerClosed:
        return
    mark_ready(app, baseline)
    print("hybridmoe: warmed up; ready", file=sys.stderr)
    scheduler.run()  # returns once the HTTP side has shut down (or failed to start)


def _serve_http(server: _Server, scheduler: Scheduler) -> None:
    try:
        server.run()  # uvicorn skips its own signal handling off the main thread
    finally:
        scheduler.close()  # idempotent; ends scheduler.run() on the main thread
