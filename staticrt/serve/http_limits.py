"""Time limits on what a client sends, which uvicorn leaves open: its only timer is keep-alive's,
started after a response, so a connection that sends nothing, or trickles a request's headers a
byte at a time, holds its socket for good (a few hundred such clients exhaust the descriptors).
Here a request's headers must be whole within HEADERS_S of its first byte (or of the connection,
for its first request), else the connection is closed, as nginx's `client_header_timeout` does;
the body's own limit (BODY_S) is the app's (app.py: 408). Works for both of uvicorn's HTTP
implementations, chosen as uvicorn's "auto" chooses: httptools where installed, else h11.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

HEADERS_S = 10.0  # from a request's first byte to its last header
BODY_S = 30.0  # from the headers to the body's last byte (app.py)

log = logging.getLogger("staticrt")


class _Deadline:
    """The header deadline, mixed into a uvicorn protocol: armed when a request may begin, never
    pushed back by the bytes that trickle in, disarmed when its headers are whole."""

    _deadline: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(HEADERS_S, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            log.info("closed a connection whose request headers took over %g s", HEADERS_S)
            self.transport.close()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def protocol_class() -> type:
    """uvicorn's HTTP protocol, as its "auto" picks it, with the header deadline."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return _h11()
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsWithDeadline(_Deadline, HttpToolsProtocol):
        def on_message_begin(self) -> None:
            self._arm()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

    return HttpToolsWithDeadline


def _h11() -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class H11WithDeadline(_Deadline, H11Protocol):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # between requests: this one's headers are not whole
                self._arm()
            else:
                self._disarm()

    return H11WithDeadline
