"""uvicorn's HTTP/1.1 protocol with a deadline for a request's headers.

uvicorn closes an idle keep-alive connection, but a connection that never completes its headers
(a fresh one that sends nothing, or a few bytes and then nothing) stays open for ever: ~21k such
connections exhausted the process's file descriptors. Here each connection must complete a
request's headers within `HEADER_TIMEOUT_S` of connecting or of its previous response; the body's
own deadline is the request handler's (`app._read_body`).
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0


class DeadlineH11Protocol(H11Protocol):
    """H11Protocol whose connections close when a request's headers are not in by the deadline."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_request():
            self._disarm()
        elif self._header_timer is None:  # between requests: the next one's headers are due
            self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if not self._in_request() and not self.transport.is_closing():
            self.transport.close()
