"""uvicorn's HTTP/1.1 protocol with a deadline for a request's headers and a bound on the
connections that are still waiting for them.

uvicorn closes an idle keep-alive connection, but a connection that never completes its headers
(a fresh one that sends nothing, or a few bytes and then nothing) stays open for ever: ~21k such
connections exhausted the process's file descriptors. Here each connection must complete a
request's headers within `header_timeout_s` of connecting or of its previous response (the body's
own deadline is the request handler's, `app._read_body`), and at most `MAX_WAITING` connections
(`MAX_WAITING_PER_PEER` from one address) may be waiting for their headers at once: past that the
oldest waiting one is closed. An honest client's connection waits for its headers for
milliseconds, so it is never the oldest; 70 idle connections no longer shut others out (they
filled uvicorn's connection limit and every request after them got a 503).
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
MAX_WAITING = 128  # connections waiting for their request headers, every peer together
MAX_WAITING_PER_PEER = 32


class WaitingConnections:
    """The connections of one server that wait for a request's headers, oldest first, overall and
    per peer address; adding one past a bound closes the oldest (of that peer, or of all)."""

    def __init__(self, limit: int = MAX_WAITING, per_peer: int = MAX_WAITING_PER_PEER):
        self.limit, self.per_peer = limit, per_peer
        self._all: OrderedDict = OrderedDict()
        self._by_peer: dict[str, OrderedDict] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._all)

    def add(self, proto: "DeadlineH11Protocol") -> None:
        self.remove(proto)
        self._all[proto] = None
        self._by_peer.setdefault(proto.peer, OrderedDict())[proto] = None
        mine = self._by_peer[proto.peer]
        while len(mine) > self.per_peer:
            self._evict(next(iter(mine)))
        while len(self._all) > self.limit:
            self._evict(next(iter(self._all)))

    def remove(self, proto: "DeadlineH11Protocol") -> None:
        if proto in self._all:
            del self._all[proto]
            mine = self._by_peer[proto.peer]
            mine.pop(proto, None)
            if not mine:
                del self._by_peer[proto.peer]

    def _evict(self, proto: "DeadlineH11Protocol") -> None:
        self.remove(proto)
        self.evicted += 1
        proto.close_waiting()


class DeadlineH11Protocol(H11Protocol):
    """H11Protocol whose connections close when a request's headers are not in by the deadline,
    or when too many others wait for theirs (`waiting`, one per server: set on a subclass)."""

    header_timeout_s = HEADER_TIMEOUT_S
    waiting: WaitingConnections | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else ""
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
        if self.waiting is not None:
            self.waiting.add(self)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = None
        if self.waiting is not None:
            self.waiting.remove(self)

    def _expire(self) -> None:
        self.close_waiting()

    def close_waiting(self) -> None:
        """Closes the connection unless a request is under way on it."""
        self._disarm()
        if not self._in_request() and not self.transport.is_closing():
            self.transport.close()
