"""The client's one choke point from response body back to the exception tree."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from leasekeeper import (
    AsyncLeaseClient,
    FakeClock,
    FingerprintConflict,
    InternalError,
    InvalidRequest,
    LeaseClient,
    LeaseConflict,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    MethodNotAllowed,
    NotFound,
    OutcomeUnknown,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    ServiceUnavailable,
    ServiceUnreachable,
    StaleFence,
)
from leasekeeper._errors import error_from_body
from leasekeeper.client import Lease
from leasekeeper.client._http import (
    DEFAULT_TIMEOUT,
    MAX_RESPONSE_BYTES,
    read_response,
    renewal_timeout,
)
from tests.client_fakes import BASE_URL, FakeTime, bridge

SERVICE_ERRORS: list[LeaseError] = [
    InvalidRequest("ttl_seconds must be an integer from 1 to 86400"),
    PayloadTooLarge(),
    NotFound(),
    MethodNotAllowed(),
    RequestTimeout(),
    RateLimited(retry_after_seconds=3),
    LeaseHeld(
        retry_after_seconds=43,
        fencing_token=184,
        lease_expires_at="2026-09-05T10:01:00Z",
        absolute_expires_at="2026-09-06T10:00:00Z",
    ),
    FingerprintConflict(absolute_expires_at="2026-09-06T10:00:00Z"),
    LeaseLost("The lease expired; acquire the key again before continuing"),
    ServiceUnavailable(retry_after_seconds=2),
    InternalError(),
]


def test_lease_held_says_the_wait_and_the_fence_but_its_body_does_not_change() -> None:
    """str() of LeaseHeld carries the wait and the holder's fence (when the body had one);
    the body's ``error`` is the service's message alone."""
    body = {"ok": False, "status": "held", "error": "Lease is held", "fencing_token": 7}
    held = error_from_body({**body, "retry_after_seconds": 12})
    assert str(held) == "Lease is held; retry after 12 s (fencing token 7)"
    assert held.body()["error"] == "Lease is held"
    unknown = error_from_body({"ok": False, "status": "held"}, retry_after=5)
    assert str(unknown) == "Lease is held; retry after 5 s"


@pytest.mark.parametrize("error", SERVICE_ERRORS, ids=lambda e: e.status)
def test_every_service_error_round_trips_through_its_body(error: LeaseError) -> None:
    """error_from_body(error.body()) rebuilds the same class with the same body."""
    rebuilt = error_from_body(error.body())
    assert type(rebuilt) is type(error)
    assert rebuilt.body() == error.body()
    assert rebuilt.retry_after == error.retry_after


def test_the_retry_after_header_fills_a_missing_body_field() -> None:
    """A body without retry_after_seconds takes the Retry-After header, at least 1 s."""
    body = {"ok": False, "status": "unavailable", "error": "down"}
    assert error_from_body(body, retry_after=9).retry_after == 9
    assert error_from_body(body).retry_after == 1


@pytest.mark.parametrize(
    ("header", "expected"),
    [("7", 7), ("0007", 7), ("²", 1), ("9" * 5000, 1), ("0" * 5000 + "3", 3), ("soon", 1)],
)
def test_a_retry_after_header_of_any_text_gives_a_wait(header: str, expected: int) -> None:
    """Leading zeros are read; what is not a sane delta-seconds (a non-ASCII digit,
    thousands of digits) is the default of 1 s, never an exception outside the tree."""
    response = httpx.Response(
        503,
        content=b'{"ok":false,"status":"unavailable"}',
        headers={"Retry-After": header.encode("latin-1")},
    )
    with pytest.raises(ServiceUnavailable) as raised:
        read_response(response, response.content)
    assert raised.value.retry_after == expected


@pytest.mark.parametrize(
    ("http_status", "expected"),
    [
        (400, InvalidRequest),
        (401, InvalidRequest),
        (404, NotFound),
        (405, MethodNotAllowed),
        (408, RequestTimeout),
        (409, LeaseConflict),
        (413, PayloadTooLarge),
        (429, RateLimited),
        (500, InternalError),
        (502, ServiceUnavailable),
        (503, ServiceUnavailable),
        (504, ServiceUnavailable),
        (302, InternalError),
    ],
)
def test_a_foreign_body_is_classified_by_http_status(
    http_status: int, expected: type[LeaseError]
) -> None:
    """Without a status word of ours, the HTTP status code picks the class."""
    assert type(error_from_body(None, http_status=http_status)) is expected


def test_client_only_errors_sit_in_the_tree() -> None:
    """ServiceUnreachable is a ServiceUnavailable; StaleFence is a LeaseLost."""
    unreachable = ServiceUnreachable()
    assert isinstance(unreachable, ServiceUnavailable)
    assert unreachable.status == "unreachable"
    assert unreachable.retry_after == 1
    stale = StaleFence(resource="invoice:42", fencing_token=184, current_fence=185)
    assert isinstance(stale, LeaseLost)
    assert "invoice:42" not in stale.error
    assert stale.body()["current_fence"] == 185


def test_a_malformed_body_does_not_break_the_mapping() -> None:
    """Wrong field types fall back to safe defaults instead of raising while raising."""
    error = error_from_body({"status": "held", "retry_after_seconds": True, "fencing_token": "x"})
    assert isinstance(error, LeaseHeld)
    assert error.retry_after_seconds == 1
    assert error.fencing_token == 0


def _undecodable(request: httpx.Request) -> httpx.Response:
    """A proxy's error page whose Content-Encoding says gzip and whose body is not."""
    return httpx.Response(502, headers={"content-encoding": "gzip"}, content=b"<html>bad")


