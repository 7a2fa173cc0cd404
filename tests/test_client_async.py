"""The asyncio client against the real app in-process (httpx.ASGITransport)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from leasekeeper import (
    AsyncLeaseClient,
    FakeClock,
    FingerprintConflict,
    InternalError,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    LeaseService,
    RateLimited,
    ServiceUnavailable,
    ServiceUnreachable,
    Settings,
)
from leasekeeper.client import (
    AsyncHeldLease,
    AsyncRenewalWorker,
    Completed,
    Lease,
    current_lease,
)
from leasekeeper.http import create_app
from tests.client_fakes import BASE_URL, FakeTime, manual_task
from tests.conftest import JumpingTimers

KEY = "invoice:2026-09-05"

Scenario = Callable[[httpx.AsyncBaseTransport], Awaitable[None]]


@pytest.fixture
def fake_time(clock: FakeClock) -> FakeTime:
    return FakeTime(clock)


@pytest.fixture
def run_app(make_store: Any, monotonic: Any, clock: FakeClock) -> Callable[..., None]:
    """``run_app(scenario, lifecycle_seconds=...)``: run ``scenario(transport)`` in a new loop."""

    def run(scenario: Scenario, *, lifecycle_seconds: int = 86_400) -> None:
        service = LeaseService(
            make_store("sqlite"), lifecycle_seconds=lifecycle_seconds, timers=JumpingTimers(clock)
        )
        app = create_app(
            service,
            Settings(lifecycle_seconds=lifecycle_seconds),
            monotonic=monotonic,
            run_cleanup=False,
        )

        async def main() -> None:
            await service.start()
            try:
                await scenario(httpx.ASGITransport(app=app))
            finally:
                await service.stop()

        asyncio.run(main())

    return run


def fake_client(transport: httpx.AsyncBaseTransport, time: FakeTime) -> AsyncLeaseClient:
    return AsyncLeaseClient(
        BASE_URL,
        transport=transport,
        monotonic=time.monotonic,
        signal_factory=time.signal,
        task_factory=manual_task,
        random=lambda: 0.0,
    )


def worker_of(lease: AsyncHeldLease) -> AsyncRenewalWorker:
    assert lease.renewer is not None
    return lease.renewer


def test_async_operations_round_trip(run_app: Callable[..., None], fake_time: FakeTime) -> None:
    """The async client mints, acquires, renews, releases and completes like the sync one."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        async with fake_client(transport, fake_time) as client:
            namespace = await client.create_namespace()
            lease = await client.acquire(namespace, KEY, ttl=60, fingerprint="f")
            assert isinstance(lease, Lease)
            assert lease.lease_expires_at == datetime(2026, 9, 5, 10, 1, tzinfo=UTC)
            with pytest.raises(LeaseHeld) as held:
                await client.acquire(namespace, KEY, fingerprint="f")
            assert held.value.retry_after_seconds == 60
            with pytest.raises(FingerprintConflict):
                await client.acquire(namespace, KEY, fingerprint="g")
            renewed = await client.renew(namespace, KEY, lease.owner_token, ttl=120)
            assert renewed.fencing_token == lease.fencing_token
            released = await client.release(namespace, KEY, lease.owner_token)
            assert released.fencing_token == lease.fencing_token
            with pytest.raises(LeaseLost):
                await client.release(namespace, KEY, lease.owner_token)
            again = await client.acquire(namespace, KEY, fingerprint="f")
            assert isinstance(again, Lease)
            done = await client.complete(namespace, KEY, again.owner_token, [1, {"cookie": "c"}])
            assert done.result == [1, {"cookie": "[redacted]"}]
            assert isinstance(await client.acquire(namespace, KEY, fingerprint="f"), Completed)

    run_app(scenario)


