"""Abuse: slow clients are cut off, floods are refused, and a normal client is still served.

Defaults (SPEC.md): namespace minting is limited per address (10/s, bursts of 100);
per-address and per-namespace request limits exist but are off until an operator
switches them on (workers behind one NAT share an address). Slow clients get
``LEASEKEEPER_REQUEST_TIMEOUT_SECONDS`` to send their headers, and again their body.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import json
import random
import re
import select
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import given
from hypothesis import strategies as st
from starlette.testclient import TestClient
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from leasekeeper import LeaseService, Settings
from leasekeeper._asgi import _larger_than
from leasekeeper._limits import RateLimiter, client_address
from leasekeeper.http import create_app
from leasekeeper.http._protocol import (
    MAX_PIPELINED,
    guard_protocol,
    missing_uvicorn_internals,
    serve_connection_limit_with,
)
from leasekeeper.store import MemoryStore
from tests._server import Server, free_port, running_server
from tests.conftest import FakeMonotonic, metric

BASE = "/services/v1"


# -- floods (in process, two client addresses) -------------------------------------------------


def clients(monotonic: FakeMonotonic, **settings: Any) -> tuple[TestClient, TestClient]:
    app = create_app(
        LeaseService(MemoryStore()), Settings(**settings), monotonic=monotonic, run_cleanup=False
    )
    attacker = TestClient(app, client=("203.0.113.66", 4000))
    normal = TestClient(app, client=("198.51.100.7", 5000))
    return attacker, normal


def serves_normally(client: TestClient, ns: str | None = None) -> None:
    """A normal client's whole lease cycle goes through."""
    ns = ns or client.post(f"{BASE}/lease/namespace").json()["namespace"]
    lease = client.post(f"{BASE}/lease", json={"namespace": ns, "key": "job"})
    assert lease.status_code == 201, lease.text
    owner = {"namespace": ns, "key": "job", "owner_token": lease.json()["owner_token"]}
    assert client.post(f"{BASE}/lease/renew", json=owner).status_code == 200
    done = client.post(f"{BASE}/lease/complete", json={**owner, "result": 1})
    assert done.status_code == 200


def test_a_mint_flood_is_refused_while_another_client_mints_and_works(
    monotonic: FakeMonotonic,
) -> None:
    """With the default limits, 150 mints from one address get 100 namespaces and 50 429s."""
    attacker, normal = clients(monotonic)
    codes = [attacker.post(f"{BASE}/lease/namespace").status_code for _ in range(150)]
    assert codes.count(201) == 100 and codes.count(429) == 50
    refused = attacker.post(f"{BASE}/lease/namespace")
    assert refused.headers["retry-after"] == "1" and refused.json()["status"] == "rate_limited"
    why = "Too many namespaces minted from this address; retry after 1 second"
    assert refused.json()["error"] == why
    serves_normally(normal)


def test_a_request_flood_is_refused_when_the_address_limit_is_on(
    monotonic: FakeMonotonic,
) -> None:
    """LEASEKEEPER_ADDRESS_RATE switched on: one address over its burst gets 429, others not."""
    attacker, normal = clients(monotonic, address_rate=25.0, address_burst=50)
    ns = "ns_" + "F" * 42 + "A"
    codes = [
        attacker.post(f"{BASE}/lease", json={"namespace": ns, "key": f"k{i}"}).status_code
        for i in range(150)
    ]
    assert codes.count(201) == 50 and codes.count(429) == 100
    serves_normally(normal)
    monotonic.advance(1)  # 25 tokens back
    assert attacker.post(f"{BASE}/lease", json={"namespace": ns, "key": "x"}).status_code == 201


def test_one_ipv6_host_rotating_through_its_64_shares_one_budget(
    monotonic: FakeMonotonic,
) -> None:
    """An IPv6 host usually holds a whole /64 and can send from any address in it: the
    limits count it by its /64, so 150 mints from 150 of its addresses get 100 namespaces
    (the burst), while the next /64 mints normally. An IPv4-mapped address is its IPv4."""
    app = create_app(LeaseService(MemoryStore()), Settings(), monotonic=monotonic)
    codes = [
        TestClient(app, client=(f"2001:db8:1:2::{i + 1:x}", 4000))
        .post(f"{BASE}/lease/namespace")
        .status_code
        for i in range(150)
    ]
    assert codes.count(201) == 100 and codes.count(429) == 50
    serves_normally(TestClient(app, client=("2001:db8:1:3::1", 4000)))
    mapped = TestClient(app, client=("::ffff:192.0.2.9", 4000))
    plain = TestClient(app, client=("192.0.2.9", 4000))
    assert [mapped.post(f"{BASE}/lease/namespace").status_code for _ in range(100)] == [201] * 100
    assert plain.post(f"{BASE}/lease/namespace").status_code == 429


def test_a_64_is_counted_whole_whatever_the_interface_id(monotonic: FakeMonotonic) -> None:
    """The /64 is the address's first 64 bits: addresses of one /64 that differ anywhere in
    their last 64 (not just in the last few, as SLAAC privacy addresses do) share one
    budget, and the /64 next to it has its own."""
    app = create_app(LeaseService(MemoryStore()), Settings(), monotonic=monotonic)
    rng = random.Random(64)
    codes = []
    for _ in range(101):
        interface = rng.getrandbits(64) | 1 << 63  # the top bit set: far from ::1
        host = str(ipaddress.IPv6Address(0x2001_0DB8_0001_0002 << 64 | interface))
        codes.append(TestClient(app, client=(host, 4000)).post(f"{BASE}/lease/namespace"))
    assert [c.status_code for c in codes] == [201] * 100 + [429]
    assert client_address({"client": ("2001:db8:1:2:ffff:ffff:ffff:ffff", 1)}) == (
        "2001:db8:1:2::/64"
    )
    neighbour = TestClient(app, client=("2001:db8:1:3::", 4000))
    assert neighbour.post(f"{BASE}/lease/namespace").status_code == 201


def test_retry_after_is_the_wait_rounded_up(monotonic: FakeMonotonic) -> None:
    """At a rate whose waits are not whole seconds, Retry-After and retry_after_seconds
    are the wait rounded up, never down: at 0.4 mints a second an empty bucket is 2.5 s
    from its next token (3, not 2), and 2.4 s later it still has none."""
    client, _ = clients(monotonic, namespace_rate=0.4, namespace_burst=1)
    assert client.post(f"{BASE}/lease/namespace").status_code == 201
    refused = client.post(f"{BASE}/lease/namespace")
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "3" and refused.json()["retry_after_seconds"] == 3
    monotonic.advance(1.0)  # 0.4 of a token: 1.5 s to go
    refused = client.post(f"{BASE}/lease/namespace")
    assert refused.headers["retry-after"] == "2" and refused.json()["retry_after_seconds"] == 2
    monotonic.advance(1.4)  # 2.4 s after the first refusal: 0.96 of a token
    assert client.post(f"{BASE}/lease/namespace").status_code == 429
    monotonic.advance(0.2)  # past the 2.5 s
    assert client.post(f"{BASE}/lease/namespace").status_code == 201
    limiter = RateLimiter(0.3, 1, monotonic=monotonic)
    assert limiter.take("a") is None and limiter.take("a") == 4  # 3.33 s


def test_an_idle_address_saves_up_no_more_than_its_burst(monotonic: FakeMonotonic) -> None:
    """Tokens refill up to the burst and no further: an address idle for an hour mints
    100 namespaces (the burst), not 36,000, and then waits like any other."""
    attacker, _ = clients(monotonic)
    assert attacker.post(f"{BASE}/lease/namespace").status_code == 201
    monotonic.advance(3600)
    codes = [attacker.post(f"{BASE}/lease/namespace").status_code for _ in range(150)]
    assert codes.count(201) == 100 and codes.count(429) == 50
    assert codes == [201] * 100 + [429] * 50


