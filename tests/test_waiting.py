"""Acquires that wait (``wait_seconds``): hand-over in arrival order, completion for all,
timeouts, disconnects, expiry, stop, store failure and floods, on every store; and
across two instances on PostgreSQL. Time is the fake clock's: the waiting's timers
follow it (``ClockTimers``), and nothing here sleeps."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from leasekeeper import FakeClock
from leasekeeper._core.model import Command, Decision, Outcome
from leasekeeper._errors import FingerprintConflict, LeaseHeld, ServiceUnavailable
from leasekeeper._schemas import AcquireBody, parse_body
from leasekeeper._service import LeaseService, Reply
from leasekeeper._settings import Settings
from leasekeeper.http import create_app
from leasekeeper.store import Store
from tests._server import running_server
from tests.conftest import STORE_KINDS, ClockTimers, StoreFactory


class Counted:
    """Counts the store calls the service makes (a ``ServiceObserver``)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def store_call(self, operation: str, seconds: float, failed: bool) -> None:
        self.calls.append(operation)

    def decided(self, operation: str, outcome: Outcome, lifecycle_ms: int) -> None:
        pass


class Gated:
    """A store whose acquires wait for ``gate`` while it is closed, or fail while ``down``."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.gate = asyncio.Event()
        self.gate.set()
        #: Acquires wait for this one after the store decided, before they are answered.
        self.answer = asyncio.Event()
        self.answer.set()
        self.decided = asyncio.Event()
        self.down = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def apply(self, command: Command) -> Decision:
        if type(command).__name__ == "Acquire":
            if self.down:
                raise ServiceUnavailable("The lease store cannot be reached")
            await self.gate.wait()
            decision = await self.store.apply(command)
            self.decided.set()
            await self.answer.wait()
            return decision
        return await self.store.apply(command)


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class World:
    def __init__(self, service: LeaseService, timers: ClockTimers, counted: Counted) -> None:
        self.service = service
        self.timers = timers
        self.counted = counted
        self.ns = service.create_namespace
        self.namespace = ""

    async def acquire(self, key: str = "job", **body: Any) -> Reply:
        return await self.service.handle(
            "acquire", {"namespace": self.namespace, "key": key, **body}
        )

    def waiter(self, key: str = "job", **body: Any) -> asyncio.Task[Reply]:
        return asyncio.ensure_future(self.acquire(key, wait_seconds=30, **body))

    async def release(self, lease: Reply, key: str = "job") -> Reply:
        token = lease.body["owner_token"]  # type: ignore[typeddict-item]
        return await self.service.handle(
            "release", {"namespace": self.namespace, "key": key, "owner_token": token}
        )

    async def complete(self, lease: Reply, result: Any, key: str = "job") -> Reply:
        token = lease.body["owner_token"]  # type: ignore[typeddict-item]
        body = {"namespace": self.namespace, "key": key, "owner_token": token, "result": result}
        return await self.service.handle("complete", body)

    async def queued(self, count: int) -> None:
        """Until ``count`` acquires wait (the store answers on its own threads)."""
        for _ in range(20_000):
            if len(self.service.waiting) == count:
                return
            await asyncio.sleep(0.001)
        raise AssertionError(f"{len(self.service.waiting)} wait, not {count}")


def world_on(make_store: StoreFactory, clock: FakeClock, kind: str, **options: Any) -> World:
    store = make_store(kind, **options)
    return world_with(store, clock)


def world_with(store: Any, clock: FakeClock) -> World:
    timers = ClockTimers(clock)
    service = LeaseService(store, timers=timers)
    counted = Counted()
    service.add_observer(counted)
    return World(service, timers, counted)


def run(world: World, body: Callable[[World], Awaitable[None]]) -> None:
    async def main() -> None:
        await world.service.start()
        world.namespace = (await world.service.create_namespace()).body["namespace"]  # type: ignore[typeddict-item]
        try:
            await body(world)
        finally:
            await world.service.stop()

    asyncio.run(main())


def held(task: asyncio.Task[Reply]) -> LeaseHeld:
    error = task.exception()
    assert isinstance(error, LeaseHeld), error
    return error


async def answered(task: asyncio.Task[Reply]) -> None:
    await asyncio.wait({task}, timeout=10)
    assert task.done()


def test_grants_follow_arrival_order(
    make_store: StoreFactory, clock: FakeClock, store_kind: str
) -> None:
    """Waiters on one key are granted one at a time, in the order they arrived, each
    with a higher fencing token; the others wait on for the new owner."""

    async def body(w: World) -> None:
        owner = await w.acquire()
        waiters = []
        for n in range(5):
            waiters.append(w.waiter())
            await w.queued(n + 1)
        fences = [owner.body["fencing_token"]]  # type: ignore[typeddict-item]
        for n, task in enumerate(waiters):
            await w.release(owner)
            owner = await asyncio.wait_for(task, 10)
            assert owner.created
            fences.append(owner.body["fencing_token"])  # type: ignore[typeddict-item]
            await w.queued(4 - n)
            assert all(not later.done() for later in waiters[n + 1 :])
        assert fences == sorted(set(fences))

    run(world_on(make_store, clock, store_kind), body)


def test_a_completion_answers_every_waiter_at_once(
    make_store: StoreFactory, clock: FakeClock, store_kind: str
) -> None:
    """A completion decides all waiters in one go from the completed record, 200 with
    the stored result, with one store call besides the completion itself; a waiter
    with another fingerprint is told 409 conflict at once, not at the completion."""

    async def body(w: World) -> None:
        owner = await w.acquire(fingerprint="fp")
        same = [w.waiter(fingerprint="fp")]
        await w.queued(1)
        other = w.waiter(fingerprint="other")
        same += [w.waiter(fingerprint="fp") for _ in range(3)]
        await w.queued(4)
        await answered(other)
        assert isinstance(other.exception(), FingerprintConflict)
        before = len(w.counted.calls)
        await w.complete(owner, {"sum": 3})
        for task in same:
            reply = await asyncio.wait_for(task, 10)
            assert reply.plain()["status"] == "completed"
            assert reply.plain()["result"] == {"sum": 3}
        assert w.counted.calls[before:] == ["complete", "acquire"]

    run(world_on(make_store, clock, store_kind), body)


def test_a_wait_that_runs_out_is_held_with_the_current_retry_after(
    make_store: StoreFactory, clock: FakeClock, store_kind: str
) -> None:
    """When wait_seconds pass, the head and those behind it get 409 held whose
    retry_after_seconds is the time left on the lease they waited on."""

    async def body(w: World) -> None:
        await w.acquire(ttl_seconds=60)
        first = asyncio.ensure_future(w.acquire(wait_seconds=5))
        await w.queued(1)
        second = asyncio.ensure_future(w.acquire(wait_seconds=7))
        await w.queued(2)
        w.timers.advance(5)
        await answered(first)
        assert held(first).retry_after_seconds == 55
        w.timers.advance(2)
        await answered(second)
        assert held(second).retry_after_seconds == 53

    run(world_on(make_store, clock, store_kind), body)


def test_waiting_costs_no_store_calls_and_expiry_hands_over(
    make_store: StoreFactory, clock: FakeClock, store_kind: str
) -> None:
    """Waiters cost one decision for the first and none for those behind it, none while
    time passes, and the lease's expiry hands the key to the head at the expiry."""

    async def body(w: World) -> None:
        await w.acquire(ttl_seconds=10)
        first = w.waiter()
        await w.queued(1)
        rest = [w.waiter() for _ in range(3)]
        await w.queued(4)
        assert w.counted.calls == ["acquire", "acquire"]
        w.timers.advance(9.999)
        await asyncio.sleep(0)
        assert w.counted.calls == ["acquire", "acquire"] and not first.done()
        w.timers.advance(0.001)
        assert (await asyncio.wait_for(first, 10)).created
        await w.queued(3)
        assert not any(task.done() for task in rest)
        w.service.stop_waiting()
        for task in rest:
            await answered(task)
            assert held(task).retry_after_seconds == 60

    run(world_on(make_store, clock, store_kind), body)


