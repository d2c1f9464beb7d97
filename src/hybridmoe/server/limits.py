"""What one request may take: the body size (413), a place in the waiting queue (503 with
Retry-After), a prompt's length in characters before it is tokenised, and its running time."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridmoe.engine import Engine
from hybridmoe.engine.scheduler import Scheduler
from hybridmoe.server.config import ServerConfig
from hybridmoe.server.errors import ApiError, RequestTimedOut

RETRY_AFTER_S = 1  # what a 503 for a full queue (or a server still warming up) suggests
# Normalisation may merge a few code points into one (NFC: a Hangul L+V+T, a letter and two
# marks), so text may have this many times more characters than its tokens spell out.
NORMALISATION_SHRINK = 4
T = TypeVar("T")


class BodyLimit:
    """Reads a request body of at most `max_bytes` before the app runs (413 beyond, at once
    when Content-Length says so), then replays it: no handler ever holds more."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        messages, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left (or a read timeout closed it): nobody to answer
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body"):
                break
        await self.app(scope, _replay(messages, receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"the request body is larger than the server's limit of {self.max_bytes} bytes "
            "(--max-body-bytes)"
        )
        # The connection stays open: the client may send the rest (discarded) and read this.
        await ApiError(413, message, code="request_too_large").response()(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()

    return replayed


class RequestLimits:
    """Admission and deadlines of the requests of one server."""

    def __init__(self, config: ServerConfig, scheduler: Scheduler) -> None:
        self.max_queue, self.timeout_s = config.max_queue, config.request_timeout_s
        self.scheduler = scheduler
        self.ready = threading.Event()  # set once warm (warmup.py): until then 503 "loading"
        self._lock = threading.Lock()
        self._admitting = 0  # admitted, tokenising, not yet in the scheduler's queue

    def deadline(self) -> float | None:
        """When a request arriving now times out (event-loop time); None: never."""
        if self.timeout_s is None:
            return None
        return asyncio.get_running_loop().time() + self.timeout_s

    def admitted(self, start: Callable[..., T], *args: object) -> T:
        """start(*args) (tokenise and submit) unless the server is still warming up or
        --max-queue requests already wait: then a 503 with Retry-After. Any thread."""
        with self._admission():
            return start(*args)

    @contextmanager
    def _admission(self) -> Iterator[None]:
        with self._lock:
            self._check()
            self._admitting += 1
        try:
            yield
        finally:
            with self._lock:
                self._admitting -= 1

    def _check(self) -> None:
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if not self.ready.is_set():
            message = "the server is loading (warming up its kernels); retry shortly"
            raise ApiError(503, message, code="loading", kind="server_error", headers=retry)
        queued = len(self.scheduler.waiting) + self._admitting
        if self.max_queue is not None and queued >= self.max_queue:
            raise ApiError(
                503,
                f"the server is busy: {queued} requests wait for a slot (--max-queue "
                f"{self.max_queue}); retry later",
                code="queue_full",
                kind="server_error",
                headers=retry,
            )


def check_prompt_chars(engine: Engine, text: str, param: str) -> None:
    """A 400 (context_length_exceeded) for text too long in characters to fit in max_seq_len
    tokens however it tokenises, before any time is spent tokenising it: no token spells more
    than Tokenizer.longest_token_chars characters (NORMALISATION_SHRINK for normalisers)."""
    per_token = engine.require_tokenizer().longest_token_chars * NORMALISATION_SHRINK
    limit = engine.max_seq_len * per_token
    if len(text) > limit:
        raise ApiError(
            400,
            f"the prompt has {len(text)} characters; at most {limit} can fit in the context "
            f"window of {engine.max_seq_len} tokens; shorten the prompt",
            param=param,
            code="context_length_exceeded",
        )


async def until_deadline(
    items: AsyncIterator[T], deadline: float | None, timeout_s: float | None
) -> AsyncIterator[T]:
    """`items` until `deadline` (event-loop time), then RequestTimedOut; the iterator waited
    on is cancelled (a generation's then frees its row)."""
    if deadline is None or timeout_s is None:
        async for item in items:
            yield item
        return
    loop = asyncio.get_running_loop()
    iterator = aiter(items)
    while True:
        try:
            item = await asyncio.wait_for(anext(iterator), deadline - loop.time())
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise RequestTimedOut(timeout_s) from None
        yield item