def test_names_that_are_no_address_share_one_small_bucket(monotonic: FakeMonotonic) -> None:
    """A loopback client names its own address (X-Forwarded-For, any text up to 64 KiB):
    text that is no IP address is one bucket, so it neither mints past the burst by
    changing its text nor fills memory with 100,000 keys of 60 KB each."""
    app = create_app(LeaseService(MemoryStore()), Settings(), monotonic=monotonic)
    mint = app.lease_routes[f"{BASE}/lease/namespace"].limits.mint
    codes = [
        TestClient(app, client=(f"{i}-" + "x" * 60_000, 4000))
        .post(f"{BASE}/lease/namespace")
        .status_code
        for i in range(150)
    ]
    assert codes.count(201) == 100 and codes.count(429) == 50
    assert sum(len(str(key)) for key in mint._buckets) < 64


def test_a_namespace_flood_is_refused_when_the_namespace_limit_is_on(
    monotonic: FakeMonotonic,
) -> None:
    """LEASEKEEPER_NAMESPACE_REQUEST_RATE on: a hot namespace gets 429, another one is served,
    even from the same address."""
    attacker, _ = clients(monotonic, namespace_request_rate=20.0, namespace_request_burst=50)
    hot, quiet = "ns_" + "H" * 42 + "A", "ns_" + "Q" * 42 + "A"
    codes = [
        attacker.post(f"{BASE}/lease", json={"namespace": hot, "key": f"k{i}"}).status_code
        for i in range(120)
    ]
    assert codes.count(201) == 50 and codes.count(429) == 70
    serves_normally(attacker, quiet)


@pytest.mark.slow
def test_x_forwarded_for_is_taken_from_a_loopback_proxy_alone(tmp_path: Path) -> None:
    """``leasekeeper serve`` counts a connection from 127.0.0.1 (a proxy on the host) by the
    address its X-Forwarded-For names, and any other peer by its own address whatever it
    names: from 127.0.0.2, three mints naming three addresses spend one budget of 2."""
    env = {"LEASEKEEPER_NAMESPACE_BURST": "2", "LEASEKEEPER_NAMESPACE_RATE": "0.001"}
    with running_server(f"sqlite:///{tmp_path / 'xff.db'}", tmp_path / "log", env) as server:

        def mints(source: str, named: list[str]) -> list[int]:
            transport = httpx.HTTPTransport(local_address=source)
            with httpx.Client(transport=transport, timeout=5) as client:
                return [
                    client.post(
                        f"{server.api}/lease/namespace", headers={"x-forwarded-for": name}
                    ).status_code
                    for name in named
                ]

        proxied = ["203.0.113.1", "203.0.113.2", "203.0.113.3", "203.0.113.1", "203.0.113.1"]
        assert mints("127.0.0.1", proxied) == [201, 201, 201, 201, 429]
        try:
            spoofed = mints("127.0.0.2", ["198.51.100.1", "198.51.100.2", "198.51.100.3"])
        except httpx.ConnectError:  # no 127.0.0.2 to send from (not Linux)
            pytest.skip("needs a loopback address other than 127.0.0.1")
        assert spoofed == [201, 201, 429]


def test_request_limits_are_off_by_default() -> None:
    """SPEC.md stands over the issue: per-address and per-namespace limits default to off."""
    settings = Settings.from_env({})
    assert settings.address_rate == 0 and settings.namespace_request_rate == 0
    assert (settings.namespace_rate, settings.namespace_burst) == (10.0, 100)
    assert settings.request_timeout_seconds == 10 and settings.keep_alive_seconds == 30


# -- slow bodies (in process: receive() under the test's control) -----------------------------

BODY_TIMEOUT = 0.2


def post_lease(
    receive: Callable[[], Awaitable[dict[str, Any]]], cancel_after: float | None = None
) -> tuple[list[dict[str, Any]], float | None, float]:
    """POST /lease with ``receive``: the messages sent, slow_clients{stage="body"}, seconds.

    With ``cancel_after``, the request's task is cancelled from outside after that
    many seconds, and must end cancelled (CancelledError is not swallowed)."""
    settings = Settings(request_timeout_seconds=BODY_TIMEOUT)
    app = create_app(LeaseService(MemoryStore()), settings, run_cleanup=False)
    scope = {
        "type": "http",
        "method": "POST",
        "path": f"{BASE}/lease",
        "headers": [],
        "client": ("127.0.0.1", 1),
    }
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run() -> float:
        started = time.monotonic()
        task = asyncio.create_task(app(scope, receive, send))
        if cancel_after is None:
            await task
        else:
            await asyncio.sleep(cancel_after)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert task.cancelled()
        return time.monotonic() - started

    took = asyncio.run(run())
    slow = app.state.metrics.registry.get_sample_value(
        "leasekeeper_slow_clients_total", {"stage": "body"}
    )
    return sent, slow, took


def messages_then(
    messages: list[dict[str, Any]], wait: float
) -> Callable[[], Awaitable[dict[str, Any]]]:
    """A receive() that waits ``wait`` seconds before each of ``messages``, then forever."""

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(wait if messages else 3600)
        return messages.pop(0)

    return receive


def test_a_body_that_stops_arriving_is_cut_off_in_process() -> None:
    """Part of the body, then nothing: 408 timeout after the request timeout, connection
    closed, and counted in leasekeeper_slow_clients_total{stage="body"}."""
    part = {"type": "http.request", "body": b'{"key": "', "more_body": True}
    for wait in (0, 0.01):  # the first part already there, or on its way
        sent, slow, took = post_lease(messages_then([part], wait))
        status, body = sent[0]["status"], json.loads(sent[1]["body"])
        assert (status, body["status"]) == (408, "timeout")
        assert (b"connection", b"close") in sent[0]["headers"]
        assert slow == 1
        assert BODY_TIMEOUT <= took < BODY_TIMEOUT + 1