def test_async_transport_failure_is_service_unreachable() -> None:
    """An async request that gets no answer raises ServiceUnreachable."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectTimeout("timed out", request=request)

    async def main() -> None:
        client = AsyncLeaseClient(BASE_URL, transport=httpx.MockTransport(refuse))
        with pytest.raises(ServiceUnreachable):
            await client.create_namespace()
        await client.aclose()

    asyncio.run(main())


def test_async_acquire_waits_with_backoff(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """A held key is waited for by the server, which hands it over at the lease's
    expiry: the client pauses not once."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(transport, fake_time)
        namespace = await client.create_namespace()
        first = await client.acquire(namespace, KEY, ttl=2)
        started = fake_time.monotonic()
        second = await client.acquire(namespace, KEY, ttl=2, wait=10)
        assert isinstance(first, Lease)
        assert isinstance(second, Lease)
        assert second.fencing_token > first.fencing_token
        assert fake_time.waits == []
        assert fake_time.monotonic() - started == 2

    run_app(scenario)


def test_async_on_wait_may_be_a_coroutine_function(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """A coroutine on_wait is awaited before each pause, as a coroutine on_lost is."""
    told: list[tuple[str, float]] = []

    async def on_wait(error: LeaseError, delay: float) -> None:
        await asyncio.sleep(0)
        told.append((error.status, delay))

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(transport, fake_time)
        namespace = await client.create_namespace()
        await client.acquire(namespace, KEY, ttl=1)
        # Under a second to wait: too short to ask the server for, so the client polls.
        with pytest.raises(LeaseHeld):
            async with client.lease(namespace, KEY, wait=0.9, on_wait=on_wait):
                pass
        assert told == [("held", 0.25), ("held", 0.5), ("held", pytest.approx(0.15))]

    run_app(scenario)


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (429, b'{"ok":false,"status":"rate_limited","error":"slow","retry_after_seconds":3}'),
        (503, b"<html>bad gateway</html>"),
    ],
)
def test_async_acquire_waits_at_least_retry_after_for_a_limit_or_an_outage(
    fake_time: FakeTime, status: int, body: bytes
) -> None:
    """As in the sync client: a 429 or a 503 is not polled before its Retry-After (a held
    key's poll is capped by it instead); the last try is at the deadline."""

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers={"retry-after": "3"})

    async def scenario() -> None:
        client = fake_client(httpx.MockTransport(refuse), fake_time)
        with pytest.raises((RateLimited, ServiceUnavailable)):
            await client.acquire(None, "k" * 40, wait=10)
        assert fake_time.waits[:3] == [3, 3, 3]
        assert sum(w for w in fake_time.waits if w) == pytest.approx(10.0)

    asyncio.run(scenario())


def test_async_lease_renews_and_releases(run_app: Callable[..., None], fake_time: FakeTime) -> None:
    """async with: acquire, a renewal turn at ttl/3 on fake time, release on exit."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(transport, fake_time)
        namespace = await client.create_namespace()
        async with client.lease(namespace, KEY, ttl=30) as lease:
            lease.check()
            assert lease.grant is not None
            expiry = lease.grant.lease_expires_at_timestamp
            fake_time.waits.clear()
            assert await worker_of(lease).step()
            assert fake_time.waits == [10.0]
            assert lease.grant.lease_expires_at_timestamp == expiry + 10
        assert worker_of(lease).stopped
        after = await client.acquire(namespace, KEY)
        assert isinstance(after, Lease)
        assert after.fencing_token > lease.fencing_token

    run_app(scenario)


def test_async_lease_block_that_raises_or_is_cancelled_still_releases(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """As in the sync client: a block left by an exception releases the lease, and so does
    one whose task is cancelled (a timeout around the work, say): the key is free at once,
    not after its TTL."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(transport, fake_time)
        namespace = await client.create_namespace()
        with pytest.raises(ValueError, match="failed"):
            async with client.lease(namespace, "raised", ttl=30):
                raise ValueError("the work failed")
        assert isinstance(await client.acquire(namespace, "raised"), Lease)

        entered = asyncio.Event()

        async def work() -> None:
            async with client.lease(namespace, "cancelled", ttl=30):
                entered.set()
                await asyncio.Event().wait()

        task = asyncio.create_task(work())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert isinstance(await client.acquire(namespace, "cancelled"), Lease)

    run_app(scenario)


