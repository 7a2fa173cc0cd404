"""The sync client against the real app in-process: operations, errors, held leases, once."""

from __future__ import annotations

import gc
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import httpx
import pytest

from leasekeeper import (
    FakeClock,
    FingerprintConflict,
    InternalError,
    InvalidRequest,
    LeaseClient,
    LeaseHeld,
    LeaseLost,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    ServiceUnavailable,
    ServiceUnreachable,
)
from leasekeeper.client import (
    Completed,
    HeldLease,
    Lease,
    Released,
    RenewalWorker,
    current_lease,
)
from tests.client_fakes import (
    BASE_URL,
    FakeTime,
    ManualThread,
    answer_lost_after_complete,
    bridge,
)

KEY = "invoice:2026-09-05"


@pytest.fixture
def fake_time(clock: FakeClock) -> FakeTime:
    return FakeTime(clock)


def make_client(api: Any, fake_time: FakeTime, **kwargs: Any) -> LeaseClient:
    return LeaseClient(
        BASE_URL,
        transport=bridge(api, kwargs.pop("fault", None)),
        monotonic=fake_time.monotonic,
        event_factory=fake_time.event,
        thread_factory=ManualThread,
        random=lambda: 0.0,
        **kwargs,
    )


@pytest.fixture
def client(api: Any, fake_time: FakeTime) -> Iterator[LeaseClient]:
    with make_client(api, fake_time) as client:
        yield client


@pytest.fixture
def namespace(client: LeaseClient) -> str:
    return client.create_namespace()


def worker_of(lease: HeldLease) -> RenewalWorker:
    assert lease.renewer is not None
    return lease.renewer


# -- the five operations ----------------------------------------------------------------------


def test_create_namespace_returns_the_secret(client: LeaseClient) -> None:
    """create_namespace returns a fresh ns_ secret."""
    namespace = client.create_namespace()
    assert namespace.startswith("ns_")
    assert len(namespace) == 46
    assert client.create_namespace() != namespace


def test_acquire_renew_release_round_trip(client: LeaseClient, namespace: str) -> None:
    """acquire, renew and release return typed records read from the service's bodies."""
    lease = client.acquire(namespace, KEY, ttl=60, fingerprint="charge-order-501")
    assert isinstance(lease, Lease)
    assert lease.owner_token.startswith("own_")
    assert lease.ttl_seconds == 60
    assert lease.lease_expires_at == datetime(2026, 9, 5, 10, 1, tzinfo=UTC)
    assert lease.absolute_expires_at == datetime(2026, 9, 6, 10, 0, tzinfo=UTC)
    assert lease.lease_expires_at_timestamp == 1_788_602_460
    assert lease.owner_token not in repr(lease)

    renewed = client.renew(namespace, KEY, lease.owner_token, ttl=120)
    assert renewed.fencing_token == lease.fencing_token
    assert renewed.owner_token == lease.owner_token
    assert renewed.lease_expires_at - lease.lease_expires_at == timedelta(seconds=60)

    released = client.release(namespace, KEY, lease.owner_token)
    assert released == Released(fencing_token=lease.fencing_token, body=released.body)
    again = client.acquire(namespace, KEY, fingerprint="charge-order-501")
    assert isinstance(again, Lease)
    assert again.fencing_token > lease.fencing_token


def test_complete_then_acquire_returns_the_stored_result(
    client: LeaseClient, namespace: str
) -> None:
    """complete stores the redacted result; a later acquire gets it back as Completed."""
    lease = client.acquire(namespace, KEY, fingerprint="f")
    assert isinstance(lease, Lease)
    done = client.complete(namespace, KEY, lease.owner_token, {"receipt_id": 4817, "api_key": "x"})
    assert done.result == {"receipt_id": 4817, "api_key": "[redacted]"}
    assert done.completed_at == datetime(2026, 9, 5, 10, 0, tzinfo=UTC)
    again = client.acquire(namespace, KEY, fingerprint="f")
    assert isinstance(again, Completed)
    assert again.result == done.result
    assert again.fencing_token == lease.fencing_token


def test_integers_past_64_bits_come_back_exactly(client: LeaseClient, namespace: str) -> None:
    """The service stores a result's integers exactly, and the client reads them back so
    (orjson would read 10**30 + 1 as the float 1e+30), from complete and from a replay."""
    big = {"n": 10**30 + 1, "negative": -(2**64) - 1, "near": [2**63 - 1, 0.5]}
    lease = client.acquire(namespace, KEY)
    assert isinstance(lease, Lease)
    done = client.complete(namespace, KEY, lease.owner_token, big)
    assert done.result == big and type(done.result["n"]) is int
    again = client.acquire(namespace, KEY)
    assert isinstance(again, Completed)
    assert again.result == big and type(again.result["negative"]) is int


def test_a_result_nested_as_deep_as_the_service_takes_comes_back(
    client: LeaseClient, namespace: str
) -> None:
    """63 levels below the request's top (64 in all) is stored; the reply, as deep, is
    read back (the client checks replies by the service's rules, and must not refuse
    what the service itself sent)."""
    deep: Any = 1
    for _ in range(63):
        deep = [deep]
    lease = client.acquire(namespace, KEY)
    assert isinstance(lease, Lease)
    assert client.complete(namespace, KEY, lease.owner_token, deep).result == deep
    other = client.acquire(namespace, "other")
    assert isinstance(other, Lease)
    with pytest.raises(InvalidRequest, match="deeper than 64"):
        client.complete(namespace, "other", other.owner_token, [deep])


_CYCLE: list[Any] = []
_CYCLE.append(_CYCLE)  # a list that contains itself


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (math.nan, "NaN"),
        (-math.inf, "infinite"),
        (datetime(2026, 9, 5, tzinfo=UTC), "type datetime"),
        (uuid.UUID(int=7), "type UUID"),
        (_CYCLE, "contains itself"),
        ({1: "a"}, None),  # json would write the key as "1": accepted, as Python's json does
    ],
)
def test_results_json_cannot_hold_are_refused_before_sending(
    client: LeaseClient, namespace: str, value: Any, why: str | None
) -> None:
    """A result that JSON cannot hold raises TypeError, saying why, and nothing is sent:
    not stored as null or as a string, as an encoder that converts would store it. A
    big integer, which the service takes, is stored exactly."""
    lease = client.acquire(namespace, KEY)
    assert isinstance(lease, Lease)
    if why is None:
        assert client.complete(namespace, KEY, lease.owner_token, value).result == {"1": "a"}
        return
    with pytest.raises(TypeError, match=why):
        client.complete(namespace, KEY, lease.owner_token, {"x": [value]})
    done = client.complete(namespace, KEY, lease.owner_token, {"n": 2**100})  # still its owner
    assert done.result == {"n": 2**100}