def test_the_body_deadline_is_the_request_timeout() -> None:
    """The body's deadline is LEASEKEEPER_REQUEST_TIMEOUT_SECONDS exactly, not some
    multiple of it: on a loop whose timers run a thousand times fast, a body that stops
    arriving with a timeout of 7.5 s is cut off by a timer of 7.5 s (7.5 ms of real time),
    and no other timer of the request's comes due before it."""
    app = create_app(
        LeaseService(MemoryStore()), Settings(request_timeout_seconds=7.5), run_cleanup=False
    )
    scope = {"type": "http", "method": "POST", "path": f"{BASE}/lease", "headers": []}
    part = {"type": "http.request", "body": b'{"key": "', "more_body": True}
    sent: list[dict[str, Any]] = []
    asked: list[float] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        call_later = loop.call_later

        def fast(delay: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
            asked.append(delay)
            return call_later(delay / 1000, callback, *args, **kwargs)

        loop.call_later = fast  # type: ignore[method-assign]
        await app({**scope, "client": ("127.0.0.1", 1)}, messages_then([part], 1.0), send)

    asyncio.run(run())
    assert (sent[0]["status"], json.loads(sent[1]["body"])["status"]) == (408, "timeout")
    assert asked == [1.0, 7.5, 3600]  # the part's wait, the deadline, the wait for more


def test_a_body_already_there_is_read_without_a_timer() -> None:
    """The body's deadline is a timer only once a receive() has to wait: a body that is
    there when the request is (nearly every one) is read with none, which is what
    ``read_body``'s ``_Deadline`` and ``_resume`` are for (asyncio.timeout would start
    one per request)."""
    app = create_app(
        LeaseService(MemoryStore()), Settings(request_timeout_seconds=7.5), run_cleanup=False
    )
    body = b'{"key": "%s"}' % str(uuid.uuid4()).encode()
    scope = {"type": "http", "method": "POST", "path": f"{BASE}/lease", "headers": []}
    sent: list[dict[str, Any]] = []
    asked: list[float] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        call_at, call_later = loop.call_at, loop.call_later

        def at(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
            asked.append(when - loop.time())
            return call_at(when, callback, *args, **kwargs)

        def later(delay: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
            asked.append(delay)
            return call_later(delay, callback, *args, **kwargs)

        loop.call_at, loop.call_later = at, later  # type: ignore[method-assign]
        await app({**scope, "client": ("127.0.0.1", 1)}, receive, send)

    asyncio.run(run())
    assert sent[0]["status"] == 201
    assert not [delay for delay in asked if delay > 1], asked


def test_a_body_that_arrives_in_time_is_served_in_process() -> None:
    """A body that has to be waited for, in one part or in several, is a normal request."""
    key = f'"{uuid.uuid4()}"}}'
    for parts in ([b'{"key": ' + key.encode()], [b'{"key": ', b"", key.encode()]):
        messages = [
            {"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
            for i, part in enumerate(parts)
        ]
        sent, slow, _ = post_lease(messages_then(messages, BODY_TIMEOUT / 10))
        assert sent[0]["status"] == 201, sent
        assert not slow


def test_a_cancelled_request_stays_cancelled_while_its_body_is_awaited() -> None:
    """A cancellation from outside (a server shutting down) is not turned into a 408, also
    when it comes at the moment the body's deadline expires."""
    sent, slow, _ = post_lease(messages_then([], 0), cancel_after=BODY_TIMEOUT / 4)
    assert sent == [] and not slow

    async def cancelled_too() -> dict[str, Any]:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:  # the deadline's; someone else cancels as well
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            raise
        raise AssertionError("not reached")

    sent, slow, _ = post_lease(cancelled_too, cancel_after=BODY_TIMEOUT * 2)
    assert sent == [] and not slow


# -- slow and malformed clients (a real server, raw sockets) -----------------------------------

TIMEOUT = 1.0
CAP = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("abuse")
    env = {
        "LEASEKEEPER_REQUEST_TIMEOUT_SECONDS": str(TIMEOUT),
        "LEASEKEEPER_MAX_CONNECTIONS": str(CAP),
    }
    with running_server(f"sqlite:///{tmp / 'abuse.db'}", tmp / "server.log", env) as running:
        yield running


def connect(server: Server) -> socket.socket:
    return connect_to(server.url)


def connect_to(url: str) -> socket.socket:
    port = int(url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or goes quiet)."""
    data = b""
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        while chunk := sock.recv(65536):
            data += chunk
    sock.close()
    return data


def answer(sock: socket.socket) -> tuple[int, dict[str, str], Any, float]:
    """Read until the server closes: status, headers, JSON body, and seconds it took."""
    started = time.monotonic()
    data = read_until_closed(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return status, headers, json.loads(body), time.monotonic() - started


class RecordingLoop:
    """The event loop as the guarded protocol sees it, with time in the test's hands:
    ``call_later`` records each timer, which the test fires when it likes."""

    class Timer:
        def __init__(self, delay: float, callback: Callable[[], None]) -> None:
            self.delay, self.callback, self.cancelled = delay, callback, False

        def cancel(self) -> None:
            self.cancelled = True

    def __init__(self) -> None:
        self.timers: list[RecordingLoop.Timer] = []

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        timer = self.Timer(delay, callback)
        self.timers.append(timer)
        return timer

    def live(self) -> list[tuple[float, Callable[[], None]]]:
        return [(timer.delay, timer.callback) for timer in self.timers if not timer.cancelled]


class RecordingTransport:
    """A connection's transport that keeps what the server writes."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str) -> Any:
        return {"peername": ("192.0.2.1", 5000), "sockname": ("127.0.0.1", 8787)}.get(name)

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


def test_the_header_deadline_is_the_request_timeout_from_the_first_byte() -> None:
    """With its clock in the test's hands: a connection starts the header timer at exactly
    the request timeout; bytes of a head that has not ended leave it as it was (a trickle
    does not extend it); when it fires, the client gets the JSON 408 with every response's
    headers, the connection is closed, and the slow client is counted."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    counted: list[str] = []
    protocol_class = guard_protocol(HttpToolsProtocol, 7.5, on_timeout=lambda: counted.append(""))
    config = uvicorn.Config(create_app(LeaseService(MemoryStore())), log_config=None)
    loop, transport = RecordingLoop(), RecordingTransport()
    protocol: Any = protocol_class(config, ServerState(), {}, loop)  # type: ignore[call-arg]
    protocol.connection_made(transport)
    assert [delay for delay, _ in loop.live()] == [7.5]
    for part in (b"POST /services/v1/lease HTTP/1.1\r\n", b"Host: x\r\n", b"X-Slow: 1\r\n"):
        protocol.data_received(part)
    ((delay, expire),) = loop.live()
    assert delay == 7.5 and transport.written == b""
    expire()
    head, _, body = transport.written.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and transport.closed and counted == [""]
    assert b"cache-control: no-store" in head and b"x-content-type-options: nosniff" in head
    assert json.loads(body)["status"] == "timeout"


def test_a_closed_connection_is_freed_without_the_cyclic_collector() -> None:
    """Once its connection is lost, the guarded protocol is freed by reference counting
    alone, as uvicorn's own is: the transport its requests write to was bound to it, a
    cycle that kept every closed connection, with its last request, until the cyclic
    collector ran, which ``serve`` makes rare."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    protocol_class = guard_protocol(HttpToolsProtocol, 5.0)
    config = uvicorn.Config(create_app(LeaseService(MemoryStore())), log_config=None)
    loop, transport = RecordingLoop(), RecordingTransport()
    protocol: Any = protocol_class(config, ServerState(), {}, loop)  # type: ignore[call-arg]
    protocol.connection_made(transport)
    protocol.data_received(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    protocol.connection_lost(None)
    loop.timers.clear()  # (a real loop lets go of a cancelled timer)
    freed = weakref.ref(protocol)
    gc.disable()
    try:
        del protocol
        assert freed() is None
    finally:
        gc.enable()


class EndingTransport(RecordingTransport):
    """A transport that can end its side of the stream, as a TCP one can."""

    def __init__(self) -> None:
        super().__init__()
        self.ended = False

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.ended = True


@pytest.mark.parametrize("waiting", [False, True], ids=["alone", "requests-waiting"])
def test_a_close_with_requests_waiting_ends_the_stream_first(waiting: bool) -> None:
    """An answer that closes its connection (a 413, say) while requests wait behind it:
    the server ends its side and reads on, rather than closing with the client's later
    bytes unread, which resets the connection and can lose that answer. With none
    waiting (and no body coming), it closes at once."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    protocol_class = guard_protocol(HttpToolsProtocol, 5.0)
    config = uvicorn.Config(create_app(LeaseService(MemoryStore())), log_config=None)
    loop, transport = RecordingLoop(), EndingTransport()
    protocol: Any = protocol_class(config, ServerState(), {}, loop)  # type: ignore[call-arg]
    protocol.connection_made(transport)
    if waiting:
        protocol.pipeline.append(("a request", "its app"))
    protocol._lk_request_transport.close()  # as uvicorn closes a request's transport
    assert (transport.ended, transport.closed) == ((True, False) if waiting else (False, True))


class _UnrunTask:
    """What ``create_task`` returns for an app that never runs."""

    def add_done_callback(self, callback: Callable[[Any], None]) -> None: ...


def test_a_read_that_begins_the_trailers_is_not_counted_as_trailers() -> None:
    """One read holding a head of nearly 64 KiB, a chunked body and the start of its
    trailers, then one of trailers only: reading goes on. Only reads that went wholly
    to the trailer section count (the whole first read's non-body bytes counted, and a
    request with a large head and a few trailers had its reading stopped)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    class TaskLoop(RecordingLoop):
        def create_task(self, coroutine: Any, **_: Any) -> Any:
            coroutine.close()  # the app never runs: the request stays unanswered
            return _UnrunTask()

    class CountingTransport(RecordingTransport):
        paused = 0

        def pause_reading(self) -> None:
            self.paused += 1

    protocol_class = guard_protocol(HttpToolsProtocol, 5.0)
    config = uvicorn.Config(create_app(LeaseService(MemoryStore())), log_config=None)
    config.load()
    loop, transport = TaskLoop(), CountingTransport()
    protocol: Any = protocol_class(config, ServerState(), {}, loop)  # type: ignore[call-arg]
    protocol.connection_made(transport)
    head = b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    head += b"X-Pad: " + b"a" * (65_500 - len(head)) + b"\r\n\r\n"
    protocol.data_received(head + b"2\r\n{}\r\n0\r\nX-Trailer: 1\r\n")
    protocol.data_received(b"X-Trailer: 2\r\n")
    assert transport.paused == 0 and not transport.closed, transport.written[:300]


@pytest.mark.parametrize(
    "protocol_class", [HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"]
)
def test_uvicorn_has_every_internal_the_protocol_guard_relies_on(protocol_class: Any) -> None:
    """Every name of uvicorn's private API in ``UVICORN_INTERNALS`` is there, on a
    protocol with a request begun: a uvicorn release that renames or drops one fails
    here, and the assertion names it."""
    from uvicorn.server import ServerState

    class TaskLoop(RecordingLoop):
        def create_task(self, coroutine: Any, **_: Any) -> Any:
            coroutine.close()  # the app never runs: the request stays unanswered
            return _UnrunTask()

    config = uvicorn.Config(create_app(LeaseService(MemoryStore())), log_config=None)
    config.load()
    protocol = protocol_class(config, ServerState(), {}, TaskLoop())
    protocol.connection_made(RecordingTransport())
    protocol.data_received(
        b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n"
    )
    assert protocol.cycle is not None
    missing = missing_uvicorn_internals(protocol)
    assert not missing, f"uvicorn {uvicorn.__version__} lacks {', '.join(missing)}"


def test_a_uvicorn_that_lacks_one_is_refused_at_start_up_with_its_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``serve`` fits uvicorn through ``guard_protocol`` and ``serve_connection_limit_with``:
    on a uvicorn without a name they rely on, each refuses with that name."""
    from uvicorn.protocols.http import httptools_impl

    monkeypatch.delattr(httptools_impl.HttpToolsProtocol, "_start_asgi_task")
    name = "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol._start_asgi_task"
    with pytest.raises(RuntimeError, match=re.escape(f"lacks {name},")):
        guard_protocol(httptools_impl.HttpToolsProtocol, 5.0)
    monkeypatch.delattr(httptools_impl, "service_unavailable")
    name = "uvicorn.protocols.http.httptools_impl.service_unavailable"
    with pytest.raises(RuntimeError, match=re.escape(f"lacks {name},")):
        serve_connection_limit_with(create_app(LeaseService(MemoryStore())).at_connection_limit())


@pytest.mark.slow
def test_a_connection_that_sends_nothing_is_closed(server: Server) -> None:
    """Connect and stay silent: 408 timeout (JSON) after the request timeout, then closed;
    with every response's security headers, though no app wrote it."""
    status, headers, body, took = answer(connect(server))
    assert (status, body["status"]) == (408, "timeout")
    assert headers["connection"] == "close" and headers["cache-control"] == "no-store"
    assert headers["x-content-type-options"] == "nosniff"
    assert TIMEOUT * 0.8 <= took <= TIMEOUT + 2


@pytest.mark.slow
def test_trickled_headers_do_not_extend_the_deadline(server: Server) -> None:
    """One header byte every 0.2 s: cut off after the timeout, not kept alive by the trickle."""
    sock = connect(server)
    started = time.monotonic()
    with contextlib.suppress(OSError):
        for byte in b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\nX-Slow: yes\r\n":
            sock.send(bytes([byte]))
            time.sleep(0.2)
    status, _, body, _ = answer(sock)
    assert (status, body["status"]) == (408, "timeout")
    assert time.monotonic() - started <= TIMEOUT + 2


@pytest.mark.slow
def test_endless_headers_are_cut_off_at_64_kib(server: Server) -> None:
    """Header lines sent on and on (the parser keeps no bound, and uvicorn kept every
    header) get a JSON 431 too_large once the head passes 64 KiB, and the connection
    is closed; a head just under the bound is served."""
    sock = connect(server)
    line = b"X-Pad: " + b"a" * 1017 + b"\r\n"  # 1 KiB
    with contextlib.suppress(OSError):  # the server may close while we send
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + line * 200)
    status, headers, body, _ = answer(sock)
    assert (status, body["status"]) == (431, "too_large")
    assert headers["connection"] == "close" and headers["cache-control"] == "no-store"
    assert headers["x-content-type-options"] == "nosniff"
    sock = connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + line * 60 + b"\r\n")
    status, _, body, _ = answer(sock)
    assert status == 200 and body["ok"] is True


@pytest.mark.slow
def test_the_head_bound_is_per_request_on_a_kept_alive_connection(server: Server) -> None:
    """The 64 KiB are counted afresh for each request: 20 requests on one connection, each
    head 8 KiB that arrives in two reads (160 KiB of heads in all), are all served."""
    sock = connect(server)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    line = b"X-Pad: " + b"a" * 1017 + b"\r\n"  # 1 KiB
    statuses = []
    with contextlib.suppress(OSError):  # a connection closed on us: its statuses say so
        for _ in range(20):
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + line * 8)
            time.sleep(0.05)  # read by the server before the head's end comes
            sock.sendall(b"\r\n")
            head = b""
            while b"\r\n\r\n" not in head and (chunk := sock.recv(1)):
                head += chunk
            if not head:
                break
            statuses.append(int(head.split()[1]))
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while length and (chunk := sock.recv(length)):
                length -= len(chunk)
    sock.close()
    assert statuses == [200] * 20


@contextlib.contextmanager
def serving(app: Any, request_timeout: float = 5.0) -> Iterator[str]:
    """``app`` served in this process by uvicorn's httptools protocol, guarded as
    ``leasekeeper serve`` guards it; yields its URL."""
    with uvicorn_serving(app, request_timeout) as (url, _):
        yield url


@contextlib.contextmanager
def uvicorn_serving(
    app: Any, request_timeout: float, protocol: type[asyncio.Protocol] | None = None
) -> Iterator[tuple[str, uvicorn.Server]]:
    """As ``serving`` (on ``protocol``, httptools' by default), and yields the uvicorn
    server too (its open connections are in ``server.server_state.connections``)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    port = free_port()
    config = uvicorn.Config(
        app,
        port=port,
        http=guard_protocol(protocol or HttpToolsProtocol, request_timeout),
        # asyncio's loop: uvicorn before 0.36 would make uvloop's policy the process's.
        loop="asyncio",
        log_config=None,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.slow
def test_endless_headers_while_an_answer_is_pending_are_cut_off_too() -> None:
    """Header lines sent on and on while the request before them is still being answered
    (here a readiness check the store has not answered; a client that stops reading its
    answers keeps one pending for the request timeout) are held to the same 64 KiB: the
    server stops reading them, sends the pending answer, then the JSON 431, and closes.
    They were not counted while a request was in progress, and uvicorn kept every line:
    one connection grew the server from 80 MB to 2.3 GB in 9 s."""
    answer_ping = threading.Event()

    class SlowToPing(MemoryStore):
        async def ping(self) -> None:
            await asyncio.to_thread(answer_ping.wait, 10)

    app = create_app(LeaseService(SlowToPing()), run_cleanup=False)
    with serving(app) as url:
        sock = connect_to(url)
        sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        line = b"X-Pad: " + b"a" * 1017 + b"\r\n"  # 1 KiB
        sock.settimeout(1)
        with contextlib.suppress(OSError):  # the server may stop reading: buffers fill
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + line * 1024)
        time.sleep(0.2)  # the server reads what it will
        answer_ping.set()
        sock.settimeout(5)
        assert responses_in(read_until_closed(sock)) == [200, 431]


@pytest.mark.slow
def test_a_target_longer_than_the_url_parser_reads_is_431_not_malformed(server: Server) -> None:
    """httptools reads a URL with 16-bit offsets: a path past 65,535 bytes (a head
    over 64 KiB, sent in one go) gets 431 too_large saying so, not 400 "not valid
    HTTP"; one just under it is routed (404)."""
    for length, expected in ((65_000, 404), (66_000, 431)):
        sock = connect(server)
        with contextlib.suppress(OSError):
            sock.sendall(b"GET /" + b"a" * length + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body, _ = answer(sock)
        assert status == expected, body
    assert body["status"] == "too_large" and "target" in body["error"]
    assert headers["connection"] == "close" and headers["cache-control"] == "no-store"
    assert headers["x-content-type-options"] == "nosniff"


def _slow_bodies(server: Server) -> float:
    """The server's leasekeeper_slow_clients_total{stage="body"} (0 before the first)."""
    metrics = httpx.get(f"{server.url}/metrics").text
    return metric(metrics, "leasekeeper_slow_clients_total", absent=0.0, stage="body")


@pytest.mark.slow
@pytest.mark.parametrize("sent", [b"", b'{"key": "'])
@pytest.mark.parametrize("path", ["/services/v1/lease", "/mcp"])
def test_a_body_that_does_not_arrive_is_cut_off(server: Server, sent: bytes, path: str) -> None:
    """Content-Length promises 100 bytes and fewer come: 408 after the timeout, then
    closed; on /mcp too, where the SDK would wait for a body for ever."""
    sock = connect(server)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Accept: application/json, text/event-stream\r\nContent-Length: 100\r\n\r\n"
    )
    slow_bodies = _slow_bodies(server)
    sock.sendall(head.encode() + sent)
    status, headers, body, took = answer(sock)
    if path == "/mcp":  # a JSON-RPC error, which MCP clients read, with the API's body
        assert body["error"]["code"] == -32600 and body["id"] is None
        assert body["error"]["message"] == f"Invalid request: {body['error']['data']['error']}"
        assert "not received within" in body["error"]["message"]  # not "larger than"
        body = body["error"]["data"]
    assert (status, body["status"]) == (408, "timeout") and headers["connection"] == "close"
    assert took <= TIMEOUT + 2
    assert _slow_bodies(server) == slow_bodies + 1  # counted, on /mcp as on the API


@pytest.mark.slow
@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}",
        b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Content-Length: 3\r\n\r\n{}",
        b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n"
        b'{"key": "longer than declared"}',
        b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS hello on the plain port
        b"GET /" + b"a" * 100 + b" HTTP/9.9\r\n\r\n",
    ],
)
def test_malformed_http_gets_a_json_400(server: Server, request_bytes: bytes) -> None:
    """What the HTTP parser refuses is answered 400 invalid in JSON, like everything else,
    with the headers of every response."""
    sock = connect(server)
    sock.sendall(request_bytes)
    status, headers, body, _ = answer(sock)
    assert (status, body["status"]) == (400, "invalid")
    assert headers["content-type"] == "application/json"
    assert headers["cache-control"] == "no-store"
    assert headers["x-content-type-options"] == "nosniff"


