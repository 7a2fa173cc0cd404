"""Slow and malformed clients, handled at the connection, below the ASGI app.

uvicorn sets no bound on how long a client may take to send a request's headers, so
clients trickling a header byte now and then could hold every connection slot.
``guard_protocol`` subclasses uvicorn's HTTP protocol (the ``http=`` class it takes)::

    connect, or a request's first byte          headers complete
    |<----------- request_timeout ----------->|
                                              app reads the body (bounded in read_body)
                                              |<----------- request_timeout ---------->|

- headers not complete in time get a JSON ``408 timeout``, and the connection is
  closed; headers that arrive in one read (every normal client) start no timer;
- a full send buffer must drain within ``request_timeout``, or the connection is dropped;
- a head (or a chunked body's trailer section) past ``MAX_HEAD_BYTES`` gets a JSON
  ``431``, after the answer being sent if any, and the connection is closed;
- malformed HTTP gets a JSON ``400 invalid``, not uvicorn's plain text.

On httptools, an upgrade offer the server does not take (``Upgrade: h2c``, which
``curl --http2`` and Java's HttpClient send) is ignored, as RFC 9110 section 7.8 allows
(``_IgnoredUpgrade``), and at most ``MAX_PIPELINED`` requests wait on one connection
(``_BoundedPipeline``). All of it relies on uvicorn's private API, as declared in
``UVICORN_INTERNALS``, which the server checks at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

import httptools
import orjson
from starlette.types import ASGIApp

from leasekeeper._errors import HeadersTooLarge, InvalidRequest, LeaseError, RequestTimeout
from leasekeeper.http._errors import status_code

if TYPE_CHECKING:
    # The mixins are typed as the protocol they are mixed into (at run time, objects).
    from uvicorn._types import ASGI3Application
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Uvicorn
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
else:
    _Uvicorn = object

__all__ = [
    "MAX_HEAD_BYTES",
    "MAX_PIPELINED",
    "UVICORN_INTERNALS",
    "guard_protocol",
    "missing_uvicorn_internals",
    "raw_error_response",
    "serve_connection_limit_with",
    "uvicorn_protocol",
]

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
#: Bytes of an unfinished request head past which it is refused (llhttp sets no bound).
MAX_HEAD_BYTES = 65_536
#: Pipelined requests that may wait on one connection; one past them, and every later
#: one, is not run; those waiting are answered, then the connection is closed.
MAX_PIPELINED = 32


@dataclass(frozen=True, slots=True)
class _Relied:
    """In one uvicorn.protocols.http module: the protocol class, the methods the guard
    overrides or calls, and the attributes it uses on a protocol and on its cycle."""

    protocol: str
    methods: str
    attributes: str
    cycle: str


#: uvicorn's private API this module relies on, and each module's global
#: ``service_unavailable`` (replaced by ``serve_connection_limit_with``).
UVICORN_INTERNALS: Final = {
    "httptools_impl": _Relied(
        "HttpToolsProtocol",
        methods="on_response_complete send_400_response shutdown _start_asgi_task"
        " _unset_keepalive_if_required _should_upgrade handle_websocket_upgrade"
        " on_message_begin on_url on_header on_headers_complete on_body on_message_complete",
        attributes="transport loop flow cycle pipeline parser logger scope headers url",
        cycle="response_complete more_body message_event disconnected transport keep_alive",
    ),
    "h11_impl": _Relied(
        "H11Protocol",
        methods="on_response_complete send_400_response",
        attributes="transport loop flow cycle",
        cycle="response_complete more_body",
    ),
}


def missing_uvicorn_internals(protocol: object) -> list[str]:
    """What of ``UVICORN_INTERNALS`` the installed uvicorn lacks, for a protocol class
    (global, methods) or a protocol with a request begun (attributes too)."""
    cls = protocol if isinstance(protocol, type) else type(protocol)
    for name, relied in UVICORN_INTERNALS.items():
        where = f"uvicorn.protocols.http.{name}"
        if any(c.__module__ == where and c.__name__ == relied.protocol for c in cls.__mro__):
            break
    else:
        return [f"{cls.__module__}.{cls.__name__} (not a protocol of uvicorn's named here)"]
    missing = []
    if not hasattr(importlib.import_module(where), "service_unavailable"):
        missing.append(f"{where}.service_unavailable")
    prefix = f"{where}.{relied.protocol}"
    missing += [f"{prefix}.{m}" for m in relied.methods.split() if not hasattr(cls, m)]
    if protocol is not cls:
        missing += [
            f"{prefix}().{a}" for a in relied.attributes.split() if not hasattr(protocol, a)
        ]
        cycle = getattr(protocol, "cycle", None)
        missing += [f"{prefix}().cycle.{a}" for a in relied.cycle.split() if not hasattr(cycle, a)]
    return missing


def uvicorn_protocol() -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol (httptools is a dependency), for ``guard_protocol``."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return HttpToolsProtocol


def serve_connection_limit_with(app: ASGIApp) -> None:
    """Make uvicorn answer past ``limit_concurrency`` with ``app`` rather than its
    plain-text 503 (it looks up its module global ``service_unavailable`` per request)."""
    for name in UVICORN_INTERNALS:
        module = importlib.import_module(f"uvicorn.protocols.http.{name}")
        if not hasattr(module, "service_unavailable"):
            raise RuntimeError(_refusal([f"{module.__name__}.service_unavailable"]))
        module.service_unavailable = app  # type: ignore[attr-defined]


def _refusal(missing: list[str]) -> str:
    from uvicorn import __version__

    return (
        f"uvicorn {__version__} lacks {', '.join(missing)}, which leasekeeper's HTTP "
        "protocol relies on: install the uvicorn series pyproject.toml names"
    )


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
_HEAD_TOO_LARGE = raw_error_response(
    HeadersTooLarge(f"The request headers are larger than {MAX_HEAD_BYTES} bytes")
)
#: httptools reads a URL's parts with 16-bit offsets: a longer target cannot be parsed.
_MAX_TARGET_BYTES = 65_535
_TARGET_TOO_LARGE = raw_error_response(
    HeadersTooLarge(
        f"The request's target (its path and query) is longer than {_MAX_TARGET_BYTES} bytes"
    )
)


class _SlowClientGuard(_Uvicorn):
    """Mixed in before uvicorn's protocol class (either); see the module docstring."""

    request_timeout: float  # set by guard_protocol
    on_timeout: Callable[[], None] | None
    #: Called when the server begins to stop (each connection is told): it answers the
    #: requests that wait (``LeaseService.stop_waiting``) rather than keep the stop waiting.
    on_stop: Callable[[], None] | None = None
    _lk_timer: asyncio.TimerHandle | None = None
    #: Set while the send buffer is full: the client must take its answers by then.
    _lk_write_timer: asyncio.TimerHandle | None = None
    #: Bytes received since the last request began, while its successor's head had not ended.
    _lk_head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._lk_arm()

    def data_received(self, data: bytes) -> None:
        waiting, before = self._lk_waiting(), self.cycle
        following = self._lk_head_may_follow(waiting)
        super().data_received(data)
        if self.cycle is not before:  # headers complete: a request began
            self._lk_disarm()
            self._lk_head_bytes = 0
        elif following and not self.transport.is_closing():
            self._lk_head_bytes += len(data)
            if self._lk_head_bytes > MAX_HEAD_BYTES:
                self._lk_head_too_large()
            elif waiting and self._lk_timer is None:
                self._lk_arm()  # the first bytes of a request: its headers are on the clock

    def _lk_head_may_follow(self, waiting: bool) -> bool:
        """Whether bytes arriving now may be a request's head: once the current request
        has all its body, what follows is the next head, bounded too (on h11 the rest
        of a body answered early counts as well)."""
        return waiting or not self.cycle.more_body

    def on_response_complete(self) -> None:
        before = self.cycle
        super().on_response_complete()
        if self.cycle is not before:  # h11 parsed a waiting head: a request began
            self._lk_head_bytes = 0
        elif self._lk_head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            self._lk_head_too_large()  # the answer it waited for is sent

    def connection_lost(self, exc: Exception | None) -> None:
        self._lk_disarm()
        if self._lk_write_timer is not None:
            self._lk_write_timer.cancel()
            self._lk_write_timer = None
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._lk_write_timer is None:
            self._lk_write_timer = self.loop.call_later(self.request_timeout, self._lk_drop)

    def resume_writing(self) -> None:
        if self._lk_write_timer is not None:
            self._lk_write_timer.cancel()
            self._lk_write_timer = None
        super().resume_writing()

    def _lk_drop(self) -> None:
        """Abort: ``close`` would wait for the client to read what it was sent."""
        self._lk_write_timer = None
        self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_MALFORMED)
        self.transport.close()

    def _lk_head_too_large(self) -> None:
        """The JSON 431 and close; while an answer is being sent, reading pauses and
        the 431 follows it (``on_response_complete``)."""
        if not self._lk_waiting():
            self.flow.pause_reading()
            return
        self._lk_disarm()
        self.transport.write(_HEAD_TOO_LARGE)
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

    def shutdown(self) -> None:
        if self.on_stop is not None:
            self.on_stop()
        super().shutdown()