def test_a_client_gone_is_granted_nothing(
    make_store: StoreFactory, clock: FakeClock, store_kind: str
) -> None:
    """A waiter cancelled while it waits leaves the queue; one cancelled while its grant
    is being decided has that lease released at once: the key stays free."""

    async def body(w: World) -> None:
        store: Gated = w.service.store  # type: ignore[assignment]
        owner = await w.acquire()
        gone = w.waiter()
        await w.queued(1)
        gone.cancel()
        await w.queued(0)
        racing = w.waiter()
        await w.queued(1)
        store.gate.clear()
        await w.release(owner)
        for _ in range(100):
            await asyncio.sleep(0)  # the head's decision is now held at the gate
        racing.cancel()
        store.gate.set()
        await w.queued(0)
        for _ in range(10_000):  # the orphaned grant's release, on the store's threads
            if w.counted.calls.count("release") == 2 and not w.service._orphans:
                break
            await asyncio.sleep(0.001)
        assert w.counted.calls.count("release") == 2
        fresh = await w.acquire()  # free: nobody was granted it, or it was released
        assert fresh.created

    run(world_with(Gated(make_store(store_kind)), clock), body)


def test_a_release_during_the_first_decision_is_not_missed(
    make_store: StoreFactory, clock: FakeClock, store_kind: str
) -> None:
    """A release that lands while a waiter's first decision (held) is on its way back
    wakes that waiter as soon as it queues, not at the lease's expiry."""

    async def body(w: World) -> None:
        store: Gated = w.service.store  # type: ignore[assignment]
        owner = await w.acquire()
        store.answer.clear()
        store.decided.clear()
        waiting = w.waiter()
        await asyncio.wait_for(store.decided.wait(), 10)  # held, not answered yet
        await w.release(owner)
        store.answer.set()
        assert (await asyncio.wait_for(waiting, 10)).created

    run(world_with(Gated(make_store(store_kind)), clock), body)


