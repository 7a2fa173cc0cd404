"""Slow and malformed clients, handled at the connection, below the ASGI app.

uvicorn closes a connection that idles *between* requests (keep-alive), but it
sets no bound on how long a client may take to send a request's headers: a client
that connects and sends nothing, or trickles a header byte every few seconds,
holds one of the ``LEASEKEEPER_MAX_CONNECTIONS`` slots for as long as it likes,
and a thousand of them lock everybody out. ``guard_protocol`` subclasses
uvicorn's HTTP protocol (the ``http=`` class uvicorn accepts) so that::

    connect, or a request's first byte          headers complete
    |<----------- request_timeout ----------->|
                                              app reads the body (bounded in read_body)
                                              |<----------- request_timeout ---------->|

headers not complete in time get a JSON ``408 timeout`` and the connection is
closed. A request whose headers arrive in one packet (every normal client) never
starts a timer. Malformed HTTP gets a JSON ``400 invalid`` instead of uvicorn's
plain text, so every answer is a JSON object.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson

from leasekeeper._errors import InvalidRequest, LeaseError, RequestTimeout
from leasekeeper.http._errors import status_code

__all__ = ["guard_protocol", "raw_error_response"]

_REASONS = {400: b"Bad Request", 408: b"Request Timeout"}


def raw_error_response(error: LeaseError) -> bytes:
    """A whole HTTP/1.1 response for ``error`` that closes the connection."""
    body = orjson.dumps(error.body())
    code = status_code(error)
    return b"".join(
        [
            b"HTTP/1.1 %d %s\r\n" % (code, _REASONS.get(code, b"Error")),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"cache-control: no-store\r\n",
            b"x-content-type-options: nosniff\r\n",
            b"connection: close\r\n\r\n",
            body,
        ]
    )


_TIMED_OUT = raw_error_response(
    RequestTimeout("The request headers were not received in time; the connection is closed")
)
_MALFORMED = raw_error_response(InvalidRequest("The request is not valid HTTP/1.1"))


class _SlowClientGuard:
    """Mixed in before uvicorn's protocol class; see the module docstring."""

    # Set by guard_protocol, and by uvicorn's protocol classes.
    request_timeout: float
    on_timeout: Callable[[], None] | None
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any
    _lk_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._lk_arm()

    def data_received(self, data: bytes) -> None:
        waiting, before = self._lk_waiting(), self.cycle
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not before:  # headers complete: a request began
            self._lk_disarm()
        elif waiting and self._lk_timer is None and not self.transport.is_closing():
            self._lk_arm()  # the first bytes of a request: its headers are on the clock

    def connection_lost(self, exc: Exception | None) -> None:
        self._lk_disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_MALFORMED)
        self.transport.close()

    def _lk_waiting(self) -> bool:
        """True when no request is in progress: the connection awaits headers."""
        return self.cycle is None or bool(self.cycle.response_complete)

    def _lk_arm(self) -> None:
        self._lk_timer = self.loop.call_later(self.request_timeout, self._lk_expire)

    def _lk_disarm(self) -> None:
        if self._lk_timer is not None:
            self._lk_timer.cancel()
            self._lk_timer = None

    def _lk_expire(self) -> None:
        self._lk_timer = None
        if self._lk_waiting() and not self.transport.is_closing():
            if self.on_timeout is not None:
                self.on_timeout()
            self.transport.write(_TIMED_OUT)
            self.transport.close()


def guard_protocol(
    base: type[asyncio.Protocol],
    request_timeout: float,
    on_timeout: Callable[[], None] | None = None,
) -> type[asyncio.Protocol]:
    """``base`` (uvicorn's httptools or h11 protocol) with the slow-client guard."""
    hook = staticmethod(on_timeout) if on_timeout is not None else None
    namespace = {"request_timeout": request_timeout, "on_timeout": hook}
    guarded: type[asyncio.Protocol] = type(
        f"Guarded{base.__name__}", (_SlowClientGuard, base), namespace
    )
    return guarded