class _AnsweredLate(httpx.AsyncBaseTransport):
    """Requests to ``route`` are decided by the app at once, and their answer takes
    ``seconds`` of fake time to come back."""

    def __init__(
        self, inner: httpx.AsyncBaseTransport, time: FakeTime, route: str, seconds: float
    ) -> None:
        self.inner, self.time, self.route, self.seconds = inner, time, route, seconds

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        answer = await self.inner.handle_async_request(request)
        if request.url.path.endswith(self.route):
            self.time.clock.advance(self.seconds)
        return answer


@pytest.mark.parametrize("route", ["/lease", "/renew"], ids=["acquire", "renewal"])
def test_async_local_expiry_counts_the_ttl_from_when_the_request_was_sent(
    run_app: Callable[..., None], fake_time: FakeTime, route: str
) -> None:
    """As in the sync client: a grant answered 5 s late is counted from when its request
    was sent, so at the service's expiry, when another worker can take the key, check()
    says lost."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(_AnsweredLate(transport, fake_time, route, 5), fake_time)
        namespace = await client.create_namespace()
        told: list[LeaseLost] = []
        async with client.lease(namespace, KEY, ttl=30, on_lost=told.append) as lease:
            if route == "/renew":
                assert await worker_of(lease).step() and worker_of(lease).renewals == 1
            fake_time.clock.advance(24.999)  # the request was sent 5 s ago: 1 ms is left
            lease.check()
            fake_time.clock.advance(0.001)  # the service's expiry
            other = await fake_client(transport, fake_time).acquire(namespace, KEY)
            assert isinstance(other, Lease)
            with pytest.raises(LeaseLost, match="expired"):
                lease.check()
            await asyncio.sleep(0)
            assert len(told) == 1

    run_app(scenario)


def test_async_server_taking_the_lease_away_sets_lost(
    run_app: Callable[..., None], fake_time: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    """The service's lost answer sets lost, awaits an async on_lost, and check() raises."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(transport, FakeTime(FakeClock()))
        namespace = await client.create_namespace()
        told: list[LeaseLost] = []

        async def on_lost(error: LeaseLost) -> None:
            await asyncio.sleep(0)
            told.append(error)

        async with client.lease(namespace, KEY, ttl=30, on_lost=on_lost) as lease:
            fake_time.clock.advance(31)
            other = await fake_client(transport, fake_time).acquire(namespace, KEY)
            assert isinstance(other, Lease)
            with caplog.at_level(logging.WARNING, logger="leasekeeper.client"):
                assert not await worker_of(lease).step()
            assert lease.lost.is_set()
            assert len(told) == 1
            with pytest.raises(LeaseLost):
                lease.check()
            with pytest.raises(LeaseLost):
                await lease.complete("too late")
        await client.renew(namespace, KEY, other.owner_token)  # the new owner is untouched
        assert any("lease lost" in r.message for r in caplog.records)

    run_app(scenario)


def test_async_lease_on_a_completed_key(run_app: Callable[..., None], fake_time: FakeTime) -> None:
    """A completed key gives completed and the result, and no renewal task."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(transport, fake_time)
        namespace = await client.create_namespace()
        async with client.lease(namespace, KEY) as lease:
            assert await lease.complete({"ok": 1}) == {"ok": 1}
        async with client.lease(namespace, KEY) as again:
            assert again.completed
            assert again.result == {"ok": 1}
            assert again.completion is not None and again.completion.fencing_token == 1
            with pytest.raises(LeaseLost, match="must not write"):
                _ = again.fencing_token
            assert again.renewer is None

    run_app(scenario)


def test_async_results_keep_integers_past_64_bits(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """As in the sync client: 10**30 + 1 comes back an int, not the float 1e+30."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(transport, fake_time)
        namespace = await client.create_namespace()
        async with client.lease(namespace, KEY) as lease:
            assert await lease.complete([10**30 + 1]) == [10**30 + 1]
        async with client.lease(namespace, KEY) as again:
            assert again.completed
            assert again.result == [10**30 + 1] and type(again.result[0]) is int

    run_app(scenario)