def test_stop_answers_every_waiter_at_once(
    make_store: StoreFactory, clock: FakeClock, store_kind: str
) -> None:
    """A stopping server answers its waiters 409 held at once, and waits for no one after."""

    async def body(w: World) -> None:
        await w.acquire(ttl_seconds=20)
        waiters = [w.waiter()]
        await w.queued(1)
        waiters += [w.waiter(key="job") for _ in range(4)]
        await w.queued(5)
        w.timers.advance(1)
        w.service.stop_waiting()
        for task in waiters:
            await answered(task)
            assert held(task).retry_after_seconds == 19
        with pytest.raises(LeaseHeld):
            await w.acquire(wait_seconds=30)

    run(world_on(make_store, clock, store_kind), body)


def test_an_unreachable_store_answers_every_waiter_503(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    """When the head cannot reach the store, every waiter of the key is answered 503."""

    async def body(w: World) -> None:
        store: Gated = w.service.store  # type: ignore[assignment]
        owner = await w.acquire()
        waiters = [w.waiter()]
        await w.queued(1)
        waiters += [w.waiter() for _ in range(3)]
        await w.queued(4)
        store.down = True
        await w.release(owner)
        for task in waiters:
            await answered(task)
            assert isinstance(task.exception(), ServiceUnavailable)

    run(world_with(Gated(make_store("memory")), clock), body)


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
def test_a_flood_of_waiters_costs_memory_in_proportion_and_nothing_else(
    make_store: StoreFactory, clock: FakeClock, store_kind: str
) -> None:
    """5,000 waiters on one key: two store calls in all while they wait, a few KiB each,
    and all answered when the server stops."""

    async def body(w: World) -> None:
        await w.acquire()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            waiters = [w.waiter()]
            await w.queued(1)
            waiters += [w.waiter() for _ in range(4_999)]
            await w.queued(5_000)
            per_waiter = (tracemalloc.get_traced_memory()[0] - before) / 5_000
        finally:
            tracemalloc.stop()
        w.timers.advance(30 - 0.001)
        await asyncio.sleep(0)
        assert w.counted.calls == ["acquire", "acquire"]
        assert per_waiter < 8_192, per_waiter
        w.service.stop_waiting()
        await asyncio.wait(waiters, timeout=30)
        assert all(isinstance(task.exception(), LeaseHeld) for task in waiters)

    run(world_on(make_store, clock, store_kind), body)


@pytest.mark.postgres
def test_a_release_at_one_instance_wakes_a_waiter_at_another(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    """On PostgreSQL a release at one instance hands the key to a waiter at another at
    once (LISTEN/NOTIFY), with no timer firing; a completion answers it too."""

    async def main() -> None:
        one = world_on(make_store, clock, "postgres")
        two = world_with(make_store("postgres", like=one.service.store), clock)
        for w in (one, two):
            await w.service.start()
        try:
            namespace = (await one.service.create_namespace()).body["namespace"]  # type: ignore[typeddict-item]
            one.namespace = two.namespace = namespace
            owner = await one.acquire()
            waiting = two.waiter()
            await two.queued(1)
            await one.release(owner)
            owner = await asyncio.wait_for(waiting, 10)
            assert owner.created
            waiting = one.waiter()
            await one.queued(1)
            await two.complete(owner, [1])
            reply = await asyncio.wait_for(waiting, 10)
            assert reply.plain()["result"] == [1]
        finally:
            for w in (one, two):
                await w.service.stop()

    asyncio.run(main())


def test_waiting_answers_conflict_at_once(make_store: StoreFactory, clock: FakeClock) -> None:
    """A waiting acquire with another fingerprint is told conflict at once, not made to wait."""

    async def body(w: World) -> None:
        await w.acquire(fingerprint="a")
        with pytest.raises(FingerprintConflict):
            await w.acquire(fingerprint="b", wait_seconds=30)
        assert len(w.service.waiting) == 0
        waiting = w.waiter(fingerprint="a")
        await w.queued(1)
        calls = len(w.counted.calls)
        with pytest.raises(FingerprintConflict):  # behind a waiter: from what it learned
            await w.acquire(fingerprint="b", wait_seconds=30)
        assert len(w.counted.calls) == calls and len(w.service.waiting) == 1
        w.service.stop_waiting()
        await answered(waiting)

    run(world_on(make_store, clock, "sqlite"), body)


async def _post(app: Any, body: dict[str, Any], gone: asyncio.Event | None = None) -> list[Any]:
    """POST ``body`` to the acquire route as an ASGI server would; the client disconnects
    when ``gone`` is set. Returns the messages sent."""
    sent: list[Any] = []
    read = False

    async def receive() -> dict[str, Any]:
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
        await (gone or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/services/v1/lease",
        "raw_path": b"/services/v1/lease",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8787),
    }
    await app(scope, receive, send)
    return sent


def test_http_waits_and_a_disconnect_ends_the_wait(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    """Over HTTP a wait that runs out is 409 held with a matching Retry-After; a client
    that disconnects while waiting is answered nothing, leaves the queue, and a lease
    released afterwards is free for the next caller."""

    async def body(w: World) -> None:
        app = create_app(w.service, Settings(), run_cleanup=False)
        owner = await w.acquire(ttl_seconds=60)
        request = {"namespace": w.namespace, "key": "job", "wait_seconds": 5}
        waiting = asyncio.ensure_future(_post(app, request))
        await w.queued(1)
        w.timers.advance(5)
        start, reply = await asyncio.wait_for(waiting, 10)
        assert start["status"] == 409
        assert (b"retry-after", b"55") in start["headers"]
        assert orjson.loads(reply["body"])["retry_after_seconds"] == 55
        gone = asyncio.Event()
        waiting = asyncio.ensure_future(_post(app, {**request, "wait_seconds": 30}, gone))
        await w.queued(1)
        gone.set()
        assert await asyncio.wait_for(waiting, 10) == []
        assert len(w.service.waiting) == 0
        await w.release(owner)
        assert (await w.acquire()).created

    run(world_on(make_store, clock, "sqlite"), body)


def test_a_stopping_server_answers_its_waiters_at_once(tmp_path: Path) -> None:
    """SIGTERM to ``leasekeeper serve`` answers a request waiting on a held key at once
    (409 held), and the server exits without waiting out its 60 s."""
    with running_server(f"sqlite:///{tmp_path / 'run.db'}", tmp_path / "log") as server:
        with httpx.Client(base_url=server.api, timeout=90) as http:
            body = {"key": str(uuid.uuid4()), "wait_seconds": 60}
            assert http.post("/lease", json={"key": body["key"]}).status_code == 201
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(http.post, "/lease", json=body)
                for _ in range(500):  # until the server has the request (it then waits)
                    metrics = httpx.get(server.url + "/metrics").text
                    if "leasekeeper_requests_in_flight 2.0" in metrics:
                        break
                    time.sleep(0.01)
                started = time.monotonic()
                server.process.terminate()
                response = waiting.result(timeout=30)
        assert response.status_code == 409
        assert response.json()["status"] == "held"
        assert time.monotonic() - started < 30
        assert server.process.wait(30) in (0, -15)  # uvicorn re-raises the signal


def test_waiters_count_against_the_connection_limit(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    """A waiting request holds one of LEASEKEEPER_MAX_CONNECTIONS: past it, 503."""

    async def body(w: World) -> None:
        app = create_app(w.service, Settings(max_connections=1), run_cleanup=False)
        await w.acquire()
        request = {"namespace": w.namespace, "key": "job", "wait_seconds": 30}
        waiting = asyncio.ensure_future(_post(app, request))
        await w.queued(1)
        start, reply = await _post(app, {"namespace": w.namespace, "key": "other"})
        assert start["status"] == 503
        assert b"connection limit" in reply["body"]
        w.service.stop_waiting()
        start, _ = await asyncio.wait_for(waiting, 10)
        assert start["status"] == 409

    run(world_on(make_store, clock, "sqlite"), body)


def test_a_grant_whose_answer_cannot_be_sent_is_released(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    """``release_unsent`` (what HTTP calls when a grant and a disconnect meet) frees the key."""

    async def body(w: World) -> None:
        request = parse_body(AcquireBody, {"namespace": w.namespace, "key": "job"})
        reply = await w.service.acquire(request)
        assert reply.created
        await w.service.release_unsent(request, reply)
        again = await w.acquire()
        assert again.created
        assert again.body["fencing_token"] > reply.body["fencing_token"]  # type: ignore[typeddict-item]

    run(world_on(make_store, clock, "sqlite"), body)