class _IgnoredUpgrade(_Uvicorn):
    """Mixed in before uvicorn's httptools protocol: a request offering an upgrade the
    server does not take is served as if it had not offered it, body included (llhttp
    stops at its headers and uvicorn loses the body: uvicorn#2722). A new parser gets
    the head again without the offer, then the bytes after it. WebSocket upgrades and
    ``CONNECT`` are left to uvicorn."""

    _lk_in_body: bool  # _BoundedPipeline's

    def data_received(self, data: bytes) -> None:
        # uvicorn's own, but looping past upgrades it does not take (_lk_ignore_upgrade).
        self._unset_keepalive_if_required()
        unread = memoryview(data)
        while unread:
            try:
                self.parser.feed_data(unread)
            except httptools.HttpParserError:
                if len(getattr(self, "url", b"")) > _MAX_TARGET_BYTES:  # set per request
                    # uvicorn's parse_url failed: refused as too large, not malformed.
                    self.transport.write(_TARGET_TOO_LARGE)
                    self.transport.close()
                    return
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            except httptools.HttpParserUpgrade as upgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                elif self.scope["method"] == "CONNECT":  # what follows is a tunnel's, not a body
                    self.logger.warning("Unsupported upgrade request.")
                else:
                    self._lk_ignore_upgrade()
                    unread = unread[upgrade.args[0] :]  # the rest of that request, and on
                    continue
            return

    def _lk_ignore_upgrade(self) -> None:
        """A new parser, given the head without the upgrade offer, for what follows."""
        head = [self.scope["method"].encode("ascii"), b" ", self.url]
        head += [b" HTTP/", self.scope["http_version"].encode("ascii"), b"\r\n"]
        for name, value in self.headers:
            if name == b"connection":
                tokens = [t for t in value.split(b",") if t.strip().lower() != b"upgrade"]
                value = b",".join(tokens)
            if name != b"upgrade" and value.strip():
                head += [name, b": ", value, b"\r\n"]
        head.append(b"\r\n")
        # The parser told the request its body was over: it was not.
        self.cycle.more_body = True
        self._lk_in_body = True
        self.cycle.message_event.clear()
        self.parser = httptools.HttpRequestParser(_AfterReplayedHead(self))
        # As uvicorn's own parser: data after a request that closes is no error.
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.parser.feed_data(b"".join(head))  # no offer in it: never raises an upgrade