@pytest.mark.slow
@pytest.mark.parametrize("name", [b" Content-Length", b"Content-Length "])
def test_a_content_length_that_a_proxy_might_read_otherwise_is_refused(
    server: Server, name: bytes
) -> None:
    """A Content-Length folded onto the line before it, or with a space before its colon,
    is where a lenient parser and a proxy in front of it can disagree on where a body
    ends (request smuggling): the parser refuses it, and the body is not served."""

    def acquire(header: bytes) -> tuple[int, Any]:
        body = json.dumps({"key": uuid.uuid4().hex + uuid.uuid4().hex}).encode()
        sock = connect(server)
        sock.sendall(
            b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            + header
            + b": %d\r\n\r\n" % len(body)
            + body
        )
        status, _, reply, _ = answer(sock)
        return status, reply

    status, reply = acquire(b"Content-Length")  # the same request, plainly: served
    assert (status, reply["status"]) == (201, "held")
    status, reply = acquire(name)
    assert (status, reply["error"]) == (400, "The request is not valid HTTP/1.1")


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/services/v1/lease", "/mcp"])
def test_a_huge_declared_body_is_refused_before_it_is_read(server: Server, path: str) -> None:
    """Content-Length of a terabyte: 413 at once, and the connection is closed; on /mcp
    too, which reads its body as the API routes do."""
    sock = connect(server)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Accept: application/json, text/event-stream\r\nContent-Length: 10"
    )
    sock.sendall(head.encode())
    sock.sendall(b"00000000000\r\n\r\n{")
    status, headers, body, took = answer(sock)
    if path == "/mcp":  # a JSON-RPC error, which MCP clients read, with the API's body
        assert body["error"]["message"] == (
            "Invalid request: the message is larger than 65536 bytes"
        )
        body = body["error"]["data"]
    assert (status, body["status"]) == (413, "too_large") and headers["connection"] == "close"
    assert took < TIMEOUT