def test_refusals_raise_the_classes_of_the_one_tree(client: LeaseClient, namespace: str) -> None:
    """Held, conflict, lost, invalid and too_large come back as their exception classes."""
    lease = client.acquire(namespace, KEY, ttl=30, fingerprint="a")
    assert isinstance(lease, Lease)
    with pytest.raises(LeaseHeld) as held:
        client.acquire(namespace, KEY, fingerprint="a")
    assert held.value.retry_after_seconds == 30
    assert held.value.fencing_token == lease.fencing_token
    assert held.value.lease_expires_at == "2026-09-05T10:00:30Z"
    with pytest.raises(FingerprintConflict) as conflict:
        client.acquire(namespace, KEY, fingerprint="b")
    assert conflict.value.absolute_expires_at == "2026-09-06T10:00:00Z"
    with pytest.raises(LeaseLost):
        client.renew(namespace, KEY, "own_" + "A" * 43)
    with pytest.raises(InvalidRequest, match="ttl_seconds"):
        client.acquire(namespace, "other", ttl=0)
    with pytest.raises(PayloadTooLarge):
        client.complete(namespace, KEY, lease.owner_token, "x" * 40_000)


@pytest.mark.parametrize(
    ("status", "body", "headers", "expected", "retry_after"),
    [
        (503, b'{"ok":false,"status":"unavailable","error":"down"}', {"retry-after": "4"},
         ServiceUnavailable, 4),
        (503, b"<html>bad gateway</html>", {"retry-after": "7"}, ServiceUnavailable, 7),
        (429, b'{"ok":false,"status":"rate_limited","error":"slow","retry_after_seconds":3}',
         {"retry-after": "3"}, RateLimited, 3),
        (500, b'{"ok":false,"status":"internal","error":"Internal error"}', {}, InternalError,
         None),
        (404, b"not json", {}, NotFound, None),
        (200, b'{"ok":false}', {}, InternalError, None),
        (418, b"", {}, InvalidRequest, None),
    ],
)  # fmt: skip
def test_any_response_becomes_a_specific_error(
    api: Any,
    fake_time: FakeTime,
    status: int,
    body: bytes,
    headers: dict[str, str],
    expected: type[Exception],
    retry_after: int | None,
) -> None:
    """A non-2xx response, ours or a proxy's, is one specific class; Retry-After is honoured."""
    client = make_client(
        api, fake_time, fault=lambda request: httpx.Response(status, content=body, headers=headers)
    )
    with pytest.raises(expected) as raised:
        client.acquire(None, "k" * 40)
    assert type(raised.value) is expected
    if retry_after is not None:
        assert raised.value.retry_after == retry_after  # type: ignore[attr-defined]


def test_no_answer_is_service_unreachable(api: Any, fake_time: FakeTime) -> None:
    """A connection error becomes ServiceUnreachable, a ServiceUnavailable, chained."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    client = make_client(api, fake_time, fault=refuse)
    with pytest.raises(ServiceUnreachable) as raised:
        client.create_namespace()
    assert isinstance(raised.value, ServiceUnavailable)
    assert raised.value.status == "unreachable"
    assert isinstance(raised.value.__cause__, httpx.ConnectError)


@pytest.mark.parametrize("userinfo", ["alice:hunter2@", ""])
def test_unreachable_names_the_url_tried_without_its_password(userinfo: str) -> None:
    """A refused connection's message names the URL tried, its user and password left out
    (a URL without them goes straight to the transport, ``_http.Direct``)."""
    with socket.socket() as sock:  # bound, not listening: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        client = LeaseClient(f"http://{userinfo}127.0.0.1:{port}")
        with client, pytest.raises(ServiceUnreachable) as raised:
            client.create_namespace()
    message = str(raised.value)
    tried = f"http://127.0.0.1:{port}/services/v1/lease/namespace"
    assert message == f"Could not reach the lease service at {tried} (ConnectError)"
    assert raised.value.body()["error"] == message


def test_injected_httpx_client_and_url_with_base_path(api: Any) -> None:
    """An injected httpx.Client is used as given, and a URL may include /services/v1, the
    client's own base URL too."""
    with httpx.Client(base_url=BASE_URL, transport=bridge(api)) as http:
        assert LeaseClient(client=http).create_namespace().startswith("ns_")
        with_path = LeaseClient(f"{BASE_URL}/services/v1/", client=http)
        assert with_path.create_namespace().startswith("ns_")
    # The injected client's own base URL may end at the API root already.
    with httpx.Client(base_url=f"{BASE_URL}/services/v1/", transport=bridge(api)) as http:
        assert LeaseClient(client=http).create_namespace().startswith("ns_")
    with pytest.raises(TypeError):
        LeaseClient(client=http, transport=bridge(api))


@pytest.mark.parametrize("client_url", ["", BASE_URL], ids=["client without", "client with"])
@pytest.mark.parametrize("url", ["127.0.0.1:8787", "ftp://host", None], ids=str)
def test_an_injected_client_gets_its_service_url_checked_too(
    api: Any, url: str | None, client_url: str
) -> None:
    """With client=, the URL given (else the client's own base_url) must be http:// or
    https:// with a host, as without: every request would otherwise fail as unreachable,
    which once() and wait= retry for ever. ValueError at once instead."""
    with httpx.Client(base_url=client_url, transport=bridge(api)) as http:
        if url is None and client_url:
            assert LeaseClient(client=http).create_namespace().startswith("ns_")
            return
        with pytest.raises(ValueError, match="must be http:// or https:// with a host"):
            LeaseClient(url, client=http)


def test_starlette_testclient_can_be_injected_too(api: Any, fake_time: FakeTime) -> None:
    """Starlette's TestClient (an httpx2.Client, not an httpx.Client) works duck-typed."""
    client = LeaseClient(
        client=api.client, monotonic=fake_time.monotonic, event_factory=fake_time.event,
        thread_factory=ManualThread,
    )  # fmt: skip
    namespace = client.create_namespace()
    with client.lease(namespace, KEY, ttl=30) as lease:
        assert lease.renewer is not None
        assert lease.renewer.step()
    assert isinstance(client.acquire(namespace, KEY), Lease)


# -- waiting for a held key -------------------------------------------------------------------


def test_acquire_waits_with_backoff_until_the_lease_expires(
    client: LeaseClient, namespace: str, fake_time: FakeTime
) -> None:
    """The server waits for the holder's lease to expire and hands the key over then; the
    client pauses not once."""
    first = client.acquire(namespace, KEY, ttl=2)
    assert isinstance(first, Lease)
    told: list[tuple[str, float]] = []
    started = fake_time.monotonic()
    second = client.acquire(
        namespace,
        KEY,
        ttl=2,
        wait=timedelta(seconds=10),
        on_wait=lambda error, delay: told.append((error.status, delay)),
    )
    assert isinstance(second, Lease)
    assert second.fencing_token > first.fencing_token
    assert fake_time.waits == [] and told == []
    assert fake_time.monotonic() - started == 2