def test_an_answer_that_cannot_be_decoded_is_unreachable_in_both_clients() -> None:
    """httpx's DecodingError (not a TransportError) still becomes the tree's
    ServiceUnreachable, which waiting retries, never an httpx exception."""
    with (
        LeaseClient("http://lk.test", transport=httpx.MockTransport(_undecodable)) as client,
        pytest.raises(ServiceUnreachable, match="DecodingError"),
    ):
        client.create_namespace()

    async def scenario() -> None:
        transport = httpx.MockTransport(_undecodable)
        async with AsyncLeaseClient("http://lk.test", transport=transport) as client:
            with pytest.raises(ServiceUnreachable, match="DecodingError"):
                await client.create_namespace()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "url",
    [
        "127.0.0.1:8787",
        "user:s3cret@lk.test",
        "ftp://lk.test",
        "http://",
        "::",
        "http://127.0.0.1:99999",  # the async client leaked an ExceptionGroup for this one
        "http://lk.test:-1",
        "http://lk.test:0",
        "http://lk.test?x=1",  # the API path would follow the query: every call a 404
        "http://lk.test/#top",
    ],
)
def test_a_service_url_without_http_or_a_host_is_refused_at_once(url: str) -> None:
    """Not a request that fails as unreachable, which ``once`` would retry for ever."""
    with pytest.raises(ValueError, match="http:// or https://") as sync_refused:
        LeaseClient(url)
    with pytest.raises(ValueError, match="http:// or https://"):
        AsyncLeaseClient(url)
    # One fixed sentence: the URL, which may hold credentials, is not repeated.
    assert str(sync_refused.value) == (
        "the service URL must be http:// or https:// with a host, a port from 1 to 65535 "
        "if any, and no query or fragment, as http://127.0.0.1:8787"
    )
    for good in ("http://127.0.0.1:8787", "https://lk.test/services/v1/", "http://lk.test:65535"):
        LeaseClient(good).close()


