"""The async client's sockets: httpcore's network backend on asyncio's own transports.

httpcore runs its asyncio connections through anyio, whose cancel scopes, checkpoints
and stream wrappers around every read and write cost the async client about a fifth of
its CPU for an acquire and a release (docs/performance.md, "Speed tricks"). httpcore
takes any ``AsyncNetworkBackend``; this one is an ``asyncio.Protocol`` under a stream
with the behaviour httpcore's own has:

- ``read`` returns what has arrived, at most ``max_bytes``, waiting up to ``timeout``
  (``ReadTimeout``); ``b""`` at the end of the stream; ``ReadError`` when the connection
  failed. Past ``_HIGH_WATER`` bytes unread the transport stops reading, so a peer
  sending without end is held back by TCP, not buffered here.
- ``write`` hands the bytes to the transport and, while its buffer is over asyncio's high
  mark, waits for it to drain up to ``timeout`` (``WriteTimeout``); ``WriteError`` when
  the connection is gone.
- ``start_tls`` wraps the connection in TLS (``ConnectError`` when the handshake or the
  certificate fails, ``ConnectTimeout`` after ``timeout``).
- ``get_extra_info("is_readable")``, which httpcore asks before it reuses an idle
  keep-alive connection, is true once anything arrived or the peer closed, whether the
  loop has read it yet or not: such a connection is not reused.

It serves only the client's own default transport (``_http.async_own_transport``); an
injected ``transport=`` or ``client=``, a URL with credentials and a proxy from the
environment keep httpx's.
"""

from __future__ import annotations

import asyncio
import collections
import select
import ssl
from collections.abc import Iterable
from typing import Any, cast

import httpcore
import httpx

__all__ = ["AsyncioBackend", "asyncio_transport"]

#: Unread bytes past which the transport stops reading until ``read`` takes some.
_HIGH_WATER = 256 * 1024
#: httpx's default pool limits (``httpx.AsyncHTTPTransport``'s ``limits``).
_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)


def asyncio_transport(context: ssl.SSLContext) -> httpx.AsyncBaseTransport:
    """httpx's default async transport, with ``context`` for TLS and httpx's pool limits,
    its connections on ``AsyncioBackend``. Where httpx no longer keeps its pool as
    ``_pool``, its transport as it is."""
    transport = httpx.AsyncHTTPTransport(verify=context)
    if isinstance(getattr(transport, "_pool", None), httpcore.AsyncConnectionPool):
        transport._pool = httpcore.AsyncConnectionPool(
            ssl_context=context,
            max_connections=_LIMITS.max_connections,
            max_keepalive_connections=_LIMITS.max_keepalive_connections,
            keepalive_expiry=_LIMITS.keepalive_expiry,
            network_backend=AsyncioBackend(),
        )
    return transport


class _Protocol(asyncio.Protocol):
    """What arrived on a connection, for ``_Stream`` to read, and the transport's flow."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.unread = 0
        self.ended = False  # the peer closed its side, or the connection is gone
        self.failure: Exception | None = None
        self.paused = False  # reading stopped: past _HIGH_WATER unread
        self.arrived: asyncio.Future[None] | None = None
        self.drained: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport's subclasses, only its likes)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.unread += len(data)
        if self.unread > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake_reader()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.failure = exc
        self._wake_reader()
        self.resume_writing()  # a writer waiting for the drain learns of it

    def pause_writing(self) -> None:
        if self.drained is None:
            self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        drained, self.drained = self.drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def take(self, max_bytes: int) -> bytes:
        chunk = self.chunks.popleft()
        if len(chunk) > max_bytes:
            chunk, rest = chunk[:max_bytes], chunk[max_bytes:]
            self.chunks.appendleft(rest)
        self.unread -= len(chunk)
        if self.paused and self.unread <= _HIGH_WATER // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def _wake_reader(self) -> None:
        arrived = self.arrived
        if arrived is not None and not arrived.done():
            arrived.set_result(None)


class _Stream(httpcore.AsyncNetworkStream):
    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._loop = asyncio.get_running_loop()

    def _check_loop(self) -> None:
        """A connection serves the event loop it was opened on, as httpx's do: on another
        (a second ``asyncio.run`` with the same client), a RuntimeError at once."""
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError(
                "this connection was opened on another event loop: an AsyncLeaseClient "
                "serves one event loop"
            )

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._check_loop()
        protocol = self._protocol
        if not protocol.chunks and not protocol.ended:
            protocol.arrived = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout):
                    await protocol.arrived
            except TimeoutError:
                raise httpcore.ReadTimeout("timed out reading the response") from None
            finally:
                protocol.arrived = None
        if protocol.chunks:
            return protocol.take(max_bytes)
        if protocol.failure is not None:
            raise httpcore.ReadError(str(protocol.failure)) from protocol.failure
        return b""

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        self._check_loop()
        protocol = self._protocol
        if protocol.ended and protocol.failure is not None:
            raise httpcore.WriteError(str(protocol.failure)) from protocol.failure
        if self._transport.is_closing():
            raise httpcore.WriteError("the connection is closed")
        self._transport.write(buffer)
        drained = protocol.drained
        if drained is None:
            return
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(drained)
        except TimeoutError:
            raise httpcore.WriteTimeout("timed out writing the request") from None
        if protocol.failure is not None or self._transport.is_closing():
            raise httpcore.WriteError("the connection was lost while writing")

    async def aclose(self) -> None:
        if not self._loop.is_closed():  # (a closed loop's transports are past closing)
            self._transport.close()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                wrapped = await loop.start_tls(
                    self._transport, self._protocol, ssl_context, server_hostname=server_hostname
                )
        except TimeoutError:
            self._transport.close()
            raise httpcore.ConnectTimeout("timed out in the TLS handshake") from None
        except OSError as exc:  # ssl.SSLError and a certificate refused among them
            self._transport.close()
            raise httpcore.ConnectError(str(exc)) from exc
        if wrapped is None:  # the connection closed during the handshake
            raise httpcore.ConnectError("the connection closed during the TLS handshake")
        self._protocol.transport = wrapped
        return _Stream(self._protocol.transport, self._protocol)

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            protocol = self._protocol
            return bool(protocol.chunks) or protocol.ended or _readable(self._socket())
        if info == "socket":
            return self._socket()
        name = {"ssl_object": "ssl_object", "client_addr": "sockname", "server_addr": "peername"}
        return self._transport.get_extra_info(name[info]) if info in name else None

    def _socket(self) -> Any:
        """The connection's socket (asyncio's ``TransportSocket``, uvloop's like of it)."""
        return self._transport.get_extra_info("socket")


def _readable(sock: Any) -> bool:
    """Whether ``sock`` (a socket, or asyncio's stand-in for one) has something to read
    (data, or the peer's close) right now; true for a socket closed or gone."""
    if sock is None or sock.fileno() < 0:
        return True
    if hasattr(select, "poll"):  # any descriptor number, where select() stops at 1,024
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """httpcore's TCP connections on asyncio's transports (the module's docstring). The
    pool it serves is given no Unix socket (``uds``): httpcore's own ``connect_unix_socket``
    refuses."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        local = None if local_address is None else (local_address, 0)
        try:
            async with asyncio.timeout(timeout):
                transport, protocol = await loop.create_connection(
                    _Protocol, host, port, local_addr=local
                )
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"timed out connecting to {host}:{port}") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        sock = transport.get_extra_info("socket")
        for option in socket_options or ():
            sock.setsockopt(*option)
        return _Stream(transport, protocol)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
