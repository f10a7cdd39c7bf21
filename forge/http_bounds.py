"""uvicorn's HTTP protocol with the bounds forge's HTTP front doors (the gateway, the Tinker API)
hold against any peer, before its key is checked: each request arrives whole (head and body)
within a deadline, however its bytes trickle, a response its peer stops reading is dropped after
that deadline, and a server holds at most so many connections.

    uvicorn.Config(app, http=bounded_http(deadline_s=30, max_connections=4096), ...)

uvicorn has none: a connection that sends nothing, or half a request, or never reads its answer
(the request's handler waits on the write), is held for as long as the peer keeps it open (only a
kept-alive connection between requests times out). This is the thinnest adapter: its protocol
class, a timer per request and per stalled write, and a count at each accept.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def bounded_http(deadline_s: float, max_connections: int) -> type[HttpToolsProtocol]:
    """A uvicorn `http` protocol class: a connection is dropped if a request of it has not arrived
    whole `deadline_s` after the connection (or its previous response) began, or if its writes
    stay stalled (the peer reads nothing) for `deadline_s`; one accepted while `max_connections`
    are open is closed at once."""

    class BoundedHttp(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.deadline: asyncio.TimerHandle | None = None
            self.stalled: asyncio.TimerHandle | None = None
            if len(self.connections) > max_connections:
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            _cancel(self.deadline)
            self.deadline = self.loop.call_later(deadline_s, self._expire)

        def _expire(self) -> None:
            # abort, not close: close waits to flush what the peer does not read, holding the connection
            self.transport.abort()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self.stalled is None:
                self.stalled = self.loop.call_later(deadline_s, self._expire)

        def resume_writing(self) -> None:
            super().resume_writing()
            _cancel(self.stalled)
            self.stalled = None

        def on_message_complete(self) -> None:
            _cancel(self.deadline)
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # The next request on this connection: the same bound, unless it is here whole already
            # (pipelined: it was sent before this response ended).
            nxt = self.cycle
            arrived = nxt is not None and not nxt.response_complete and not nxt.more_body
            if not self.transport.is_closing() and not arrived:
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            _cancel(self.deadline)
            _cancel(self.stalled)
            super().connection_lost(exc)

    return BoundedHttp


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()