def test_a_wait_under_a_second_is_polled_with_backoff(
    client: LeaseClient, namespace: str, fake_time: FakeTime
) -> None:
    """Under a second left, the client polls itself: from 0.25 s, doubling, until the
    deadline, then LeaseHeld."""
    client.acquire(namespace, KEY, ttl=60)
    with pytest.raises(LeaseHeld):
        client.acquire(namespace, KEY, wait=0.9)
    assert fake_time.waits == [0.25, 0.5, pytest.approx(0.15)]


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (429, b'{"ok":false,"status":"rate_limited","error":"slow","retry_after_seconds":3}'),
        (503, b"<html>bad gateway</html>"),
    ],
)
def test_acquire_waits_at_least_retry_after_for_a_limit_or_an_outage(
    api: Any, fake_time: FakeTime, status: int, body: bytes
) -> None:
    """A 429 or a 503 is not polled before its Retry-After, as for a held key: a service
    that asked its clients to hold off is not pressed sooner; the last try is at the
    deadline."""
    client = make_client(
        api,
        fake_time,
        fault=lambda request: httpx.Response(status, content=body, headers={"retry-after": "3"}),
    )
    with pytest.raises((RateLimited, ServiceUnavailable)):
        client.acquire(None, "k" * 40, wait=10)
    assert fake_time.waits[:3] == [3, 3, 3]
    assert sum(fake_time.waits) == pytest.approx(10.0)


def _timeouts(count: int, path: str) -> Callable[[httpx.Request], httpx.Response | None]:
    """A fault: the first ``count`` requests to ``path`` get the service's 408."""
    left = [count]

    def fault(request: httpx.Request) -> httpx.Response | None:
        if left[0] and request.url.path.endswith(path):
            left[0] -= 1
            body = {"ok": False, "status": "timeout", "error": "not received in time"}
            return httpx.Response(408, json=body)
        return None

    return fault


def test_acquire_waits_through_a_408(api: Any, fake_time: FakeTime, namespace: str) -> None:
    """A 408 (the service did not get the request in time) is retried as an outage is."""
    client = make_client(api, fake_time, fault=_timeouts(2, "/lease"))
    assert isinstance(client.acquire(namespace, KEY, wait=10), Lease)
    assert fake_time.waits == [0.25, 0.5]
    with pytest.raises(RequestTimeout):
        make_client(api, fake_time, fault=_timeouts(1, "/lease")).acquire(namespace, "other")


