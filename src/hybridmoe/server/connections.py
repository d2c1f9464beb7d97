"""Connections that never finish sending a request are closed: uvicorn's h11 protocol with a
read deadline. uvicorn alone times out only idle keep-alive connections (timeout_keep_alive),
so a client that connects and sends nothing, half its headers or half its body holds a file
descriptor and a slot of --max-connections for as long as it likes."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 64 * 1024  # h11's limit on a request line plus headers (uvicorn: 16 KiB)
_READING = (h11.IDLE, h11.SEND_BODY)  # the client's side of a request not yet fully received
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 43\r\n\r\nthe request was not sent within the timeout"
)


def read_deadline_protocol(read_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol class that closes a connection whose request is not fully received
    within `read_timeout_s` of the connection opening (the first request) or of the request's
    first byte (later ones; between requests uvicorn's keep-alive timeout applies). Before any
    response has begun the client gets a 408 first."""

    class ReadDeadlineH11Protocol(H11Protocol):
        _read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._watch_reading()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_reading()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def _watch_reading(self) -> None:
            if self.transport.is_closing():
                return
            reading = self.conn.their_state in _READING
            if self.conn.their_state is h11.IDLE and self.timeout_keep_alive_task is not None:
                reading = False  # idle between requests: the keep-alive timeout's business
            if not reading:
                self._stop_timer()
            elif self._read_timer is None:
                self._read_timer = self.loop.call_later(read_timeout_s, self._timed_out)

        def _stop_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()

    return ReadDeadlineH11Protocol