class _BoundedPipeline(_SlowClientGuard):
    """The slow-client guard on uvicorn's httptools protocol, with at most
    ``MAX_PIPELINED`` requests waiting on a connection (uvicorn's queue is unbounded).

    Reading resumes only once no request waits; a request past the bound, and every
    later one, is dropped unrun, and after the waiting ones are answered the connection
    ends without a reset (``_lk_linger``), as does one whose answer closes it while the
    client's bytes may be unread, unless the server is stopping. The rest of a body
    answered early is read and dropped within the request timeout. The running request
    is remembered: on a lost connection uvicorn tells only the one parsed last.
    """

    #: A request was dropped: none after it runs; the connection ends after those waiting.
    _lk_overflowed = False
    #: The answers are all sent: what the client sends now is read and dropped.
    _lk_lingering = False
    #: The request whose application runs (uvicorn keeps only the last parsed).
    _lk_running: RequestResponseCycle | None = None
    #: A request asked to close the connection: it ends without a reset after that answer.
    _lk_closing = False
    #: Every request's transport on this connection (set in ``connection_made``).
    _lk_request_transport: _RequestTransport | None = None
    #: The parser is inside a request's body, answered or not: those bytes are no head.
    _lk_in_body = False
    #: Set while the rest of the body of a request answered early is on its way.
    _lk_body_timer: asyncio.TimerHandle | None = None
    #: The server is stopping: a connection its answer ends is closed at once.
    _lk_stopping = False
    #: A chunk's size line is parsed and none of its data yet (after size 0: trailers).
    _lk_chunk_bare = False
    #: Bytes of reads that went wholly to a chunked body's trailers, bounded as a head is.
    _lk_trailer_bytes = 0
    #: The parser handed over body bytes in the read being parsed.
    _lk_body_seen = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._lk_request_transport = _RequestTransport(self)

    def data_received(self, data: bytes) -> None:
        if self._lk_lingering:
            return
        after_size_line = self._lk_chunk_bare
        self._lk_body_seen = False
        super().data_received(data)
        if after_size_line and self._lk_chunk_bare and not self._lk_body_seen:
            # All of it after a chunk's size line and none of it data: the trailers.
            self._lk_trailer_bytes += len(data)
            if self._lk_trailer_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._lk_trailers_too_large()

    def on_body(self, body: bytes) -> None:
        self._lk_chunk_bare = False
        self._lk_trailer_bytes = 0
        self._lk_body_seen = True
        super().on_body(body)

    def on_chunk_header(self) -> None:
        self._lk_chunk_bare = True

    def on_chunk_complete(self) -> None:
        self._lk_chunk_bare = False
        self._lk_trailer_bytes = 0

    def _lk_trailers_too_large(self) -> None:
        """Trailers past ``MAX_HEAD_BYTES``: nothing more is read. A request answered
        early ends the connection; a running one gets its body's 408 in time."""
        if self._lk_body_timer is not None:
            self._lk_body_timer.cancel()
            self._lk_body_late()
        else:
            self.flow.pause_reading()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        self._lk_running = cycle
        super()._start_asgi_task(cycle, app)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lk_body_arrived()
        if self._lk_request_transport is not None:
            # Break the protocol <-> transport cycle, or closed connections wait for
            # the (rare) cyclic garbage collection.
            self._lk_request_transport.close = self.transport.close
        running = self._lk_running
        if running is not None and not running.response_complete:
            running.disconnected = True  # its answer is not written to a closed connection
            running.message_event.set()
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        waiting = len(self.pipeline)
        super().on_headers_complete()
        if len(self.pipeline) > waiting and (self._lk_overflowed or waiting >= MAX_PIPELINED):
            self._lk_overflowed = True
            self.pipeline.popleft()  # this one (uvicorn adds on the left): never run
        cycle = self.cycle
        if cycle is not None and cycle.transport is self.transport:  # a request began
            cycle.transport = cast("asyncio.Transport", self._lk_request_transport)
            if not cycle.keep_alive:
                # It asks to close: uvicorn closes after it, maybe with requests unread.
                self._lk_closing = True
        self._lk_in_body = True  # until on_message_complete, at once when there is none

    def on_message_complete(self) -> None:
        answered = self._lk_body_timer is not None  # the rest of a body answered early
        self._lk_body_arrived()
        super().on_message_complete()
        if answered and self._lk_timer is None and not self.transport.is_closing():
            # The next request's head is on the clock from now, as on a new connection.
            self._lk_arm()

    def _lk_head_may_follow(self, waiting: bool) -> bool:
        return not self._lk_in_body

    def _lk_body_arrived(self) -> None:
        self._lk_in_body = False
        if self._lk_body_timer is not None:
            self._lk_body_timer.cancel()
            self._lk_body_timer = None

    def _lk_body_late(self) -> None:
        self._lk_body_timer = None
        self._lk_linger()

    def shutdown(self) -> None:
        self._lk_stopping = True
        super().shutdown()

    def on_response_complete(self) -> None:
        if self._lk_lingering:  # the connection is ending: nothing more runs
            return
        if self._lk_overflowed and not self.pipeline:
            self._lk_linger()
            return
        if self._lk_body_timer is None and self._lk_body_coming():
            # Answered before all its body arrived: the rest must come within the timeout.
            self._lk_body_timer = self.loop.call_later(self.request_timeout, self._lk_body_late)
        super().on_response_complete()
        if (self.pipeline or self._lk_overflowed) and not self.transport.is_closing():
            self.flow.pause_reading()  # uvicorn resumed: not while requests still wait

    def _lk_body_coming(self) -> bool:
        """The request just answered has not received all its body."""
        running = self._lk_running
        return running is not None and bool(running.more_body)

    def _lk_close(self) -> None:
        """A request's transport is closed: lingering when the client's bytes may be
        unread (unless the server is stopping), otherwise at once."""
        if not self._lk_stopping and (self._lk_closing or self._lk_in_body or self.pipeline):
            self._lk_linger()
        else:
            self.transport.close()

    def _lk_linger(self) -> None:
        """End the connection without a reset (which would lose undelivered answers):
        ``write_eof``, read and drop what the client sends, close when it does or after
        the request timeout."""
        if self._lk_lingering or self.transport.is_closing():
            return
        self._lk_lingering = True
        self._lk_disarm()  # no 408 after the end of stream
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.flow.resume_reading()
        self.loop.call_later(self.request_timeout, self.transport.close)