@given(st.integers(0, 10**30), st.integers(0, 6000), st.integers(0, 2**40))
def test_a_declared_length_compares_as_its_number(length: int, zeros: int, limit: int) -> None:
    """The body-size check reads Content-Length as a number, leading zeros and all."""
    assert _larger_than(b"0" * zeros + str(length).encode(), limit) is (length > limit)


@pytest.mark.slow
def test_a_content_length_with_thousands_of_leading_zeros_is_its_number(server: Server) -> None:
    """5,000 zeros and a 2 declare a body of 2 bytes: the request is served, not a 500
    (int() refuses more than 4,300 digits); 5,000 zeros and 70000 are over the limit: 413."""
    sock = connect(server)
    sock.sendall(
        b"POST /services/v1/lease/namespace HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Length: " + b"0" * 5000 + b"2\r\n\r\n{}"
    )
    status, _, body, _ = answer(sock)
    assert status == 201 and body["namespace"].startswith("ns_")
    sock = connect(server)
    sock.sendall(
        b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\nContent-Length: "
        + b"0" * 5000
        + b"70000\r\n\r\n{"
    )
    status, _, body, _ = answer(sock)
    assert (status, body["status"]) == (413, "too_large")


@pytest.mark.slow
def test_a_huge_chunked_body_is_refused_after_the_limit(server: Server) -> None:
    """A chunk that declares 4 GiB: refused with 413 once 64 KiB have arrived."""
    sock = connect(server)
    sock.sendall(
        b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"FFFFFFFF\r\n" + b"x" * 70_000
    )
    status, _, body, _ = answer(sock)
    assert (status, body["status"]) == (413, "too_large")