@pytest.mark.parametrize("seconds", [10**20, 10**9, -5, 0])
def test_a_wait_no_service_would_ask_for_falls_back_to_the_header_or_1(seconds: int) -> None:
    """A 503 asking for 10**20 s overflowed the sync client's sleep and hung the async one."""
    body = {"status": "unavailable", "retry_after_seconds": seconds}
    assert error_from_body(body, http_status=503).retry_after == 1
    assert error_from_body(body, http_status=503, retry_after=7).retry_after == 7
    longest = {"status": "unavailable", "retry_after_seconds": 999_999_999}
    assert error_from_body(longest, http_status=503).retry_after == 999_999_999


_NOT_OUR_ANSWERS = {
    "/lease/namespace": {"ok": True},
    "/lease/renew": {
        "ok": True,
        "status": "held",
        "fencing_token": 1,
        "ttl_seconds": 60,
        "lease_expires_at_timestamp": 10**17,  # no datetime has that second
        "absolute_expires_at_timestamp": 1,
    },
    "/lease/complete": {
        "ok": True,
        "status": "completed",
        "result": None,
        "fencing_token": 1,
        "completed_at": "99999-01-01T00:00:00Z",
        "absolute_expires_at": "2026-09-06T10:00:00Z",
    },
}


def _answers_not_ours(request: httpx.Request) -> httpx.Response:
    path = request.url.path.removeprefix("/services/v1")
    return httpx.Response(200, json=_NOT_OUR_ANSWERS[path])


def test_a_success_with_fields_no_service_would_send_is_internal_in_both_clients() -> None:
    """Not a KeyError, OSError or ValueError from reading it (the CLI showed tracebacks)."""
    token = "own_" + "a" * 43
    transport = httpx.MockTransport(_answers_not_ours)
    with LeaseClient("http://lk.test", transport=transport) as client:
        with pytest.raises(InternalError, match="'namespace'"):
            client.create_namespace()
        with pytest.raises(InternalError, match="'lease_expires_at_timestamp'"):
            client.renew(None, "k" * 40, token)
        with pytest.raises(InternalError, match="'completed_at'"):
            client.complete(None, "k" * 40, token, None)

    async def scenario() -> None:
        transport = httpx.MockTransport(_answers_not_ours)
        async with AsyncLeaseClient("http://lk.test", transport=transport) as client:
            with pytest.raises(InternalError, match="'namespace'"):
                await client.create_namespace()
            with pytest.raises(InternalError, match="'lease_expires_at_timestamp'"):
                await client.renew(None, "k" * 40, token)
            with pytest.raises(InternalError, match="'completed_at'"):
                await client.complete(None, "k" * 40, token, None)

    asyncio.run(scenario())


_GOOD_LEASE = {
    "ok": True,
    "status": "held",
    "fencing_token": 7,
    "ttl_seconds": 60,
    "lease_expires_at_timestamp": 1_788_602_460,
    "absolute_expires_at_timestamp": 1_788_688_800,
}


@pytest.mark.parametrize(
    ("path", "change", "field"),
    [
        ("/lease/renew", {"fencing_token": 0}, "fencing_token"),
        ("/lease/renew", {"fencing_token": -5}, "fencing_token"),
        ("/lease/renew", {"fencing_token": 2**63}, "fencing_token"),
        ("/lease/renew", {"ttl_seconds": -1}, "ttl_seconds"),
        ("/lease/release", {"status": "released", "fencing_token": 2**70}, "fencing_token"),
        (
            "/lease/complete",
            {"status": "completed", "result": 1, "completed_at": "2026-01-01T00:00:00"},
            "completed_at",
        ),
    ],
    ids=["fence 0", "fence -5", "fence 2**63", "ttl -1", "fence 2**70", "time without zone"],
)
def test_values_the_service_never_sends_are_internal(
    path: str, change: dict[str, Any], field: str
) -> None:
    """A fencing token outside 1..2**63-1 (the protected system would compare it), a
    negative TTL, or a time without its zone (read as this machine's local time, it
    would be hours off) is not taken as the service's answer."""
    body = {**_GOOD_LEASE, "absolute_expires_at": "2026-09-06T10:00:00Z", **change}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=body))
    token = "own_" + "a" * 43
    with LeaseClient("http://lk.test", transport=transport) as client:
        call = {
            "/lease/renew": lambda: client.renew(None, "k" * 40, token),
            "/lease/release": lambda: client.release(None, "k" * 40, token),
            "/lease/complete": lambda: client.complete(None, "k" * 40, token, 1),
        }[path]
        with pytest.raises(InternalError, match=f"'{field}'"):
            call()