class _RequestTransport:
    """The transport a connection's requests answer on; its ``close`` is
    ``_BoundedPipeline._lk_close``, which lingers rather than reset."""

    __slots__ = ("close", "is_closing", "write")

    def __init__(self, protocol: _BoundedPipeline) -> None:
        self.write = protocol.transport.write
        self.is_closing = protocol.transport.is_closing
        self.close = protocol._lk_close


class _AfterReplayedHead:
    """Callbacks for ``_IgnoredUpgrade``'s new parser: the replayed head is dropped,
    everything after it goes to the protocol."""

    __slots__ = ("_in_head", "_protocol")

    def __init__(self, protocol: Any) -> None:
        self._protocol = protocol
        self._in_head = True

    def __getattr__(self, name: str) -> Any:  # on_body, on_chunk_*, on_message_complete
        return getattr(self._protocol, name)

    def on_message_begin(self) -> None:
        if not self._in_head:
            self._protocol.on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self._in_head:
            self._protocol.on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            self._protocol.on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._in_head:
            self._in_head = False
        else:
            self._protocol.on_headers_complete()


def guard_protocol(
    base: type[asyncio.Protocol],
    request_timeout: float,
    on_timeout: Callable[[], None] | None = None,
    on_stop: Callable[[], None] | None = None,
) -> type[asyncio.Protocol]:
    """``base`` (uvicorn's httptools or h11 protocol) with the slow-client guard, and on
    httptools with upgrade offers ignored and the pipeline bounded (h11 does both
    itself: it ignores offers, and parses no request before the last is answered).

    Raises ``RuntimeError`` naming what the installed uvicorn lacks of
    ``UVICORN_INTERNALS``.
    """
    missing = missing_uvicorn_internals(base)
    if missing:
        raise RuntimeError(_refusal(missing))
    hook = staticmethod(on_timeout) if on_timeout is not None else None
    stop = staticmethod(on_stop) if on_stop is not None else None
    namespace = {"request_timeout": request_timeout, "on_timeout": hook, "on_stop": stop}
    mixins: tuple[type, ...] = (_SlowClientGuard,)
    if hasattr(base, "on_headers_complete"):  # httptools' callbacks: uvicorn's httptools protocol
        mixins = (_BoundedPipeline, _IgnoredUpgrade)
    guarded: type[asyncio.Protocol] = type(f"Guarded{base.__name__}", (*mixins, base), namespace)
    return guarded