@pytest.mark.slow
def test_a_small_chunked_body_is_a_normal_request(server: Server) -> None:
    """Chunked transfer encoding itself is fine (curl -T - sends it)."""
    ns = httpx.post(f"{server.api}/lease/namespace").json()["namespace"]
    payload = ('{"namespace": "%s", "key": "chunked"}' % ns).encode()  # noqa: UP031
    sock = connect(server)
    sock.sendall(
        b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n"
        + b"%x\r\n%s\r\n" % (10, payload[:10])
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload) - 10, payload[10:])
    )
    status, _, body, _ = answer(sock)
    assert (status, body["status"]) == (201, "held")


@pytest.mark.slow
def test_a_chunked_body_of_exactly_64_kib_is_read_and_one_byte_more_is_413(
    server: Server,
) -> None:
    """With no Content-Length to refuse early, the limit is counted as the chunks come:
    65,536 bytes are a request (JSON whitespace pads it), 65,537 are too large."""
    ns = httpx.post(f"{server.api}/lease/namespace").json()["namespace"]
    for size, key, expected in (
        (65_536, "edge", (201, "held")),
        (65_537, "over", (413, "too_large")),
    ):
        payload = b'{"namespace": "%s", "key": "%s"}' % (ns.encode(), key.encode())
        payload += b" " * (size - len(payload))
        chunks = b"".join(
            b"%x\r\n%s\r\n" % (len(part), part)
            for part in (payload[i : i + 1000] for i in range(0, size, 1000))
        )
        sock = connect(server)
        sock.sendall(
            b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n" + chunks + b"0\r\n\r\n"
        )
        status, _, body, _ = answer(sock)
        assert (status, body["status"]) == expected, size


@pytest.mark.slow
def test_a_slowloris_flood_cannot_lock_out_a_normal_client(server: Server) -> None:
    """Idle connections that fill every slot are closed after the timeout; then a normal
    client is served. (A client that keeps reopening connections needs a proxy's
    per-address connection limit: all slots look alike to the server.)"""
    idle = [connect(server) for _ in range(CAP)]
    try:
        time.sleep(0.2)
        first = httpx.get(f"{server.url}/healthz", timeout=5)
        assert first.status_code == 503 and first.json()["status"] == "unavailable"
        deadline = time.monotonic() + TIMEOUT + 3
        served = None
        while time.monotonic() < deadline:
            served = httpx.post(f"{server.api}/lease/namespace", timeout=5)
            if served.status_code == 201:
                break
            time.sleep(0.1)
        assert served is not None and served.status_code == 201
    finally:
        closed = [answer(sock)[0] for sock in idle]
    assert closed == [408] * CAP
    metrics = httpx.get(f"{server.url}/metrics").text
    line = next(m for m in metrics.splitlines() if m.startswith("leasekeeper_slow_clients_total"))
    assert 'stage="headers"' in line and float(line.split()[-1]) >= CAP


# -- upgrade offers (a real server: uvicorn's httptools protocol) ------------------------------

#: What ``curl --http2`` adds to a request on plain HTTP (Java's HttpClient and Ktor alike).
H2C_OFFER = (
    b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
)
LAST = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def exchange(url: str, *parts: bytes) -> list[tuple[int, Any]]:
    """Send ``parts`` on one connection to the server at ``url``, a moment apart; every
    response until the server closes it, as (status, JSON body)."""
    sock = connect_to(url)
    for part in parts:
        sock.sendall(part)
        time.sleep(0.05)
    data = read_until_closed(sock)
    answers = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        length = int(headers["content-length"])
        answers.append((int(lines[0].split()[1]), json.loads(data[:length])))
        data = data[length:]
    return answers


def acquire_with_offer(ns: str, key: str, chunked: bool = False) -> tuple[bytes, bytes]:
    """An acquire that offers an upgrade to h2c: its head and its body."""
    payload = json.dumps({"namespace": ns, "key": key}).encode()
    head = b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\n" + H2C_OFFER
    head += b"Content-Type: application/json\r\n"
    if chunked:
        body = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (
            10,
            payload[:10],
            len(payload) - 10,
            payload[10:],
        )
        return head + b"Transfer-Encoding: chunked\r\n\r\n", body
    return head + b"Content-Length: %d\r\n\r\n" % len(payload), payload


@pytest.mark.slow
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("split", [False, True], ids=["one-packet", "body-later"])
def test_an_offer_to_upgrade_to_h2c_is_ignored_and_the_request_served(
    server: Server, chunked: bool, split: bool
) -> None:
    """The offer is ignored (RFC 9110, 7.8): the acquire is served with its body, and the
    requests after it on the connection are too. (uvicorn alone gave the app an empty
    body, 400, and left the connection hanging.)"""
    ns = httpx.post(f"{server.api}/lease/namespace").json()["namespace"]
    head, body = acquire_with_offer(ns, f"h2c-{chunked}-{split}", chunked)
    parts = (head, body + LAST) if split else (head + body + LAST,)
    answers = exchange(server.url, *parts)
    assert [(status, answer["status"]) for status, answer in answers] == [
        (201, "held"),
        (200, "alive"),
    ]


@pytest.mark.slow
def test_every_offer_on_a_connection_is_ignored(server: Server) -> None:
    """Three acquires that each offer h2c on one connection, the second on a key the
    first holds: 201 held, 409 held, 201 held, then the last request."""
    ns = httpx.post(f"{server.api}/lease/namespace").json()["namespace"]
    requests = [b"".join(acquire_with_offer(ns, key)) for key in ("a", "a", "b")]
    answers = exchange(server.url, *requests, LAST)
    assert [(status, answer["status"]) for status, answer in answers] == [
        (201, "held"),
        (409, "held"),
        (201, "held"),
        (200, "alive"),
    ]