def test_a_408_on_a_renewal_is_retried_not_lost(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """One renewal answered 408 is tried again soon; the lease is not lost."""
    client = make_client(api, fake_time, fault=_timeouts(1, "/renew"))
    with client.lease(namespace, KEY, ttl=30) as lease:
        worker = worker_of(lease)
        assert worker.step()  # the 408
        assert worker.plan.failures == 1 and not lease.lost.is_set()
        assert worker.step()  # renewed
        assert worker.renewals == 1 and worker.plan.failures == 0
        lease.check()


@pytest.mark.parametrize("timeout", [None, httpx.Timeout(5.0)], ids=["None", "httpx.Timeout"])
def test_a_lease_renews_with_a_timeout_that_is_not_a_number(
    api: Any, fake_time: FakeTime, namespace: str, timeout: Any
) -> None:
    """timeout=None (or an httpx.Timeout) goes to httpx as given; renewals are still
    bounded (by the default 10 s, and the lease), and they renew."""
    client = make_client(api, fake_time, timeout=timeout)
    with client.lease(namespace, KEY, ttl=30) as lease:
        worker = worker_of(lease)
        assert worker.step()
        assert worker.renewals == 1 and not lease.lost.is_set()


def test_a_renewal_answered_with_another_fencing_token_is_lost(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """The service keeps the fence on a renewal; an answer with another one (misrouted,
    or broken) cannot prove ownership: the lease is lost, and its token is not changed
    (a higher one would beat the real newer owner at a FenceGuard)."""

    def fault(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith("/renew"):
            answer = bridge(api).handle_request(request)
            body = answer.json()
            return httpx.Response(200, json={**body, "fencing_token": body["fencing_token"] + 100})
        return None

    client = make_client(api, fake_time, fault=fault)
    told: list[LeaseLost] = []
    with client.lease(namespace, KEY, ttl=30, on_lost=told.append) as lease:
        fence = lease.fencing_token
        assert not worker_of(lease).step()
        assert lease.lost.is_set() and lease.fencing_token == fence
        assert [error.error for error in told] == [
            "A renewal was answered with another fencing token than the lease's: "
            "ownership can no longer be proven"
        ]
        with pytest.raises(LeaseLost):
            lease.check()
        assert type(lease.lost_error) is LeaseLost
    # Not the service's word: it may hold the lease still, and the block's end released it.
    assert isinstance(make_client(api, fake_time).acquire(namespace, KEY), Lease)


@pytest.mark.parametrize("answer", [404, 400], ids=["a proxy's 404", "400 invalid"])
def test_a_lease_whose_renewal_was_refused_is_released_on_exit(
    api: Any, fake_time: FakeTime, namespace: str, answer: int
) -> None:
    """A renewal refused by something other than the service's ``lost`` (a proxy's 404,
    a 400) ends the lease for this worker, but the service may still hold it: leaving
    the block releases it, so that the key is free at once rather than after its TTL."""
    sent: list[str] = []

    def fault(request: httpx.Request) -> httpx.Response | None:
        sent.append(request.url.path.rsplit("/", 1)[-1])
        if request.url.path.endswith("/renew"):
            body = {"ok": False, "status": "invalid", "error": "refused"}
            return httpx.Response(answer, json=body) if answer == 400 else httpx.Response(404)
        return None

    client = make_client(api, fake_time, fault=fault)
    with client.lease(namespace, KEY, ttl=30) as lease:
        assert not worker_of(lease).step()
        assert lease.lost.is_set()
        assert lease.lost_error is not None and "ownership can no longer be assured" in (
            lease.lost_error.error
        )
    assert sent[-2:] == ["renew", "release"]
    assert isinstance(make_client(api, fake_time).acquire(namespace, KEY), Lease)


def test_a_lease_the_service_answered_lost_is_not_released_on_exit(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """A renewal answered ``lost`` by the service: nothing to release, none is sent."""
    sent: list[str] = []

    def fault(request: httpx.Request) -> httpx.Response | None:
        sent.append(request.url.path.rsplit("/", 1)[-1])
        return None

    client = make_client(api, fake_time, fault=fault)
    with client.lease(namespace, KEY, ttl=30) as lease:
        other = make_client(api, fake_time)
        other.release(namespace, KEY, lease.grant.owner_token if lease.grant else "")
        assert not worker_of(lease).step()
        assert lease.lost.is_set()
    assert sent[-1] == "renew"


def test_acquire_raises_lease_held_when_the_wait_is_over(
    client: LeaseClient, namespace: str, fake_time: FakeTime
) -> None:
    """With the wait exhausted the last LeaseHeld is raised, after the server waited it
    out; the last try is at the deadline."""
    client.acquire(namespace, KEY, ttl=60)
    started = fake_time.monotonic()
    told: list[tuple[str, float]] = []
    with pytest.raises(LeaseHeld) as held:
        client.acquire(
            namespace, KEY, wait=3, on_wait=lambda error, delay: told.append((error.status, delay))
        )
    assert fake_time.monotonic() - started == 3
    assert held.value.retry_after_seconds == 57
    assert fake_time.waits == []
    assert told == [("held", 0.0)]  # the service's wait ended held: progress, no pause
    with pytest.raises(LeaseHeld):
        client.acquire(namespace, KEY)  # no wait: one try


# -- held leases ------------------------------------------------------------------------------


def test_lease_block_holds_then_releases(client: LeaseClient, namespace: str) -> None:
    """A lease block acquires, exposes the fence, starts the worker and releases on exit."""
    with client.lease(namespace, KEY, ttl=30) as lease:
        assert lease.fencing_token > 0
        lease.check()
        assert not lease.lost.is_set()
        assert ManualThread.instances[-1].started
        assert "held" in repr(lease)
    assert worker_of(lease).stopped
    after = client.acquire(namespace, KEY)
    assert isinstance(after, Lease)
    assert after.fencing_token > lease.fencing_token
    with pytest.raises(LeaseLost):
        lease.check()


def test_lease_block_that_raises_still_releases(client: LeaseClient, namespace: str) -> None:
    """An exception in the block propagates, and the lease is released all the same."""
    with pytest.raises(RuntimeError, match="boom"), client.lease(namespace, KEY):
        raise RuntimeError("boom")
    assert isinstance(client.acquire(namespace, KEY), Lease)


def test_a_release_that_fails_at_exit_is_logged_and_the_blocks_error_goes_on(
    api: Any, fake_time: FakeTime, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The release at exit on a client closed meanwhile (httpx: RuntimeError) is
    logged; the block's own exception is what the caller sees."""
    client = make_client(api, fake_time)

    def block() -> None:
        with client.lease(namespace, KEY):
            client.close()
            raise ValueError("the block's own")

    with (
        caplog.at_level(logging.WARNING, logger="leasekeeper.client"),
        pytest.raises(ValueError, match="the block's own"),
    ):
        block()
    assert "could not release the lease (RuntimeError)" in caplog.text


@pytest.mark.parametrize("ttl", [None, 2.5, True, "30"])
def test_a_ttl_that_is_not_an_int_is_refused_before_acquiring(
    client: LeaseClient, namespace: str, ttl: Any
) -> None:
    """Not an acquire that succeeds and then fails to plan its renewals, holding the key."""
    with pytest.raises(TypeError, match="ttl must be"):
        client.lease(namespace, KEY, ttl=ttl)
    assert isinstance(client.acquire(namespace, KEY), Lease)


class _NoThreads(threading.Thread):
    """A real thread that cannot start (as when the process is out of threads)."""

    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def test_a_lease_whose_renewal_cannot_start_is_released(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """An error after the acquire, inside ``with``'s entry, lets the key go at once."""
    client = make_client(api, fake_time)
    client._thread_factory = _NoThreads
    with pytest.raises(RuntimeError, match="new thread"), client.lease(namespace, KEY):
        pytest.fail("the block must not run")
    assert isinstance(make_client(api, fake_time).acquire(namespace, KEY), Lease)


def test_a_lost_lease_is_not_released_at_exit(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """Once the service said lost (or the local expiry passed), leaving the block sends
    no release: there is nothing to let go, and a down service would only delay exit."""
    paths: list[str] = []

    def fault(request: httpx.Request) -> httpx.Response | None:
        paths.append(request.url.path.rsplit("/", 1)[-1])
        if request.url.path.endswith("/renew"):
            return httpx.Response(409, json={"ok": False, "status": "lost", "error": "gone"})
        return None

    client = make_client(api, fake_time, fault=fault)
    with client.lease(namespace, KEY) as lease:
        assert not worker_of(lease).step()
        assert lease.lost.is_set()
    assert paths == ["lease", "renew"]


def test_lease_on_a_completed_key_returns_the_result(client: LeaseClient, namespace: str) -> None:
    """A completed key gives completed=True and the stored result; nothing renews or releases."""
    with client.lease(namespace, KEY, fingerprint="f") as lease:
        assert lease.complete({"n": 1, "password": "hunter2"}) == {"n": 1, "password": "[redacted]"}
    threads = len(ManualThread.instances)
    with client.lease(namespace, KEY, fingerprint="f") as again:
        assert again.completed
        assert again.result == {"n": 1, "password": "[redacted]"}
        assert again.completion is not None
        assert again.completion.fencing_token == lease.fencing_token == 1
        # This worker never held the key: no fence to write with (a FenceGuard would
        # take the completer's, an equal one), as check() says.
        with pytest.raises(LeaseLost, match="must not write"):
            _ = again.fencing_token
        assert repr(again) == "<HeldLease completed fencing_token=1>"
        assert again.renewer is None
        with pytest.raises(LeaseLost, match="completed"):
            again.check()
    assert len(ManualThread.instances) == threads


def test_renewal_runs_at_a_third_of_the_ttl(
    client: LeaseClient, namespace: str, fake_time: FakeTime
) -> None:
    """Each worker turn waits ttl/3 on its event (fake time) and moves the service's expiry."""
    with client.lease(namespace, KEY, ttl=30) as lease:
        worker = worker_of(lease)
        assert lease.grant is not None
        expiry = lease.grant.lease_expires_at_timestamp
        fake_time.waits.clear()
        assert worker.step()
        assert worker.step()
        assert fake_time.waits == [10.0, 10.0]
        assert worker.renewals == 2
        assert lease.grant.lease_expires_at_timestamp == expiry + 20
        lease.check()
    assert not worker.step()  # stopped with the block


def test_a_renewal_request_never_waits_past_the_lease(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """On its own httpx client, a renewal's timeout is cut to the time the lease has left."""
    timeouts: list[Any] = []

    def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/renew"):
            timeouts.append(request.extensions["timeout"]["read"])

    client = make_client(api, fake_time, fault=record)
    with client.lease(namespace, KEY, ttl=3) as lease:
        assert worker_of(lease).step()  # at t=1: 2 s left
    with client.lease(namespace, KEY, ttl=60) as lease:
        assert worker_of(lease).step()  # at t=20: 40 s left, the client's 10 s apply
    assert timeouts == [pytest.approx(2.0), 10.0]


def _answered_late(
    api: Any, fake_time: FakeTime, route: str, seconds: float
) -> Callable[[httpx.Request], httpx.Response | None]:
    """A ``bridge`` fault: a request to ``route`` is decided by the service at once, and
    its answer takes ``seconds`` (of fake time) to come back."""
    app = bridge(api)

    def fault(request: httpx.Request) -> httpx.Response | None:
        if not request.url.path.endswith(route):
            return None
        answer = app.handle_request(request)  # granted on the service now...
        fake_time.clock.advance(seconds)  # ...and the answer is slow on its way back
        return answer

    return fault


@pytest.mark.parametrize("route", ["/lease", "/renew"], ids=["acquire", "renewal"])
def test_the_local_expiry_counts_the_ttl_from_when_the_request_was_sent(
    api: Any, fake_time: FakeTime, namespace: str, route: str
) -> None:
    """A grant whose answer took 5 s to arrive: the service's lease runs from when it
    decided, so the local expiry counts the TTL from when the request was sent, not
    from the answer. At the service's expiry, when another worker can take the key,
    check() already says lost (counted from the answer, it would say held 5 s more)."""
    client = make_client(api, fake_time, fault=_answered_late(api, fake_time, route, 5))
    told: list[LeaseLost] = []
    with client.lease(namespace, KEY, ttl=30, on_lost=told.append) as lease:
        if route == "/renew":
            assert worker_of(lease).step() and worker_of(lease).renewals == 1
        fake_time.clock.advance(24.999)  # the request was sent 5 s ago: 1 ms is left
        lease.check()
        fake_time.clock.advance(0.001)  # the service's expiry
        other = make_client(api, fake_time).acquire(namespace, KEY)
        assert isinstance(other, Lease)  # the service let it go
        with pytest.raises(LeaseLost, match="expired"):
            lease.check()
        assert len(told) == 1


def test_server_taking_the_lease_away_sets_lost(
    api: Any, fake_time: FakeTime, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """When the lease expired on the service and another took it, the renewal says lost.

    The client's clock is its own here (the process was paused, say), so only the
    service's answer can tell it that ownership ended.
    """
    own_time = FakeTime(FakeClock())
    client = make_client(api, own_time)
    told: list[LeaseLost] = []
    with client.lease(namespace, KEY, ttl=30, on_lost=told.append) as lease:
        fake_time.clock.advance(31)  # the service's clock: the lease has expired
        other = make_client(api, fake_time).acquire(namespace, KEY)
        assert isinstance(other, Lease)
        assert other.fencing_token > lease.fencing_token
        with caplog.at_level(logging.WARNING, logger="leasekeeper.client"):
            assert not worker_of(lease).step()
        assert lease.lost.is_set()
        assert len(told) == 1
        assert isinstance(lease.lost_error, LeaseLost)
        assert "does not match the current owner" in lease.lost_error.error
        with pytest.raises(LeaseLost):
            lease.check()
        with pytest.raises(LeaseLost):
            lease.complete("too late")
        assert "lost" in repr(lease)
    assert any("lease lost" in r.message for r in caplog.records)
    assert all(namespace not in r.message for r in caplog.records)
    # Exiting did not disturb the new owner.
    client.renew(namespace, KEY, other.owner_token)


def test_unavailability_until_the_expiry_marks_the_lease_lost(
    api: Any, fake_time: FakeTime, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Renewals failing with 503 are retried sooner, and past the expiry the lease is lost."""
    down = threading.Event()

    def fault(request: httpx.Request) -> httpx.Response | None:
        if down.is_set() and request.url.path.endswith("/renew"):
            return httpx.Response(
                503, json={"ok": False, "status": "unavailable", "error": "down"},
                headers={"retry-after": "1"},
            )  # fmt: skip
        return None

    client = make_client(api, fake_time, fault=fault)
    told: list[LeaseLost] = []
    with client.lease(namespace, KEY, ttl=30, on_lost=told.append) as lease:
        worker = worker_of(lease)
        down.set()
        start = fake_time.monotonic()
        with caplog.at_level(logging.WARNING, logger="leasekeeper.client"):
            turns = 0
            while worker.step():
                turns += 1
                assert turns < 100
        assert lease.lost.is_set()
        assert fake_time.monotonic() - start == pytest.approx(30, abs=0.01)
        assert len(told) == 1
        assert "expired before a renewal succeeded" in told[0].error
        assert worker.plan.failures == turns
    retries = [r for r in caplog.records if "retrying in" in r.message]
    assert len(retries) == turns
    assert any(r.levelno == logging.WARNING and "lease lost" in r.message for r in caplog.records)


def test_a_renewal_unanswered_by_the_expiry_marks_the_lease_lost_then(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """A renewal whose answer has not come by the local expiry (a server answering a
    byte at a time, a hung name lookup: httpx bounds each read, not the request) does
    not hold back the news: the lease is reported lost at the expiry, and an answer
    that comes later does not revive it."""
    app = bridge(api)
    renewals: list[bool] = []

    def fault(request: httpx.Request) -> httpx.Response | None:
        if not request.url.path.endswith("/renew"):
            return None
        answer = app.handle_request(request)  # renewed on the service...
        deadline = ManualThread.instances[-1]
        assert deadline.started
        deadline.target()  # ...but the answer is still on its way at the expiry
        renewals.append(lease.lost.is_set())
        return answer

    client = make_client(api, fake_time, fault=fault)
    told: list[LeaseLost] = []
    with client.lease(namespace, KEY, ttl=30, on_lost=told.append) as lease:
        worker = worker_of(lease)
        start = fake_time.monotonic()
        worker.step()
        assert renewals == [True]  # lost while the renewal was in flight
        assert fake_time.monotonic() - start == pytest.approx(30)  # ttl/3, then the rest
        assert len(told) == 1
        assert "still waiting for its answer" in told[0].error
        with pytest.raises(LeaseLost):
            lease.check()  # the late answer did not revive it
        assert not worker.step()
        assert renewals == [True]  # and no renewal was sent after it


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (409, {"ok": False, "status": "lost", "error": "You do not hold this lease"}),
        (503, {"ok": False, "status": "unavailable", "error": "down"}),
    ],
    ids=["lost", "unavailable"],
)
def test_on_lost_is_called_once_when_a_late_answer_ends_the_lease_again(
    api: Any, fake_time: FakeTime, namespace: str, status: int, body: dict[str, Any]
) -> None:
    """A renewal still unanswered at the local expiry reports the lease lost then; its
    answer, when it comes (lost, or a 503 that the worker retries past the expiry), does
    not report it again: on_lost is called once, and lost_error keeps the first reason."""

    def fault(request: httpx.Request) -> httpx.Response | None:
        if not request.url.path.endswith("/renew"):
            return None
        ManualThread.instances[-1].target()  # the answer is still on its way at the expiry
        return httpx.Response(status, json=body)

    client = make_client(api, fake_time, fault=fault)
    told: list[LeaseLost] = []
    with client.lease(namespace, KEY, ttl=30, on_lost=told.append) as lease:
        worker = worker_of(lease)
        turns = 0
        while worker.step():
            turns += 1
            assert turns < 10
        assert [error.error for error in told] == [
            "The lease expired while a renewal was still waiting for its answer"
        ]
        assert lease.lost_error is told[0]


def _stuck_renewals() -> tuple[threading.Event, threading.Event, Any]:
    """A ``bridge`` fault whose renewals hang until ``let_go`` is set: (in_flight,
    let_go, fault)."""
    in_flight, let_go = threading.Event(), threading.Event()

    def fault(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith("/renew"):
            in_flight.set()
            let_go.wait(30)
        return None

    return in_flight, let_go, fault


def _leave_within(lease: HeldLease, seconds: float) -> bool:
    """Whether leaving ``lease``'s block (in a thread of its own) returns within ``seconds``."""
    leaving = threading.Thread(target=lease.__exit__, args=(None, None, None))
    leaving.start()
    leaving.join(seconds)
    return not leaving.is_alive()


def test_leaving_a_lost_lease_does_not_wait_for_a_renewal_still_in_flight(
    api: Any, namespace: str
) -> None:
    """With a renewal stuck past the expiry (the lease reported lost meanwhile), leaving
    the block neither waits for that renewal nor for the lock it holds."""
    in_flight, let_go, fault = _stuck_renewals()
    # Real threads and time: renewed at 0.33 s, lost at 1 s.
    with LeaseClient(BASE_URL, transport=bridge(api, fault)) as client:
        lease = client.lease(namespace, KEY, ttl=1).__enter__()
        try:
            assert in_flight.wait(5) and lease.lost.wait(5)
            assert _leave_within(lease, 5)  # it would wait for the request otherwise
        finally:
            let_go.set()
            worker_of(lease)._thread.join(5)
    assert lease.lost_error is not None
    assert "still waiting for its answer" in lease.lost_error.error


def test_leaving_before_the_expiry_does_not_wait_for_a_stuck_renewal_for_ever(
    api: Any, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Leaving the block while a renewal hangs, before the expiry: the renewal is waited
    for up to the request timeout, then the lease is left to expire (a WARNING says
    so) rather than its lock waited for as long as the request hangs."""
    in_flight, let_go, fault = _stuck_renewals()
    with LeaseClient(BASE_URL, transport=bridge(api, fault), timeout=0.5) as client:
        lease = client.lease(namespace, KEY, ttl=4).__enter__()  # renewed at 1.33 s
        try:
            assert in_flight.wait(5)
            assert not lease.lost.is_set()
            with caplog.at_level(logging.WARNING, logger="leasekeeper.client"):
                assert _leave_within(lease, 8)  # the wait is 1.5 s: the timeout + 1
        finally:
            let_go.set()
            worker_of(lease)._thread.join(5)
    assert "it expires by itself after its TTL" in caplog.text


def test_a_slow_complete_holding_the_lock_is_not_a_renewal_waiting_for_its_answer(
    api: Any, namespace: str
) -> None:
    """A renewal that waits for the lock while a slow complete holds it past the local
    expiry does not report the lease lost: its deadline starts when it is sent."""
    inner = bridge(api)

    def fault(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith("/complete"):
            answer = inner.handle_request(request)  # stored at once...
            time.sleep(1.3)  # ...the answer slow to come back, past the 1 s TTL
            return answer
        return None

    told: list[LeaseLost] = []
    with (
        LeaseClient(BASE_URL, transport=bridge(api, fault)) as client,
        client.lease(namespace, KEY, ttl=1, on_lost=told.append) as lease,
    ):
        assert lease.complete({"ok": 1}) == {"ok": 1}
    assert lease.completed
    assert not told, [error.error for error in told]


def test_renewal_stops_at_the_end_of_the_lifecycle(
    make_api: Any, fake_time: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    """Near the lifecycle end the grant shrinks; the worker stops and reports lost at the end."""
    api = make_api(lifecycle_seconds=40)
    client = make_client(api, fake_time)
    namespace = client.create_namespace()
    with client.lease(namespace, KEY, ttl=30) as lease:
        worker = worker_of(lease)
        start = fake_time.monotonic()
        with caplog.at_level(logging.WARNING, logger="leasekeeper.client"):
            assert worker.step()  # t=10: granted 30 (to t=40)
            assert not worker.plan.final
            assert worker.step()  # t=20: granted 20, capped by the lifecycle
            assert worker.plan.final
            assert not worker.step()  # t=40: over
        assert fake_time.monotonic() - start == pytest.approx(40)
        assert lease.lost.is_set()
        assert lease.lost_error is not None
        assert "lifecycle" in lease.lost_error.error
    assert any("cannot be renewed" in r.message for r in caplog.records)


def test_a_late_renewal_is_logged(
    client: LeaseClient, namespace: str, fake_time: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    """A turn that wakes well after it was due logs a WARNING and still renews."""
    with client.lease(namespace, KEY, ttl=30) as lease:
        fake_time.oversleep = 8.0
        with caplog.at_level(logging.WARNING, logger="leasekeeper.client"):
            assert worker_of(lease).step()
        assert not lease.lost.is_set()
    assert any("late" in r.message for r in caplog.records)


def test_the_worker_holds_the_lease_weakly(client: LeaseClient, namespace: str) -> None:
    """A lease object nobody holds is not renewed: its worker ends at the next turn."""
    lease = client.lease(namespace, KEY, ttl=30).__enter__()
    worker = worker_of(lease)
    del lease
    gc.collect()
    assert not worker.step()
    assert worker.renewals == 0


def test_check_raises_once_the_local_estimate_has_expired(
    client: LeaseClient, namespace: str, fake_time: FakeTime
) -> None:
    """check() trusts no lease past its local expiry estimate, even before the worker ran."""
    told: list[LeaseLost] = []
    with client.lease(namespace, KEY, ttl=30, on_lost=told.append) as lease:
        fake_time.clock.advance(30)
        with pytest.raises(LeaseLost, match="expired"):
            lease.check()
        assert lease.lost.is_set()
        assert len(told) == 1


def test_a_too_large_result_leaves_the_lease_held(client: LeaseClient, namespace: str) -> None:
    """complete() refused as too large keeps the lease held and renewed; exit releases it."""
    with client.lease(namespace, KEY, ttl=30) as lease:
        with pytest.raises(PayloadTooLarge):
            lease.complete("x" * 40_000)
        assert not lease.completed
        assert worker_of(lease).step()
        lease.check()
    assert isinstance(client.acquire(namespace, KEY), Lease)


def test_release_ends_the_lease_early(client: LeaseClient, namespace: str) -> None:
    """lease.release() releases before the block ends; exit does nothing more."""
    with client.lease(namespace, KEY) as lease:
        lease.release()
        assert isinstance(client.acquire(namespace, KEY), Lease)
        with pytest.raises(LeaseLost):
            lease.check()


def test_a_lease_is_entered_once(client: LeaseClient, namespace: str) -> None:
    """Entering the same HeldLease twice is a programming error."""
    held = client.lease(namespace, KEY)
    with held, pytest.raises(RuntimeError):
        held.__enter__()
    with pytest.raises(RuntimeError):
        _ = client.lease(namespace, "other").fencing_token


def test_renewal_thread_renews_for_real_and_stops_with_the_block(api: Any, namespace: str) -> None:
    """With the default thread and event, renewals happen in the background until exit."""
    renewed = threading.Event()
    renewals: list[str] = []

    def count(request: httpx.Request) -> None:
        if request.url.path.endswith("/renew"):
            renewals.append(request.url.path)
            if len(renewals) >= 2:
                renewed.set()

    with LeaseClient(BASE_URL, transport=bridge(api, count)) as client:
        with client.lease(namespace, KEY, ttl=1) as lease:  # renews every ~0.33 s
            assert renewed.wait(5)
        worker = worker_of(lease)
        assert worker.stopped
        assert not worker._thread.is_alive()
        assert not lease.lost.is_set()
        count_at_exit = len(renewals)
        assert isinstance(client.acquire(namespace, KEY), Lease)  # released
        assert len(renewals) == count_at_exit


# -- once -------------------------------------------------------------------------------------


def test_once_runs_the_function_once_and_returns_the_stored_result(
    client: LeaseClient, namespace: str
) -> None:
    """The function runs for the first call; later calls get the stored result."""
    calls: list[int] = []

    @client.once(namespace, key=lambda order: f"charge:{order}", fingerprint=lambda order: "v1")
    def charge(order: int) -> dict[str, Any]:
        calls.append(order)
        return {"order": order, "token": "secret"}

    assert charge(501) == {"order": 501, "token": "[redacted]"}
    assert charge(501) == {"order": 501, "token": "[redacted]"}
    assert charge(502) == {"order": 502, "token": "[redacted]"}
    assert calls == [501, 502]
    assert charge.__name__ == "charge"


def test_once_gives_the_function_its_lease(client: LeaseClient, namespace: str) -> None:
    """Inside the function current_lease() is the HeldLease (check it, send its fence);
    outside one there is none."""
    seen: list[HeldLease] = []

    @client.once(namespace, key="pay:1")
    def pay() -> int:
        lease = current_lease()
        assert isinstance(lease, HeldLease)
        lease.check()
        seen.append(lease)
        return lease.fencing_token

    assert pay() == 1
    assert seen[0].completed
    with pytest.raises(LookupError, match="inside a function run by once"):
        current_lease()


def test_once_stores_the_result_through_a_passing_outage(
    api: Any, fake_time: FakeTime, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A complete refused as unavailable, unreachable or 408 is tried again while the
    lease is held: the work that was done is stored, not done again by the next caller."""
    answers: list[httpx.Response | None] = [
        httpx.Response(503, json={"ok": False, "status": "unavailable", "error": "down"}),
        httpx.Response(408, json={"ok": False, "status": "timeout", "error": "slow"}),
        None,
    ]

    def fault(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith("/complete") and answers[0] is not None:
            return answers.pop(0)
        return None

    client = make_client(api, fake_time, fault=fault)
    calls: list[int] = []

    @client.once(namespace, key="charge:7")
    def charge() -> dict[str, int]:
        calls.append(1)
        return {"charged": 7}

    with caplog.at_level(logging.WARNING, logger="leasekeeper.client"):
        assert charge() == {"charged": 7}
    assert charge() == {"charged": 7}
    assert calls == [1]
    assert fake_time.waits == [1, 0.5]  # Retry-After (1 s by default), then the backoff
    assert "storing the result failed (unavailable: down)" in caplog.text


def test_once_finds_the_result_its_lost_answer_stored(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """The complete stored the result but its answer was lost; the retry is told lost
    (the key is completed), looks, finds the key completed with its own fence, and
    returns the stored result: no error, and the work is not done again."""
    client = make_client(api, fake_time, fault=answer_lost_after_complete(api))
    calls: list[int] = []

    @client.once(namespace, key="charge:10", fingerprint="v1")
    def charge() -> dict[str, int]:
        calls.append(1)
        return {"charged": 10}

    assert charge() == {"charged": 10}
    assert charge() == {"charged": 10}
    assert calls == [1]


def test_a_second_complete_after_an_unsure_one_was_stored_is_refused(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """Once a retried complete() has found its result stored, the lease is completed: a
    further complete() with another result raises LeaseLost, as it would have without the
    blip, rather than report the first result as stored for it."""
    client = make_client(api, fake_time, fault=answer_lost_after_complete(api))
    with client.lease(namespace, KEY, ttl=30) as lease:
        with pytest.raises(ServiceUnreachable):
            lease.complete({"v": 1})
        assert lease.complete({"v": 1}) == {"v": 1}
        with pytest.raises(LeaseLost, match="completed"):
            lease.complete({"v": 2})
    found = make_client(api, fake_time).acquire(namespace, KEY)
    assert isinstance(found, Completed) and found.result == {"v": 1}


@pytest.mark.parametrize("stored", [False, True], ids=["before storing", "after storing"])
@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(500, json={"ok": False, "status": "internal", "error": "Internal error"}),
        httpx.Response(200, content=b'{"ok": tru'),
        httpx.Response(
            409, content=b"<html>Conflict</html>", headers={"content-type": "text/html"}
        ),
    ],
    ids=["500", "unreadable 200", "a proxy's 409"],
)
def test_once_stores_the_result_through_an_answer_that_says_nothing(
    api: Any, fake_time: FakeTime, namespace: str, answer: httpx.Response, stored: bool
) -> None:
    """A complete answered by a 500, a 2xx that cannot be read or a 409 that is not the
    service's, whether the service stored the result or not, does not say whether it
    did: the complete is tried again, and the work is not done twice."""
    left = [1]

    def fault(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith("/complete") and left[0]:
            left[0] -= 1
            if stored:
                bridge(api).handle_request(request)
            return answer
        return None

    client = make_client(api, fake_time, fault=fault)
    calls: list[int] = []

    @client.once(namespace, key="charge:14", fingerprint="v1")
    def charge() -> dict[str, int]:
        calls.append(1)
        return {"charged": 14}

    assert charge() == {"charged": 14}
    assert charge() == {"charged": 14}
    assert calls == [1]
    assert left == [0]


def test_complete_called_again_after_an_unsure_answer_finds_its_own_result(
    api: Any, fake_time: FakeTime, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """lease.complete() whose answer was lost (the result stored) raises, and stops the
    renewals, which would be answered lost; called again, it finds the result this owner
    stored instead of reporting the lease lost."""
    client = make_client(api, fake_time, fault=answer_lost_after_complete(api))
    told: list[LeaseLost] = []
    with client.lease(namespace, "charge:15", ttl=30, on_lost=told.append) as lease:
        with (
            caplog.at_level(logging.WARNING, logger="leasekeeper.client"),
            pytest.raises(ServiceUnreachable),
        ):
            lease.complete({"charged": 15})
        assert "renewals have stopped: call complete() again" in caplog.text
        assert worker_of(lease).stopped
        assert lease.complete({"charged": 15}) == {"charged": 15}
        assert lease.completed
    assert told == []
    again = client.acquire(namespace, "charge:15")
    assert isinstance(again, Completed) and again.result == {"charged": 15}


def test_complete_called_again_after_an_interrupted_one_finds_its_own_result(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """Ctrl-C while complete() waits for its answer: the request may have been stored,
    so renewals stop (one would be answered lost), and the next complete() asks the
    service first, and finds the result its own rather than reporting the lease lost."""
    left = [1]

    def fault(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith("/complete") and left[0]:
            left[0] -= 1
            bridge(api).handle_request(request)
            raise KeyboardInterrupt
        return None

    client = make_client(api, fake_time, fault=fault)
    told: list[LeaseLost] = []
    with client.lease(namespace, "charge:18", ttl=30, on_lost=told.append) as lease:
        with pytest.raises(KeyboardInterrupt):
            lease.complete(18)
        # A renewal now would be answered lost (the key is completed): none is sent.
        assert not worker_of(lease).step()
        assert not lease.lost.is_set()
        assert lease.complete(18) == 18
    assert told == []


def test_a_lookup_without_an_answer_leaves_the_complete_unsure_not_lost(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """The complete stored the result and its answer was lost; the retry is told lost,
    and the lookup that would find the result its own gets a 503: that says nothing, so
    once tries again (and finds it) rather than raise LeaseLost for work that is stored."""
    stored = answer_lost_after_complete(api)
    lookups = [0]

    def fault(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith("/lease") and b'"ttl_seconds":1' in request.content:
            lookups[0] += 1
            if lookups[0] == 1:
                return httpx.Response(503, json={"ok": False, "status": "unavailable"})
        return stored(request)

    client = make_client(api, fake_time, fault=fault)
    calls: list[int] = []

    @client.once(namespace, key="charge:21", fingerprint="v1")
    def charge() -> int:
        calls.append(1)
        return 21

    assert charge() == 21
    assert calls == [1] and lookups == [2]


def test_no_renewal_reports_lost_while_a_stored_complete_is_retried(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """While once retries a complete whose first attempt stored the result, renewal is
    stopped: a renewal turn then would be answered lost (the key is completed) and call
    on_lost for work that succeeded."""
    client = make_client(api, fake_time, fault=answer_lost_after_complete(api))
    told: list[LeaseLost] = []
    plain_event = client._event_factory

    class TurnsTheWorker:
        """A pause during which the renewal worker takes its turn, as its thread would."""

        def __init__(self) -> None:
            self.event = plain_event()

        def wait(self, timeout: float | None = None) -> bool:
            worker = worker_of(current)
            if not worker.stopped:
                worker.step()
            return self.event.wait(timeout)

    @client.once(namespace, key="charge:13", on_lost=told.append)
    def charge() -> int:
        nonlocal current
        current = cast(HeldLease, current_lease())
        client._event_factory = TurnsTheWorker  # type: ignore[assignment]
        return 13

    current: HeldLease
    assert charge() == 13
    assert told == []
    assert not current.lost.is_set()


def test_a_lost_answer_is_not_taken_for_someone_elses_completion(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """A retried complete answered lost, where the key was completed by another owner
    (this lease had expired and was taken): not ours, so lost is believed."""
    client = make_client(api, fake_time)
    lease_after: list[Any] = []
    with client.lease(namespace, "charge:12", ttl=5) as lease:
        fake_time.clock.advance(6)  # past this lease's expiry on the service too
        other = client.acquire(namespace, "charge:12")
        assert isinstance(other, Lease)
        client.complete(namespace, "charge:12", other.owner_token, "theirs")
        with pytest.raises(LeaseLost):
            lease._complete("mine", retried=True)
        lease_after.append(lease.completed)
    assert lease_after == [False]
    again = client.acquire(namespace, "charge:12")
    assert isinstance(again, Completed) and again.result == "theirs"


def _complete_unreachable(request: httpx.Request) -> httpx.Response | None:
    """A fault: every /lease/complete gets no answer; everything else reaches the app."""
    if request.url.path.endswith("/complete"):
        raise httpx.ConnectError("refused", request=request)
    return None


def test_once_gives_up_on_storing_when_the_lease_would_end(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """A complete that keeps failing is retried until the lease's local expiry (here no
    renewal runs), then its last error is raised: the result may not be stored."""

    client = make_client(api, fake_time, fault=_complete_unreachable)

    @client.once(namespace, key="charge:8", ttl=10)
    def charge() -> int:
        return 8

    with pytest.raises(ServiceUnreachable):
        charge()
    assert sum(fake_time.waits) == pytest.approx(10.0)


def test_once_stops_retrying_the_complete_at_the_leases_local_expiry(
    api: Any, fake_time: FakeTime, namespace: str
) -> None:
    """A function that ran 6 s of a 10 s lease (no renewal here) leaves 4 s: a complete
    that keeps failing is retried until the lease's local expiry, not for a whole TTL
    after the failure, when the service has let the key go to the next caller."""

    client = make_client(api, fake_time, fault=_complete_unreachable)

    @client.once(namespace, key="charge:23", ttl=10)
    def charge() -> int:
        fake_time.clock.advance(6)  # the work takes its time
        return 23

    with pytest.raises(ServiceUnreachable):
        charge()
    assert sum(fake_time.waits) == pytest.approx(4.0)


def test_once_with_another_fingerprint_is_a_conflict(client: LeaseClient, namespace: str) -> None:
    """Reusing a key with other input raises FingerprintConflict instead of a stale result."""

    @client.once(namespace, key="nightly", fingerprint=lambda day: day)
    def report(day: str) -> str:
        return day

    assert report("monday") == "monday"
    with pytest.raises(FingerprintConflict):
        report("tuesday")


def test_once_retries_after_the_function_raised(client: LeaseClient, namespace: str) -> None:
    """A function that raises leaves no result; the next call runs it again."""
    attempts: list[int] = []

    @client.once(namespace, key="flaky")
    def flaky() -> int:
        attempts.append(1)
        if len(attempts) == 1:
            raise ValueError("first try fails")
        return len(attempts)

    with pytest.raises(ValueError, match="first try"):
        flaky()
    assert flaky() == 2
    assert flaky() == 2


def test_once_across_threads_runs_once(api: Any, namespace: str) -> None:
    """Concurrent callers wait while the first runs, then all get its stored result."""
    started = threading.Event()
    release = threading.Event()
    calls: list[str] = []

    with LeaseClient(BASE_URL, transport=bridge(api)) as client:

        @client.once(namespace, key="job", ttl=30)
        def job() -> str:
            calls.append(threading.current_thread().name)
            started.set()
            release.wait(5)
            return "done"

        results: list[Any] = []
        first = threading.Thread(target=lambda: results.append(job()), name="first")
        first.start()
        assert started.wait(5)
        second = threading.Thread(target=lambda: results.append(job()), name="second")
        second.start()
        release.set()
        first.join(5)
        second.join(5)
    assert results == ["done", "done"]
    assert calls == ["first"]


def test_its_own_clients_requests_go_to_the_transport_as_httpxs_client_sends_them() -> None:
    """The client's own httpx client hands its requests straight to its transport
    (``_http.Direct``): the same URL, headers, body and timeout as httpx's client sends."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True, "status": "released", "fencing_token": 7})

    transport = httpx.MockTransport(answer)
    direct = LeaseClient(BASE_URL, transport=transport, timeout=3.0)
    assert direct._direct is not None and direct._direct.transport is transport
    through = httpx.Client(base_url=BASE_URL + "/services/v1", transport=transport, timeout=3.0)
    for client in (direct, LeaseClient(client=through)):
        assert client.release("ns", "k", "ot").fencing_token == 7
    sent, expected = seen
    assert (sent.method, sent.url, sent.content) == (
        expected.method,
        expected.url,
        expected.content,
    )
    assert sorted(sent.headers.multi_items()) == sorted(expected.headers.multi_items())
    assert (
        sent.extensions["timeout"] == expected.extensions["timeout"] == httpx.Timeout(3.0).as_dict()
    )


def test_a_url_with_credentials_goes_through_httpxs_client_as_basic_auth() -> None:
    """httpx's client turns a URL's user name and password into basic auth: such a URL
    is never handed to the transport directly, which would drop them."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True, "status": "released", "fencing_token": 7})

    client = LeaseClient("http://ops:pw@leases.invalid:8787", transport=httpx.MockTransport(answer))
    assert client._direct is not None and client._direct.transport is None
    assert client.release("ns", "k", "ot").fencing_token == 7
    assert seen[0].headers["authorization"] == "Basic b3BzOnB3"  # base64("ops:pw")


def test_its_own_client_sends_through_a_proxy_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    client = LeaseClient("http://leases.invalid:8787")
    assert client._direct is not None
    assert client._direct.transport is not client._http._transport  # the proxy's mount
    client.close()