def test_an_answer_larger_than_any_the_service_sends_is_not_read_whole() -> None:
    """A wrong URL serving a download: reading stops past MAX_RESPONSE_BYTES with an
    InternalError, rather than hold hundreds of megabytes (both clients)."""
    sent: list[int] = []

    def chunks() -> Iterator[bytes]:
        for _ in range(10_000):  # 640 MB, were it read whole
            sent.append(1)
            yield b"x" * 65_536

    async def achunks() -> AsyncIterator[bytes]:
        for chunk in chunks():
            yield chunk

    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=chunks()))
    with (
        LeaseClient("http://lk.test", transport=transport) as client,
        pytest.raises(InternalError, match="larger than any"),
    ):
        client.create_namespace()
    assert len(sent) == MAX_RESPONSE_BYTES // 65_536 + 1

    sent.clear()

    async def scenario() -> None:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=achunks()))
        async with AsyncLeaseClient("http://lk.test", transport=transport) as client:
            with pytest.raises(InternalError, match="larger than any"):
                await client.create_namespace()

    asyncio.run(scenario())
    assert len(sent) == MAX_RESPONSE_BYTES // 65_536 + 1


def test_an_answer_still_arriving_after_the_timeout_is_given_up_on() -> None:
    """httpx's timeout bounds each read: a server sending its answer a byte at a time
    would hold a call for as long as it likes. The client's timeout bounds the whole
    answer (sync: checked as each piece arrives, on the client's clock; async: the
    whole exchange under ``asyncio.timeout``)."""
    now = [0.0]
    sent: list[int] = []

    def trickle() -> Iterator[bytes]:
        for byte in b'{"ok":true,"namespace":"ns_x"}':
            now[0] += 1.0  # a second a byte
            sent.append(byte)
            yield bytes([byte])

    transport = httpx.MockTransport(lambda request: httpx.Response(503, content=trickle()))
    with (
        LeaseClient(
            "http://lk.test", transport=transport, timeout=3, monotonic=lambda: now[0]
        ) as client,
        pytest.raises(ServiceUnreachable, match="did not arrive in time"),
    ):
        client.create_namespace()
    assert len(sent) == 4  # the first byte after the deadline ends it

    async def scenario() -> None:
        never = asyncio.Event()

        async def stalls() -> AsyncIterator[bytes]:
            yield b'{"ok":'
            await never.wait()
            yield b"true}"

        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=stalls()))
        async with AsyncLeaseClient("http://lk.test", transport=transport, timeout=0.1) as client:
            with pytest.raises(ServiceUnreachable, match="did not arrive in time"):
                await client.create_namespace()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "body",
    [
        {"ok": False, "status": "held", "error": "Lease is held", "retry_after_seconds": 3},
        {"ok": "true", "status": "held"},
        {"status": "lost", "error": "x"},
    ],
    ids=["ok false", "ok a string", "no ok"],
)
def test_a_success_that_is_not_ok_is_internal_not_the_error_it_names(body: dict[str, Any]) -> None:
    """Every refusal of the service is a 4xx or 5xx; a 2xx in its words but not its
    shape was not meant, and is not read as the refusal its status word names (a
    LeaseHeld with no fencing token, say)."""
    response = httpx.Response(200, json=body)
    with pytest.raises(InternalError, match="not one it sends"):
        read_response(response, response.content)