@pytest.mark.slow
def test_a_malformed_body_after_an_offer_gets_a_json_400(server: Server) -> None:
    """The rest of the request is parsed as strictly as any: a bad chunk size is 400."""
    head, _ = acquire_with_offer("ns_x", "k", chunked=True)
    assert exchange(server.url, head + b"ZZ\r\n") == [
        (400, {"ok": False, "status": "invalid", "error": "The request is not valid HTTP/1.1"})
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rest", "expected"),
    [
        (b"Content-Length: 100\r\n\r\n{", (408, "timeout")),
        (b"Content-Length: 10000000\r\n\r\n{", (413, "too_large")),
        (b"Transfer-Encoding: chunked\r\n\r\nFFFFFFFF\r\n" + b"x" * 70_000, (413, "too_large")),
    ],
    ids=["body-never-comes", "declared-too-large", "chunked-too-large"],
)
def test_an_offer_changes_nothing_about_the_body_limits(
    server: Server, rest: bytes, expected: tuple[int, str]
) -> None:
    """After an offer the body is held to the same deadline and size as any."""
    sock = connect(server)
    sock.sendall(b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\n" + H2C_OFFER + rest)
    status, _, body, took = answer(sock)
    assert (status, body["status"]) == expected
    assert took <= TIMEOUT + 2


@pytest.mark.slow
def test_the_h11_protocol_serves_an_offer_with_its_body_too() -> None:
    """Without httptools, uvicorn's h11 protocol (guarded, but with no upgrade mixin)
    ignores the offer by itself: the acquire and the request after it are served."""
    app = create_app(LeaseService(MemoryStore()), run_cleanup=False)
    with uvicorn_serving(app, 5.0, H11Protocol) as (url, _):
        ns = httpx.post(f"{url}{BASE}/lease/namespace").json()["namespace"]
        head, body = acquire_with_offer(ns, "h11")
        answers = exchange(url, head, body + LAST)
        assert [(status, answer["status"]) for status, answer in answers] == [
            (201, "held"),
            (200, "alive"),
        ]


# -- pipelining: requests sent ahead of their answers ------------------------------------------


def responses_in(data: bytes) -> list[int]:
    """The status codes of the HTTP responses in ``data`` (JSON bodies with a length)."""
    statuses = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        data = data[int(headers["content-length"]) :]
        statuses.append(int(lines[0].split()[1]))
    return statuses


HEALTH = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.slow
def test_pipelined_requests_within_the_bound_are_all_answered(server: Server) -> None:
    """Requests sent ahead of their answers, as many as may wait: every one is answered
    in order, on a connection that stays open."""
    sock = connect(server)
    sock.sendall(HEALTH * MAX_PIPELINED + LAST)  # the first runs, the others wait
    assert responses_in(read_until_closed(sock)) == [200] * (MAX_PIPELINED + 1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "request_bytes",
    [HEALTH, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + H2C_OFFER + b"\r\n"],
    ids=["plain", "h2c-offer"],
)
def test_a_pipeline_past_the_bound_is_cut_short_and_the_server_stays_well(
    server: Server, request_bytes: bytes
) -> None:
    """Thousands of requests in one send, on several connections: each is answered for
    the requests that may wait and then closed, the server neither grows nor logs a
    traceback (uvicorn read on while requests waited: gigabytes from one connection; 1,000
    pipelined h2c offers were a RecursionError), and a normal client is served."""
    before = rss_kib(server)
    burst = request_bytes * 4000
    for _ in range(5):
        sock = connect(server)
        with contextlib.suppress(OSError):  # the server may close while we send
            sock.sendall(burst)
        statuses = responses_in(read_until_closed(sock))
        assert statuses and set(statuses) == {200}
        assert len(statuses) <= len(burst) // len(request_bytes) // 10, len(statuses)
    assert rss_kib(server) - before < 50_000
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    log = server.log.read_text()
    assert "Traceback" not in log and "RecursionError" not in log


@pytest.mark.slow
def test_a_client_that_does_not_read_its_answers_is_dropped(server: Server) -> None:
    """A client that sends requests on and on and never reads the answers: once the
    answers fill the connection's buffers, the server gives it the request timeout to
    take them, then drops the connection and what it could not send, rather than hold
    the slot for as long as the client likes."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    sock.settimeout(TIMEOUT)
    request = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"
    count = 0
    started = time.monotonic()
    with contextlib.suppress(OSError):  # until the server drops the connection
        while time.monotonic() - started < TIMEOUT * 4:  # real time: the deadline runs out
            with contextlib.suppress(TimeoutError):
                sock.sendall(request * MAX_PIPELINED)
                count += MAX_PIPELINED
            time.sleep(0.2)
    received = 0
    sock.settimeout(5)
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += len(chunk)
    sock.close()
    whole = len(httpx.get(f"{server.url}/openapi.json").content) * count
    assert received < whole / 10, (received, whole)
    # The request still running when the connection was dropped writes nothing to it
    # (uvicorn told only the request parsed last: a traceback per dropped client).
    assert "Traceback" not in server.log.read_text()


@pytest.mark.slow
def test_a_client_that_does_not_read_its_answers_gives_its_connection_back() -> None:
    """Dropped means gone: once its answers have filled the buffers and the request
    timeout has passed, the connection of a client that never reads is no longer the
    server's, though the client keeps its socket open and still reads nothing. (Closing
    it gently would wait for that client to read what is left: a slot held for ever.)"""
    timeout = 0.5
    app = create_app(LeaseService(MemoryStore()), run_cleanup=False)
    with uvicorn_serving(app, timeout) as (url, server):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        sock.settimeout(timeout)
        request = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"
        started = time.monotonic()
        with contextlib.suppress(OSError):  # until the server drops the connection
            while time.monotonic() - started < timeout * 4:
                sock.sendall(request * 8)  # few enough to wait their turn, not overflow
                time.sleep(0.02)
        connections = server.server_state.connections
        deadline = time.monotonic() + timeout + 5  # real time: the server's timer runs
        while connections and time.monotonic() < deadline:
            time.sleep(0.05)
        still_open = len(connections)
        sock.close()
        assert still_open == 0


@pytest.mark.slow
def test_a_client_that_reads_a_large_answer_slowly_gets_all_of_it() -> None:
    """Swagger UI's script for /docs (1.7 MB) to a client that reads on steadily but
    takes several request timeouts for the whole, over a link that keeps the server's
    socket buffer small (as a slow network does; loopback would grow it to megabytes):
    it is sent a piece at a time, and each piece is taken in time, so the file arrives.
    (Sent in one piece, it had to be taken whole within one timeout: dropped.)"""

    class SmallSendBuffer(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 32_768
            )
            super().connection_made(transport)

    timeout = 0.5
    path = "/docs/swagger-ui-bundle.js"
    app = create_app(LeaseService(MemoryStore()), run_cleanup=False)
    with uvicorn_serving(app, timeout, SmallSendBuffer) as (url, _):
        whole = httpx.get(url + path).content
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16_384)
        sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        sock.settimeout(5)
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        started = time.monotonic()
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(32_768):
                received += chunk
                time.sleep(0.03)  # about 1 MB/s at most
        took = time.monotonic() - started
        sock.close()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and len(body) == len(whole) > 1_000_000
    assert body == whole
    assert took > 2 * timeout, took  # slow enough that one deadline for the whole would cut it


def rss_kib(server: Server) -> int:
    """The server process's resident memory, from /proc."""
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0])


def test_the_rate_limiter_forgets_the_least_recently_seen_key_first() -> None:
    """Past ``max_keys`` keys the one seen longest ago is forgotten (its bucket starts
    full again); a key seen lately keeps its empty bucket."""
    now = FakeMonotonic()
    limiter = RateLimiter(1, 1, monotonic=now, max_keys=3)
    for key in ("a", "b", "c"):
        assert limiter.take(key) is None  # each spends its one token
    assert limiter.take("a") == 1  # "a" seen again: now the most recent
    assert limiter.take("d") is None  # a fourth key: "b", the least recent, is forgotten
    assert limiter.take("a") == 1 and limiter.take("c") == 1
    assert limiter.take("b") is None  # forgotten: a full bucket again


def read_to_the_end(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the server sends, and whether the connection ended in a reset."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        return data, True
    finally:
        sock.close()
    return data, False


@pytest.mark.slow
def test_past_the_bound_the_waiting_requests_are_answered_before_a_clean_end(
    server: Server,
) -> None:
    """More requests than may wait, the last one in a later read: the waiting ones are all
    answered, and the connection ends with an end of stream, not a reset (a close with
    the client's bytes unread reset it, and the answers not yet delivered were lost)."""
    sock = connect(server)
    sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * (MAX_PIPELINED + 2))
    time.sleep(0.05)
    sock.sendall(HEALTH)
    time.sleep(0.3)
    data, reset = read_to_the_end(sock)
    assert responses_in(data) == [200] * (MAX_PIPELINED + 1) and not reset


@pytest.mark.slow
def test_an_offer_before_a_request_that_closes_the_connection(server: Server) -> None:
    """A pipeline of an acquire offering h2c, one asking to close the connection, and one
    more: the first two are answered and ran, the connection closes, the third did not
    run. (The parser that replays an offer's request took the request after a close for
    an error: a 400 instead of the answers, though the first acquire had run.)"""
    ns = httpx.post(f"{server.api}/lease/namespace").json()["namespace"]
    offered = b"".join(acquire_with_offer(ns, "first"))
    closing = acquire(ns, "second", b"Connection: close\r\n")
    answers = exchange(server.url, offered + closing + acquire(ns, "third"))
    assert [(status, body["status"]) for status, body in answers] == [(201, "held")] * 2
    again = [httpx.post(f"{server.api}/lease", json={"namespace": ns, "key": key}).status_code
             for key in ("first", "second", "third")]  # fmt: skip
    assert again == [409, 409, 201]


