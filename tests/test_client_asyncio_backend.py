"""The async client's own transport: httpx's, its connections on asyncio's transports
(``leasekeeper.client._asyncio_backend``), against small servers of the tests' own that
answer, stall, cut, reset, refuse to read, or speak TLS."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pytest
import uvloop

from leasekeeper import AsyncLeaseClient
from leasekeeper.client._asyncio_backend import AsyncioBackend, asyncio_transport
from tests._server import free_port, running_server
from tests._tools import self_signed

Runner = Callable[[Callable[[], Coroutine[Any, Any, None]]], None]
#: What a server does with one request: (its head and body, the stream to answer on).
Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]
NAMESPACE = "ns_" + "A" * 43


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Runner:
    """Runs a scenario on asyncio's own event loop, or on uvloop's (uvicorn's, where the
    middleware's client runs), whose transports are not asyncio's classes."""
    factory = uvloop.new_event_loop if request.param == "uvloop" else None

    def running(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main())

    return running


def answer(body: bytes, status: str = "200 OK") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def ok(request: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(answer(b'{"ok":true,"namespace":"' + NAMESPACE.encode() + b'"}'))


class Canned:
    """An HTTP/1.1 server on 127.0.0.1 passing each request to ``handler``: it counts
    the connections it accepted, and sets ``ended`` when one ends."""

    url = ""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.ended = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                request = head + await reader.readexactly(length)
                await self.handler(request, writer)
                if writer.is_closing():
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.ended.set()


@contextlib.asynccontextmanager
async def canned(handler: Handler, tls: ssl.SSLContext | None = None) -> AsyncIterator[Canned]:
    server = Canned(handler)
    listening = await asyncio.start_server(server.serve, "127.0.0.1", 0, ssl=tls)
    port = listening.sockets[0].getsockname()[1]
    server.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        yield server
    finally:
        listening.close()
        for writer in server.writers:
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()


def client(context: ssl.SSLContext | None = None, **timeouts: float) -> httpx.AsyncClient:
    transport = asyncio_transport(context or ssl.create_default_context())
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5, **timeouts))


def test_requests_one_after_another_share_one_connection(run: Runner) -> None:
    async def main() -> None:
        async with canned(ok) as server, client() as http:
            for _ in range(3):
                response = await http.post(server.url, content=b"{}")
                assert response.status_code == 200 and NAMESPACE in response.text
        assert server.connections == 1

    run(main)


def test_a_connection_the_server_closed_while_idle_is_not_reused(run: Runner) -> None:
    """The server closes after each answer without saying so: httpcore asks the stream
    whether an idle connection is readable before sending on it again, and a closed
    one is; the next request goes out on a new connection, not into the closed one."""

    async def closing(request: bytes, writer: asyncio.StreamWriter) -> None:
        await ok(request, writer)
        await writer.drain()
        writer.close()

    async def main() -> None:
        async with canned(closing) as server, client() as http:
            url = server.url
            assert (await http.post(url, content=b"{}")).status_code == 200
            await server.ended.wait()
            assert (await http.post(url, content=b"{}")).status_code == 200
        assert server.connections == 2

    run(main)


def test_an_idle_connection_is_readable_once_the_peer_closed_it(run: Runner) -> None:
    async def main() -> None:
        accepted: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()

        async def keep(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await accepted.put(writer)

        listening = await asyncio.start_server(keep, "127.0.0.1", 0)
        port = listening.sockets[0].getsockname()[1]
        stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
        peer = await accepted.get()
        assert stream.get_extra_info("is_readable") is False
        peer.close()
        await peer.wait_closed()
        # Before or after the loop has read the close: readable either way.
        assert stream.get_extra_info("is_readable") is True
        assert await stream.read(100, timeout=5) == b""
        await stream.aclose()
        listening.close()

    run(main)


def test_an_answer_that_does_not_come_is_a_read_timeout(run: Runner) -> None:
    async def silent(request: bytes, writer: asyncio.StreamWriter) -> None:
        await asyncio.Event().wait()

    async def main() -> None:
        async with canned(silent) as server, client(read=0.3) as http:
            began = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                await http.post(server.url, content=b"{}")
            assert 0.25 < time.monotonic() - began < 3

    run(main)


def test_an_answer_cut_short_is_a_transport_error(run: Runner) -> None:
    async def cut(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(answer(b"x" * 100)[:-90])
        await writer.drain()
        writer.close()

    async def main() -> None:
        async with canned(cut) as server, client() as http:
            with pytest.raises(httpx.RemoteProtocolError):
                await http.post(server.url, content=b"{}")

    run(main)


def test_a_connection_reset_is_a_read_error(run: Runner) -> None:
    async def reset(request: bytes, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def main() -> None:
        async with canned(reset) as server, client() as http:
            with pytest.raises(httpx.ReadError):
                await http.post(server.url, content=b"{}")

    run(main)


def test_a_port_nobody_listens_on_is_a_connect_error(run: Runner) -> None:
    async def main() -> None:
        async with client() as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(f"http://127.0.0.1:{free_port()}/")

    run(main)


def test_a_large_answer_stops_the_reading_and_arrives_whole(run: Runner) -> None:
    """Past 256 KiB unread the transport stops reading (TCP holds the rest back) and
    starts again as the stream is read: every byte arrives, in order."""
    body = bytes(range(256)) * (12 * 1024 + 7)

    async def main() -> None:
        async def large(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(body)
            await writer.drain()
            writer.close()

        listening = await asyncio.start_server(large, "127.0.0.1", 0)
        port = listening.sockets[0].getsockname()[1]
        stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
        protocol = stream._protocol  # type: ignore[attr-defined]
        async with asyncio.timeout(10):
            while not protocol.paused:  # noqa: ASYNC110 - a flag of the protocol's, no event
                await asyncio.sleep(0.001)  # the server sends on until reading stops
        assert protocol.unread < len(body) // 2
        parts = []
        while chunk := await stream.read(65536, timeout=5):
            assert len(chunk) <= 65536
            parts.append(chunk)
        assert b"".join(parts) == body
        await stream.aclose()
        listening.close()

    run(main)


def test_a_peer_that_does_not_read_is_a_write_timeout(run: Runner) -> None:
    async def main() -> None:
        accepted: list[asyncio.StreamWriter] = []

        async def deaf(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer)  # and never reads

        listening = await asyncio.start_server(deaf, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}/"
        async with client(write=0.3) as http:
            with pytest.raises(httpx.WriteTimeout):
                await http.post(url, content=b"x" * (64 << 20))
        listening.close()
        for writer in accepted:
            writer.close()

    run(main)


def test_tls_with_a_trusted_certificate_and_not_with_another(tmp_path: Path, run: Runner) -> None:
    cert, key = self_signed(tmp_path)
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)

    async def main() -> None:
        async with canned(ok, tls=server_side) as server:
            url = server.url
            async with client(ssl.create_default_context(cafile=str(cert))) as http:
                response = await http.post(url, content=b"{}")
                assert response.status_code == 200 and NAMESPACE in response.text
                assert (await http.post(url, content=b"{}")).status_code == 200
            assert server.connections == 1
            async with client(ssl.create_default_context()) as untrusting:
                with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await untrusting.post(url, content=b"{}")

    run(main)


def test_the_async_client_sends_its_own_requests_on_asyncio_and_closes_them(run: Runner) -> None:
    async def main() -> None:
        async with canned(ok) as server:
            lk = AsyncLeaseClient(server.url)
            assert lk._direct is not None and lk._direct.own is lk._direct.transport
            pool = lk._direct.own._pool
            assert isinstance(pool, httpcore.AsyncConnectionPool)
            assert isinstance(pool._network_backend, AsyncioBackend)
            assert await lk.create_namespace() == NAMESPACE
            assert await lk.create_namespace() == NAMESPACE
            assert server.connections == 1
            await lk.aclose()
            await asyncio.wait_for(server.ended.wait(), 5)  # its connection was closed

    run(main)


def test_an_injected_transport_or_a_proxy_from_the_environment_is_used_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mock = httpx.MockTransport(lambda request: httpx.Response(500))
    injected = AsyncLeaseClient("http://leases.invalid:8787", transport=mock)
    assert injected._direct is not None and injected._direct.own is None
    assert injected._direct.transport is mock
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    proxied = AsyncLeaseClient("http://leases.invalid:8787")
    assert proxied._direct is not None and proxied._direct.own is None
    assert proxied._direct.transport is not proxied._http._transport  # the proxy's mount
    asyncio.run(injected.aclose())
    asyncio.run(proxied.aclose())


def test_importing_leasekeeper_loads_no_httpcore_before_a_client_is_made() -> None:
    """httpcore (and anyio with it) costs 12 ms to import: ``import leasekeeper`` (the CLI's
    start, an app importing the middleware) leaves it to httpx, which loads it when a
    client makes its transport, as the async client does for its own."""
    code = (
        "import sys, leasekeeper\n"
        "before = 'httpcore' in sys.modules\n"
        "leasekeeper.AsyncLeaseClient('http://127.0.0.1:9')\n"
        "print(before, 'httpcore' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["False", "True"]


@pytest.mark.slow
def test_a_client_used_on_a_second_event_loop_says_so_at_once(tmp_path: Path) -> None:
    """As with httpx's own transports, a client serves one event loop: a second
    ``asyncio.run`` with the same client gets a RuntimeError at once, not a read that
    waits out its timeout for an answer the first loop would have read."""
    with running_server("memory://", tmp_path / "server.log") as server:
        lk = AsyncLeaseClient(server.url, timeout=5)
        with asyncio.Runner() as first:
            assert first.run(lk.create_namespace()).startswith("ns_")
            began = time.monotonic()
            with pytest.raises(RuntimeError, match="another event loop"):
                asyncio.run(lk.create_namespace())
            assert time.monotonic() - began < 1
            first.run(lk.aclose())