def test_a_result_nested_past_what_python_can_write_is_a_type_error() -> None:
    """As any other result that cannot be stored: TypeError before anything is sent,
    not a RecursionError."""
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    sent: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(500)

    with (
        LeaseClient("http://lk.test", transport=httpx.MockTransport(record)) as client,
        pytest.raises(TypeError, match="nested too deeply"),
    ):
        client.complete(None, "k" * 40, "own_" + "a" * 43, deep)
    assert sent == []


def test_a_compressed_answer_is_refused_before_it_is_inflated() -> None:
    """The client asks for no compression (the service never compresses); a compressed
    success anyway (a proxy's: a few hundred KB of gzip may inflate past 100 MB within
    one read) is an InternalError, not inflated; a compressed refusal is classified by
    its status and headers alone (a 503 stays a 503 that waiting retries)."""
    bomb = gzip.compress(b"{" + b" " * 50_000_000 + b"}")
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.headers["accept-encoding"])
        return httpx.Response(200, content=bomb, headers={"content-encoding": "gzip"})

    with (
        LeaseClient("http://lk.test", transport=httpx.MockTransport(answer)) as client,
        pytest.raises(InternalError, match="compressed"),
    ):
        client.create_namespace()
    assert asked == ["identity"]

    def refusal(request: httpx.Request) -> httpx.Response:
        headers = {"content-encoding": "gzip", "retry-after": "7"}
        return httpx.Response(503, content=bomb, headers=headers)

    with (
        LeaseClient("http://lk.test", transport=httpx.MockTransport(refusal)) as client,
        pytest.raises(ServiceUnavailable) as raised,
    ):
        client.create_namespace()
    assert raised.value.retry_after == 7


def test_a_renewal_is_bounded_by_the_timeout_given_in_any_form() -> None:
    """A number, or an httpx.Timeout's read timeout; with none at all, the default."""
    assert renewal_timeout(3) == 3.0
    assert renewal_timeout(httpx.Timeout(30.0)) == 30.0
    assert renewal_timeout(httpx.Timeout(5.0, read=None)) == DEFAULT_TIMEOUT
    assert renewal_timeout(None) == DEFAULT_TIMEOUT


@pytest.mark.parametrize("timeout", [None, httpx.Timeout(5.0)], ids=["None", "httpx.Timeout"])
def test_a_timeout_of_none_or_an_httpx_timeout_still_works(timeout: Any) -> None:
    """httpx's own ways of giving a timeout, which the client passes on to httpx: the
    whole-answer deadline (which needs a number) is then not applied."""
    body = {"ok": True, "namespace": "ns_" + "A" * 43, "entropy_bits": 256}
    transport = httpx.MockTransport(lambda request: httpx.Response(201, json=body))
    with LeaseClient("http://lk.test", transport=transport, timeout=timeout) as client:
        assert client.create_namespace() == body["namespace"]

    async def scenario() -> None:
        transport = httpx.MockTransport(lambda request: httpx.Response(201, json=body))
        async with AsyncLeaseClient("http://lk.test", transport=transport, timeout=timeout) as c:
            assert await c.create_namespace() == body["namespace"]

    asyncio.run(scenario())


# -- an outcome the service could not learn -----------------------------------------------

UNKNOWN_BODY = {
    "ok": False,
    "status": "unavailable",
    "error": "The lease store's connection failed while it committed this write, and the "
    "write could not be read back: its outcome is unknown",
    "retry_after_seconds": 1,
    "outcome": "unknown",
}