def test_async_renewal_task_renews_for_real_and_is_cancelled_on_exit(
    run_app: Callable[..., None],
) -> None:
    """With the default signal and task, renewals run in the background until exit."""

    class Counting(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
            self.inner = inner
            self.renewals = 0
            self.twice = asyncio.Event()

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/renew"):
                self.renewals += 1
                if self.renewals >= 2:
                    self.twice.set()
            return await self.inner.handle_async_request(request)

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        counting = Counting(transport)
        async with AsyncLeaseClient(BASE_URL, transport=counting) as client:
            namespace = await client.create_namespace()
            async with client.lease(namespace, KEY, ttl=1) as lease:
                await asyncio.wait_for(counting.twice.wait(), 5)
            assert lease.renewer is not None
            assert lease.renewer._task is not None
            assert lease.renewer._task.done()
            assert not lease.lost.is_set()
            assert isinstance(await client.acquire(namespace, KEY), Lease)

    run_app(scenario)


def test_async_renewal_has_a_deadline_on_the_whole_request(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """A renewal whose answer does not come (a server answering a byte at a time: httpx
    bounds each read, not the request) is abandoned at the client's timeout and tried
    again; once the local expiry has passed meanwhile, the lease is reported lost."""

    class Hanging(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
            self.inner = inner
            self.renewals = 0

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if not request.url.path.endswith("/renew"):
                return await self.inner.handle_async_request(request)
            self.renewals += 1
            if self.renewals == 2:
                fake_time.clock.advance(25)  # the expiry passes while the answer is awaited
            await self.inner.handle_async_request(request)  # reaches the service...
            await asyncio.Event().wait()  # ...and its answer never comes
            raise AssertionError("unreachable")

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        hanging = Hanging(transport)
        client = AsyncLeaseClient(
            BASE_URL,
            transport=hanging,
            timeout=0.05,
            monotonic=fake_time.monotonic,
            signal_factory=fake_time.signal,
            task_factory=manual_task,
            random=lambda: 0.0,
        )
        async with client:
            namespace = await client.create_namespace()
            async with client.lease(namespace, KEY, ttl=30) as lease:
                worker = worker_of(lease)
                assert await worker.step()  # abandoned, to be tried again
                assert worker.plan.failures == 1
                assert not lease.lost.is_set()
                assert not await worker.step()  # abandoned past the expiry
                assert lease.lost.is_set()
                assert lease.lost_error is not None
                assert "still waiting for its answer" in lease.lost_error.error
        assert hanging.renewals == 2

    run_app(scenario)


def test_async_slow_complete_holding_the_lock_is_not_a_renewal_waiting_for_its_answer(
    run_app: Callable[..., None],
) -> None:
    """A renewal that waits for the lock while a slow complete holds it past the local
    expiry is not cut short and does not report the lease lost: its deadline starts
    when it is sent."""

    class SlowComplete(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
            self.inner = inner

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            answer = await self.inner.handle_async_request(request)
            if request.url.path.endswith("/complete"):
                await asyncio.sleep(1.3)  # stored at once, the answer past the 1 s TTL
            return answer

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        told: list[LeaseLost] = []
        async with AsyncLeaseClient(BASE_URL, transport=SlowComplete(transport)) as client:
            namespace = await client.create_namespace()
            async with client.lease(namespace, KEY, ttl=1, on_lost=told.append) as lease:
                assert await lease.complete({"ok": 1}) == {"ok": 1}
            assert lease.completed
            assert not told, [error.error for error in told]

    run_app(scenario)


def test_async_once_runs_once_across_tasks(run_app: Callable[..., None]) -> None:
    """Concurrent tasks calling an async once function: one runs it, all get the result."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        both_held = asyncio.Event()  # the two later callers asked the server to wait
        held: list[int] = []

        class Watching(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                if b'"wait_seconds"' in request.content:
                    held.append(1)
                    if len(held) >= 2:
                        both_held.set()
                return await transport.handle_async_request(request)

        async with AsyncLeaseClient(BASE_URL, transport=Watching()) as client:
            namespace = await client.create_namespace()
            calls: list[int] = []
            started = asyncio.Event()

            @client.once(namespace, key=lambda n: f"job:{n}", fingerprint=lambda n: "v1")
            async def job(n: int) -> dict[str, int]:
                calls.append(n)
                started.set()
                await asyncio.wait_for(both_held.wait(), 10)  # they wait while it works
                return {"n": n}

            first = asyncio.create_task(job(7))
            await started.wait()
            results = await asyncio.gather(first, job(7), job(7))
            assert results == [{"n": 7}] * 3
            assert calls == [7]

    run_app(scenario)


class _CompleteStoredThenHangs(httpx.AsyncBaseTransport):
    """The first /lease/complete reaches the app (stored), then its answer never comes."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.hung = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/complete") and not self.hung:
            self.hung = True
            await self.inner.handle_async_request(request)
            await asyncio.Event().wait()
        return await self.inner.handle_async_request(request)


def test_async_complete_called_again_after_a_cancelled_one_finds_its_own_result(
    run_app: Callable[..., None], fake_time: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    """A complete() cancelled while it waited for its answer (the caller's own timeout)
    may have been stored: renewals stop, and the next complete() finds the result its
    own. One answered 503 says so in a WARNING."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(_CompleteStoredThenHangs(transport), fake_time)
        namespace = await client.create_namespace()
        async with client.lease(namespace, "charge:19", ttl=30) as lease:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(lease.complete(19), 0.05)
            assert lease.renewer is not None
            assert not await lease.renewer.step()  # no renewal: it would be answered lost
            assert not lease.lost.is_set()
            assert await lease.complete(19) == 19

        flaky = _CompleteAnswered500Once(transport, landed=True)
        client = fake_client(flaky, fake_time)
        async with client.lease(namespace, "charge:20", ttl=30) as lease:
            with pytest.raises(InternalError):
                await lease.complete(20)
            assert await lease.complete(20) == 20

    with caplog.at_level(logging.WARNING, logger="leasekeeper.client"):
        run_app(scenario)
    assert "renewals have stopped: call complete() again" in caplog.text


class _RenewAnswersAnotherFence(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        answer = await self.inner.handle_async_request(request)
        if not request.url.path.endswith("/renew"):
            return answer
        body = json.loads(await answer.aread())
        return httpx.Response(200, json={**body, "fencing_token": body["fencing_token"] + 100})


def test_async_renewal_answered_with_another_fencing_token_is_lost(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """As in the sync client: lost, and the lease's token unchanged."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(_RenewAnswersAnotherFence(transport), fake_time)
        namespace = await client.create_namespace()
        async with client.lease(namespace, "fence-changed", ttl=30) as lease:
            fence = lease.fencing_token
            assert lease.renewer is not None
            assert not await lease.renewer.step()
            assert lease.lost.is_set() and lease.fencing_token == fence
            assert lease.lost_error is not None
            assert "another fencing token" in lease.lost_error.error
            assert type(lease.lost_error) is LeaseLost
        # Not the service's word: the block's end released it, and the key is free.
        again = await fake_client(transport, fake_time).acquire(namespace, "fence-changed")
        assert isinstance(again, Lease)

    run_app(scenario)


class _RenewRefused(httpx.AsyncBaseTransport):
    """Renewals get a proxy's 404; everything else reaches the app (``sent``: the routes)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.sent: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request.url.path.rsplit("/", 1)[-1])
        if request.url.path.endswith("/renew"):
            return httpx.Response(404)
        return await self.inner.handle_async_request(request)


def test_async_lease_whose_renewal_was_refused_is_released_on_exit(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """As in the sync client: a renewal refused by something other than the service's
    ``lost`` ends the lease for this worker, and leaving the block releases it."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        refusing = _RenewRefused(transport)
        client = fake_client(refusing, fake_time)
        namespace = await client.create_namespace()
        async with client.lease(namespace, "refused", ttl=30) as lease:
            assert not await worker_of(lease).step()
            assert lease.lost.is_set()
        assert refusing.sent[-2:] == ["renew", "release"]
        assert isinstance(
            await fake_client(transport, fake_time).acquire(namespace, "refused"), Lease
        )

    run_app(scenario)


class _RenewAnsweredLost(httpx.AsyncBaseTransport):
    """Renewals are answered ``lost`` (another owner took the key); the rest reaches the app."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/renew"):
            body = {"ok": False, "status": "lost", "error": "You do not hold this lease"}
            return httpx.Response(409, json=body)
        return await self.inner.handle_async_request(request)


def test_async_injected_client_gets_its_service_url_checked_too() -> None:
    """As in the sync client: with client=, a URL that is not http(s) with a host, or a
    client without a base_url, raises ValueError at once."""

    async def scenario() -> None:
        async with httpx.AsyncClient() as http:
            with pytest.raises(ValueError, match="must be http:// or https:// with a host"):
                AsyncLeaseClient("127.0.0.1:8787", client=http)
            with pytest.raises(ValueError, match="must be http:// or https:// with a host"):
                AsyncLeaseClient(client=http)

    asyncio.run(scenario())


def test_async_on_lost_is_not_cancelled_when_the_block_ends(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """A coroutine on_lost runs in the renewal task; a worker that sees ``lost`` and leaves
    the block (as it should) does not cut it off at its first await: it runs to its end,
    as the sync client's does."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = AsyncLeaseClient(
            BASE_URL,
            transport=_RenewAnsweredLost(transport),
            monotonic=fake_time.monotonic,
            signal_factory=fake_time.signal,
            random=lambda: 0.0,
        )
        namespace = await client.create_namespace()
        gate, finished = asyncio.Event(), []

        async def on_lost(error: LeaseLost) -> None:
            await gate.wait()  # a notification on its way, say
            finished.append(error.error)

        async with client.lease(namespace, "told", ttl=30, on_lost=on_lost) as lease:
            await asyncio.wait_for(lease.lost.wait(), 5)
        gate.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert finished == ["You do not hold this lease"]

    run_app(scenario)


class _CompleteFailsOnce(httpx.AsyncBaseTransport):
    """The first /lease/complete gets no answer (``landed``: it reached the app first,
    and only its answer was lost); everything else reaches the app."""

    def __init__(self, inner: httpx.AsyncBaseTransport, *, landed: bool = False) -> None:
        self.inner = inner
        self.landed = landed
        self.failed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/complete") and not self.failed:
            self.failed = True
            if self.landed:
                await self.inner.handle_async_request(request)
                raise httpx.ReadTimeout("the answer was lost", request=request)
            raise httpx.ConnectError("reset", request=request)
        return await self.inner.handle_async_request(request)


class _CompleteAnswered500Once(_CompleteFailsOnce):
    """The first /lease/complete is answered 500 (``landed``: after the app stored it)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/complete") and not self.failed:
            self.failed = True
            if self.landed:
                await self.inner.handle_async_request(request)
            return httpx.Response(500, json={"ok": False, "status": "internal", "error": "x"})
        return await self.inner.handle_async_request(request)


class _LookupAnswered503Once(_CompleteFailsOnce):
    """As ``_CompleteFailsOnce(landed=True)``, and the first lookup (an acquire with a
    TTL of 1 s) after it is answered 503."""

    looked = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/lease") and b'"ttl_seconds":1' in request.content:
            self.looked += 1
            if self.looked == 1:
                return httpx.Response(503, json={"ok": False, "status": "unavailable"})
        return await super().handle_async_request(request)


def test_async_lookup_without_an_answer_leaves_the_complete_unsure_not_lost(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """As in the sync client: a 503 to the lookup says nothing; once tries again."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        flaky = _LookupAnswered503Once(transport, landed=True)
        client = fake_client(flaky, fake_time)
        namespace = await client.create_namespace()
        calls: list[int] = []

        @client.once(namespace, key="charge:22")
        async def charge() -> int:
            calls.append(1)
            return 22

        assert await charge() == 22
        assert calls == [1] and flaky.looked == 2

    run_app(scenario)


@pytest.mark.parametrize("landed", [False, True])
def test_async_once_stores_the_result_through_a_500(
    run_app: Callable[..., None], fake_time: FakeTime, landed: bool
) -> None:
    """As in the sync client: a 500 says nothing of whether the result was stored, so
    the complete is tried again and the work runs once; a direct ``complete`` called
    again after one finds its own result."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        flaky = _CompleteAnswered500Once(transport, landed=landed)
        client = fake_client(flaky, fake_time)
        namespace = await client.create_namespace()
        calls: list[int] = []

        @client.once(namespace, key="charge:16")
        async def charge() -> int:
            calls.append(1)
            return 16

        assert await charge() == 16
        assert await charge() == 16
        assert calls == [1] and flaky.failed

        flaky.failed = False
        async with client.lease(namespace, "charge:17") as lease:
            with pytest.raises(InternalError):
                await lease.complete(17)
            assert await lease.complete(17) == 17
        assert not lease.lost.is_set()

    run_app(scenario)


def test_async_once_finds_the_result_its_lost_answer_stored(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """As in the sync client: a retry told lost finds its own completion and returns it."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(_CompleteFailsOnce(transport, landed=True), fake_time)
        namespace = await client.create_namespace()
        calls: list[int] = []

        @client.once(namespace, key="charge:10")
        async def charge() -> int:
            calls.append(1)
            return 10

        assert await charge() == 10
        assert await charge() == 10
        assert calls == [1]

    run_app(scenario)


def test_async_second_complete_after_an_unsure_one_was_stored_is_refused(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """As in the sync client: once the retried complete() found its result, another
    complete() raises LeaseLost."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(_CompleteFailsOnce(transport, landed=True), fake_time)
        namespace = await client.create_namespace()
        async with client.lease(namespace, "twice", ttl=30) as lease:
            with pytest.raises(ServiceUnreachable):
                await lease.complete(1)
            assert await lease.complete(1) == 1
            with pytest.raises(LeaseLost, match="completed"):
                await lease.complete(2)

    run_app(scenario)


def test_async_a_lost_answer_is_not_taken_for_someone_elses_completion(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """A complete() that got no answer (not stored), called again after the lease expired
    and another owner completed the key: told lost, the lookup finds the key completed
    with another fence, which is not this owner's result: LeaseLost, not theirs."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(_CompleteFailsOnce(transport), fake_time)
        namespace = await client.create_namespace()
        async with client.lease(namespace, "charge:12", ttl=5) as lease:
            with pytest.raises(ServiceUnreachable):
                await lease.complete("mine")
            fake_time.clock.advance(6)  # past this lease's expiry on the service too
            other = await client.acquire(namespace, "charge:12")
            assert isinstance(other, Lease)
            await client.complete(namespace, "charge:12", other.owner_token, "theirs")
            with pytest.raises(LeaseLost):
                await lease.complete("mine")
            assert not lease.completed and lease.result is None
        again = await client.acquire(namespace, "charge:12")
        assert isinstance(again, Completed) and again.result == "theirs"

    run_app(scenario)


class _CompleteUnreachable(httpx.AsyncBaseTransport):
    """Every /lease/complete gets no answer; everything else reaches the app."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/complete"):
            raise httpx.ConnectError("refused", request=request)
        return await self.inner.handle_async_request(request)


def test_async_once_stops_retrying_the_complete_at_the_leases_local_expiry(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """As in the sync client: a function that ran 6 s of a 10 s lease leaves 4 s, and a
    complete that keeps failing is retried until then, not for a whole TTL."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(_CompleteUnreachable(transport), fake_time)
        namespace = await client.create_namespace()

        @client.once(namespace, key="charge:23", ttl=10)
        async def charge() -> int:
            fake_time.clock.advance(6)  # the work takes its time
            return 23

        with pytest.raises(ServiceUnreachable):
            await charge()
        assert sum(w for w in fake_time.waits if w) == pytest.approx(4.0)

    run_app(scenario)


def test_async_once_gives_its_lease_and_stores_through_a_blip(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """current_lease() is the AsyncHeldLease inside the function (and the tasks it
    starts); a complete that got no answer is tried again, so the work runs once."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        flaky = _CompleteFailsOnce(transport)
        client = fake_client(flaky, fake_time)
        namespace = await client.create_namespace()
        calls: list[int] = []

        @client.once(namespace, key="charge:9")
        async def charge() -> int:
            lease = current_lease()
            assert isinstance(lease, AsyncHeldLease)
            inner = await asyncio.create_task(_fence_in_a_task())
            calls.append(inner)
            return lease.fencing_token

        assert await charge() == 1
        assert await charge() == 1
        assert calls == [1] and flaky.failed
        assert fake_time.waits == [1.0]  # an unreachable service: Retry-After is 1 s

    run_app(scenario)


async def _fence_in_a_task() -> int:
    return current_lease().fencing_token


def test_async_check_after_the_local_expiry_calls_on_lost(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """check() past the local expiry raises and still runs a coroutine on_lost, once."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(transport, fake_time)
        namespace = await client.create_namespace()
        told: list[LeaseLost] = []

        async def on_lost(error: LeaseLost) -> None:
            told.append(error)

        async with client.lease(namespace, KEY, ttl=30, on_lost=on_lost) as lease:
            fake_time.clock.advance(30)
            for _ in range(2):
                with pytest.raises(LeaseLost, match="expired"):
                    lease.check()
            await asyncio.sleep(0)
            assert lease.lost.is_set()
            assert len(told) == 1

    run_app(scenario)


def test_async_on_lost_is_called_once_when_the_worker_finds_the_expiry_too(
    run_app: Callable[..., None], fake_time: FakeTime
) -> None:
    """check() past the local expiry reports the lease lost; the renewal task's next turn,
    which finds the same expiry, does not report it again: on_lost runs once, and
    lost_error keeps the first reason."""

    async def scenario(transport: httpx.AsyncBaseTransport) -> None:
        client = fake_client(transport, fake_time)
        namespace = await client.create_namespace()
        told: list[LeaseLost] = []
        async with client.lease(namespace, KEY, ttl=30, on_lost=told.append) as lease:
            fake_time.clock.advance(30)
            with pytest.raises(LeaseLost, match="expired"):
                lease.check()
            assert not await worker_of(lease).step()
            await asyncio.sleep(0)
            assert [error.error for error in told] == [
                "The lease expired before a renewal succeeded"
            ]
            assert lease.lost_error is told[0]

    run_app(scenario)


def test_the_async_transport_finds_sniffio() -> None:
    """httpcore imports sniffio in every async request (its ``current_async_library``),
    and anyio no longer depends on it: without it, every request searched ``sys.path``
    for it in vain, several times (docs/performance.md, "Speed tricks")."""
    from importlib import metadata, util

    required = [
        r.split(">")[0].split(";")[0].strip() for r in metadata.requires("leasekeeper") or []
    ]
    assert "sniffio" in required
    assert util.find_spec("sniffio") is not None