def acquire(ns: str, key: str, extra: bytes = b"") -> bytes:
    """A plain acquire of ``key``, with ``extra`` header lines."""
    payload = json.dumps({"namespace": ns, "key": key}).encode()
    return (
        b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\n" + extra
        + b"Content-Length: %d\r\n\r\n" % len(payload) + payload
    )  # fmt: skip


@pytest.mark.slow
def test_a_request_that_closes_the_connection_mid_pipeline_keeps_the_answers(
    server: Server,
) -> None:
    """Requests up to one that asks to close the connection, and one more in a later
    read: every answer up to the closing one arrives, then an end of stream, not a reset
    (uvicorn closed with the later request unread, and the reset lost the answers)."""
    sock = connect(server)
    sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 20 + LAST)
    time.sleep(0.05)
    sock.sendall(HEALTH)
    time.sleep(0.3)
    data, reset = read_to_the_end(sock)
    assert responses_in(data) == [200] * 21 and not reset


def read_answers(sock: socket.socket, count: int) -> list[int]:
    """The statuses of the next ``count`` answers on ``sock``, which stays open."""
    data = b""
    while True:
        try:
            statuses = responses_in(data)
        except (KeyError, ValueError, IndexError):  # an answer not whole yet
            statuses = []
        if len(statuses) >= count and data.endswith(b"}"):
            return statuses
        chunk = sock.recv(65536)
        assert chunk, f"the connection ended after {data!r}"
        data += chunk


@pytest.mark.slow
@pytest.mark.parametrize(("path", "status"), [("/nowhere", 404), ("/healthz", 405)])
def test_the_rest_of_a_body_answered_early_is_not_taken_for_a_head(
    server: Server, path: str, status: int
) -> None:
    """A POST whose large body is still coming when the server answers without reading
    it (404, 405): the rest of the body is read and dropped, not counted as the next
    request's head (it was: past 64 KiB of it, the client's next request got a 431 about
    headers it never sent), and the next request on the connection is served."""
    sock = connect(server)
    size = 200_000
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n"
    sock.sendall(head.encode() + b"a" * 1000)
    assert read_answers(sock, 1) == [status]  # sent before the rest of the body
    sock.sendall(b"a" * (size - 1000) + HEALTH)
    assert read_answers(sock, 1) == [200]
    sock.sendall(LAST)
    data, reset = read_to_the_end(sock)
    assert responses_in(data) == [200] and not reset


@pytest.mark.slow
def test_the_rest_of_a_body_answered_early_must_come_within_the_request_timeout(
    server: Server,
) -> None:
    """After an early answer, the rest of the body is given the request timeout (1 s
    here) to arrive, however it trickles: then the connection is ended, with an end of
    stream and no other answer."""
    sock = connect(server)
    sock.sendall(b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
    assert read_answers(sock, 1) == [404]
    started = time.monotonic()
    sock.settimeout(TIMEOUT / 5)
    data = None
    while data is None and time.monotonic() - started < 5 * TIMEOUT:
        sock.sendall(b"a")  # a byte at a time
        with contextlib.suppress(TimeoutError):
            data = sock.recv(65536)
    ended = time.monotonic() - started
    sock.close()
    assert data == b"" and ended < 2.5 * TIMEOUT  # an end of stream, nothing before it


@pytest.mark.slow
@pytest.mark.parametrize("after", [b"", b"GET /healthz HTTP/1.1\r\nHo"], ids=["idle", "head"])
def test_after_the_rest_of_a_body_answered_early_the_next_head_is_on_the_clock(
    server: Server, after: bytes
) -> None:
    """Once the rest of a body answered early is in, the connection awaits its next
    request as a new connection does: its head must be complete within the request
    timeout (1 s here), else a 408 and the connection is closed. (Nothing bounded it:
    the body had taken uvicorn's keep-alive timer with it, and a client could hold the
    connection, and a slot under the connection limit, for ever.)"""
    sock = connect(server)
    sock.sendall(b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n{")
    assert read_answers(sock, 1) == [404]
    started = time.monotonic()
    sock.sendall(b"a" * 1999 + after)
    data = read_until_closed(sock)
    assert responses_in(data) == [408] and time.monotonic() - started < 3 * TIMEOUT


def flood_trailers(sock: socket.socket, limit: int = 32 << 20) -> tuple[int, bytes]:
    """Send trailer fields of 8 KB on ``sock`` until the server answers or ends the
    connection, or ``limit`` bytes are sent: (bytes sent, what came back)."""
    line = b"X-Pad: " + b"a" * 8000 + b"\r\n"
    sock.setblocking(False)
    sent, started = 0, time.monotonic()
    while sent < limit and time.monotonic() - started < 10 * TIMEOUT:
        readable, writable, _ = select.select([sock], [sock], [], 1.0)
        if readable:
            try:
                return sent, sock.recv(65536)
            except ConnectionResetError:
                return sent, b""
        if writable:
            with contextlib.suppress(BlockingIOError):
                sent += sock.send(line)
    return sent, b"(still open)"


@pytest.mark.slow
@pytest.mark.parametrize("offer", [b"", H2C_OFFER], ids=["plain", "h2c-offer"])
def test_trailers_after_a_body_answered_early_are_bounded(server: Server, offer: bytes) -> None:
    """A chunked body's trailer section counts against the 64 KiB a head may have:
    after an early answer (which does not wait for them) the connection ends once
    trailers pass it; on a request offering h2c too, whose body another parser reads.
    (They went unbounded until the rest of the body's timeout: hundreds of MB a second,
    all kept among the request's headers.)"""
    sock = connect(server)
    sock.sendall(b"POST /nowhere HTTP/1.1\r\nHost: x\r\n" + offer
                 + b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n0\r\n")  # fmt: skip
    assert read_answers(sock, 1) == [404]
    sent, back = flood_trailers(sock)
    sock.close()
    assert back == b"" and sent < 32 << 20  # an end of stream, long before the limit


@pytest.mark.slow
@pytest.mark.parametrize("offer", [b"", H2C_OFFER], ids=["plain", "h2c-offer"])
def test_trailers_of_a_body_being_read_are_bounded(server: Server, offer: bytes) -> None:
    """Trailers that do not end, on an acquire whose body is being read: past 64 KiB the
    server reads no more of them, and the request gets its 408 when its body is not in
    within the request timeout. (The server read them all, into the request's headers,
    until that timeout.)"""
    sock = connect(server)
    sock.sendall(b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\n" + offer
                 + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n")  # fmt: skip
    sent, back = flood_trailers(sock)
    sock.close()
    assert back.startswith(b"HTTP/1.1 408 ") and sent < 32 << 20


@pytest.mark.slow
def test_a_413_while_the_body_is_still_coming_ends_without_a_reset(server: Server) -> None:
    """A body far over the limit, still being sent when the 413 goes out: the client gets
    the 413 and then an end of stream. (The server closed with the body unread, which
    reset the connection: a client still sending could lose the 413 and see only the
    reset.)"""
    sock = connect(server)
    head = b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n"
    sock.sendall(head + b"a" * 200_000)
    time.sleep(0.1)  # the 413 is sent, and the connection ended on the server's side
    sock.sendall(b"a" * 200_000)
    data, reset = read_to_the_end(sock)
    assert responses_in(data) == [413] and not reset