def test_an_unknown_outcome_round_trips_and_is_told_apart_from_a_503() -> None:
    """A 503 body with "outcome": "unknown" is ``OutcomeUnknown``, a ServiceUnavailable
    whose body says so; one without it is a plain ServiceUnavailable: nothing written."""
    unknown = error_from_body(UNKNOWN_BODY, http_status=503)
    assert type(unknown) is OutcomeUnknown
    assert isinstance(unknown, ServiceUnavailable)
    assert unknown.body() == UNKNOWN_BODY
    assert error_from_body(unknown.body()).body() == UNKNOWN_BODY
    plain = error_from_body({**UNKNOWN_BODY, "outcome": "known"}, http_status=503)
    assert type(plain) is ServiceUnavailable
    assert "outcome" not in ServiceUnavailable().body()
    assert OutcomeUnknown().body()["outcome"] == "unknown"


def _granted_then_unknown(api: Any, *, lands: bool) -> Any:
    """A ``bridge`` fault: the first acquire reaches the app (granted there) when
    ``lands``, and is answered 503 "outcome": "unknown" either way."""
    inner = bridge(api)
    left = [1]

    def fault(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith("/lease") and left[0]:
            left[0] -= 1
            if lands:
                inner.handle_request(request)
            return httpx.Response(503, json=UNKNOWN_BODY, headers={"retry-after": "1"})
        return None

    return fault


def _client(api: Any, clock: FakeClock, fault: Any) -> tuple[LeaseClient, FakeTime]:
    fake_time = FakeTime(clock)
    client = LeaseClient(
        BASE_URL,
        transport=bridge(api, fault),
        monotonic=fake_time.monotonic,
        event_factory=fake_time.event,
        random=lambda: 0.0,
    )
    return client, fake_time


def test_an_acquire_whose_outcome_is_unknown_is_never_reported_not_acquired(
    api: Any, clock: FakeClock
) -> None:
    """acquire, lease and once raise OutcomeUnknown, not LeaseHeld, when an attempt's
    outcome was unknown and the key is then found held (by that attempt's lease, here):
    without a wait at once, with one when it runs out. once does not run the function."""
    namespace = api.namespace()
    ran: list[str] = []
    for key, call in [
        ("a", lambda c: c.acquire(namespace, "a")),
        ("b", lambda c: c.acquire(namespace, "b", wait=5)),
        ("c", lambda c: c.lease(namespace, "c", wait=5).__enter__()),
        ("d", lambda c: c.once(namespace, key="d", wait=5)(ran.append)("run")),
    ]:
        client, _ = _client(api, clock, _granted_then_unknown(api, lands=True))
        with client:
            with pytest.raises(OutcomeUnknown) as raised:
                call(client)
            assert raised.value.body()["outcome"] == "unknown"
            with pytest.raises(LeaseHeld):  # the lost grant does hold the key
                client.acquire(namespace, key)
        if key != "a":  # waited, and found the key held: said why it is not "held"
            assert "until its TTL ends" in raised.value.error
    assert not ran


def test_an_acquire_whose_unknown_attempt_had_not_landed_is_granted_on_a_retry(
    api: Any, clock: FakeClock
) -> None:
    """Waiting retries an unknown outcome like any 503: when the attempt had not taken
    effect, the next one is granted."""
    namespace = api.namespace()
    client, fake_time = _client(api, clock, _granted_then_unknown(api, lands=False))
    with client:
        lease = client.acquire(namespace, "k", wait=5)
    assert isinstance(lease, Lease)
    assert fake_time.waits == [1]


def test_the_async_client_never_reports_an_unknown_acquire_as_not_acquired(
    api: Any, clock: FakeClock
) -> None:
    """The async client's acquire, as the sync one's."""
    namespace = api.namespace()
    fake_time = FakeTime(clock)

    async def scenario() -> None:
        transport = bridge(api, _granted_then_unknown(api, lands=True))
        async with AsyncLeaseClient(
            BASE_URL,
            transport=transport,
            monotonic=fake_time.monotonic,
            signal_factory=fake_time.signal,
            random=lambda: 0.0,
        ) as client:
            with pytest.raises(OutcomeUnknown):
                await client.acquire(namespace, "k", wait=5)

    asyncio.run(scenario())
