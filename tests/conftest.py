"""Shared fixtures: a fake clock, stores of every backend, and the in-process HTTP app.

Store backends are named by ``STORE_KINDS``; a test parametrized over
``store_kind`` runs against each. PostgreSQL tests use
``LEASEKEEPER_TEST_POSTGRES_URL`` and a schema of their own that is dropped
afterwards; without that variable they skip with the reason, except in CI
(``CI=true``), where a missing PostgreSQL is a failure.
"""

from __future__ import annotations

import asyncio
import heapq
import importlib
import itertools
import math
import os
import re
import secrets
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from leasekeeper import FakeClock, LeaseService, ServiceUnavailable, Settings
from leasekeeper.http import create_app
from leasekeeper.store import MemoryStore, SqliteStore, Store

# A suite started in the background by a non-interactive shell (`make test &`) inherits
# SIGINT and SIGQUIT ignored, and so would every process the tests start: the tests of
# Ctrl-C and SIGQUIT need them as a terminal leaves them.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGQUIT, signal.SIG_DFL)

BASE = "/services/v1"
STORE_KINDS = ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


class FakeMonotonic:
    """A monotonic time source for rate limits that only moves when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _Handle:
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ClockTimers:
    """The waiting acquires' timers (``_waiting.Timers``) on a ``FakeClock``: they fire
    when ``advance`` moves the clock past them."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self._due: list[tuple[float, int, _Handle, Callable[[], None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self.clock.now_ms() / 1000

    def call_at(self, when: float, callback: Callable[[], None]) -> _Handle:
        handle = _Handle()
        heapq.heappush(self._due, (when, next(self._order), handle, callback))
        return handle

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.fire()

    def fire(self) -> None:
        """Run the timers due at the clock's time."""
        now = self.now()
        while self._due and self._due[0][0] <= now:
            _, _, handle, callback = heapq.heappop(self._due)
            if not handle.cancelled:
                callback()


class JumpingTimers(ClockTimers):
    """``ClockTimers`` that move the clock themselves, as trio's autojump clock does:
    a moment (``pause`` real seconds) after a timer is set, the clock jumps to the
    earliest one and it fires. For tests of clients that wait on the server while
    their own time is the fake clock's."""

    def __init__(self, clock: FakeClock, pause: float = 0.02) -> None:
        super().__init__(clock)
        self._pause = pause
        self._jumping = False

    def call_at(self, when: float, callback: Callable[[], None]) -> _Handle:
        handle = super().call_at(when, callback)
        if not self._jumping:
            self._jumping = True
            asyncio.get_running_loop().call_later(self._pause, self._jump)
        return handle

    def _jump(self) -> None:
        self._jumping = False
        while self._due and self._due[0][2].cancelled:
            heapq.heappop(self._due)
        if not self._due:
            return
        when = self._due[0][0]
        if when * 1000 > self.clock.now_ms():
            self.clock.set(math.ceil(when * 1000))
        self.fire()
        if self._due:
            self._jumping = True
            asyncio.get_running_loop().call_later(self._pause, self._jump)


class ManualSleep:
    """``sleep`` for the app's background loops (cleanup, live-lease count), driven by
    the test as trio's MockClock drives sleepers: each pause lasts until ``wake``.

    Its coroutines run on the app's loop: from a TestClient's thread, call them with
    ``client.portal.call``. ``until_asleep(n)`` returns once ``n`` loops are paused, so
    after ``wake`` it says that the woken loops did their work and paused again.
    """

    def __init__(self) -> None:
        #: Every pause asked for, in order.
        self.pauses: list[float] = []
        self._paused: list[asyncio.Future[None]] = []
        self._changed: asyncio.Event | None = None

    async def __call__(self, seconds: float) -> None:
        self.pauses.append(seconds)
        paused = asyncio.get_running_loop().create_future()
        self._paused.append(paused)
        self._event().set()
        try:
            await paused
        finally:
            self._paused.remove(paused)

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    async def until_asleep(self, loops: int) -> None:
        """Return once ``loops`` loops are paused (fail after 10 s: a loop is stuck)."""
        async with asyncio.timeout(10):
            while len([p for p in self._paused if not p.done()]) < loops:
                self._event().clear()
                await self._event().wait()

    async def wake(self) -> None:
        """End every pause now."""
        for paused in self._paused:
            if not paused.done():
                paused.set_result(None)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def monotonic() -> FakeMonotonic:
    return FakeMonotonic()


StoreFactory = Callable[..., Store]


@pytest.fixture
def make_store(tmp_path: Path, clock: FakeClock) -> Iterator[StoreFactory]:
    """``make_store(kind)`` builds an unopened store of that kind on the shared fake clock.

    ``make_store(kind, like=store)`` builds another store over the same data, as a
    restarted process (or a second instance) would see it; for ``memory`` that is
    the same object, since nothing else survives. PostgreSQL stores get a schema
    of their own, dropped at teardown together with their connections.
    """
    counter = iter(range(1_000_000))
    schemas: list[str] = []

    def make(kind: str, *, like: Store | None = None, **options: Any) -> Store:
        if kind == "memory":
            return like if like is not None else MemoryStore(clock)
        if kind == "sqlite":
            if like is not None:
                assert isinstance(like, SqliteStore)
                return SqliteStore(like.path, clock, **options)
            return SqliteStore(tmp_path / f"store-{next(counter)}.db", clock, **options)
        if kind == "postgres":
            url = postgres_url()
            if url is None:
                pytest.skip(
                    "PostgreSQL tests need LEASEKEEPER_TEST_POSTGRES_URL (make test sets it)"
                )
            from leasekeeper.store._postgres import PostgresStore

            if like is not None:
                schema = getattr(like, "schema", None)
                assert isinstance(schema, str)
            else:
                schema = new_schema_name()
                schemas.append(schema)
            options.setdefault("application_name", schema)
            options.setdefault("clock", clock)
            # ``url=`` connects elsewhere (a proxy in fault tests); the schema is the same.
            return PostgresStore(options.pop("url", url), schema=schema, **options)
        raise ValueError(f"unknown store kind {kind}")

    yield make
    url = postgres_url() if schemas else None
    for schema in schemas:
        assert url is not None
        drop_schema(url, schema)


async def not_ready_until_the_hold_ends(store: Store, clock: FakeClock, reason: str) -> None:
    """ping (``/readyz``) fails, saying ``reason``, until 10 s after the store's last refused
    write (``store._base.Refusals``), and then succeeds."""
    with pytest.raises(ServiceUnavailable, match=reason):
        await store.ping()
    clock.advance(9.999)
    with pytest.raises(ServiceUnavailable, match=reason):
        await store.ping()
    clock.advance(0.001)
    await store.ping()


def new_schema_name() -> str:
    """A schema name no other test (or other engineer's run) will pick."""
    return f"lk_test_{secrets.token_hex(6)}"


def drop_schema(url: str, schema: str) -> None:
    """End the connections named after ``schema`` and drop it with everything in it."""
    import psycopg

    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = %s AND pid <> pg_backend_pid()",
            (schema,),
        )
        conn.execute("SET lock_timeout = '10s'")
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


class Api:
    """A TestClient with the lease routes as methods; each returns the httpx response."""

    def __init__(self, client: TestClient, service: LeaseService, app: Any) -> None:
        self.client = client
        self.service = service
        self.app = app

    def post(self, route: str, body: Any = None, **kwargs: Any) -> Any:
        if body is not None and "content" not in kwargs:
            kwargs["json"] = body
        return self.client.post(f"{BASE}{route}", **kwargs)

    def namespace(self) -> str:
        response = self.post("/lease/namespace", {})
        assert response.status_code == 201, response.text
        return str(response.json()["namespace"])

    def acquire(self, **body: Any) -> Any:
        return self.post("/lease", body)

    def renew(self, **body: Any) -> Any:
        return self.post("/lease/renew", body)

    def release(self, **body: Any) -> Any:
        return self.post("/lease/release", body)

    def complete(self, **body: Any) -> Any:
        return self.post("/lease/complete", body)


ApiFactory = Callable[..., Api]


@pytest.fixture
def make_api(
    make_store: StoreFactory, monotonic: FakeMonotonic, clock: FakeClock
) -> Iterator[ApiFactory]:
    """``make_api(store_kind="sqlite", lifecycle_seconds=86400, **settings)`` -> a running Api."""
    opened: list[TestClient] = []

    def make(
        store_kind: str = "sqlite",
        *,
        lifecycle_seconds: int = 86_400,
        store: Store | None = None,
        sleep: ManualSleep | None = None,
        **settings: Any,
    ) -> Api:
        store = store or make_store(store_kind)
        service = LeaseService(
            store, lifecycle_seconds=lifecycle_seconds, timers=JumpingTimers(clock)
        )
        app = create_app(
            service,
            Settings(lifecycle_seconds=lifecycle_seconds, **settings),
            monotonic=monotonic,
            sleep=sleep or ManualSleep(),
            run_cleanup=False,
        )
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        opened.append(client)
        return Api(client, service, app)

    yield make
    for client in opened:
        client.__exit__(None, None, None)


@pytest.fixture
def api(make_api: ApiFactory) -> Api:
    """The HTTP API over an SQLite store with the fake clock."""
    return make_api("sqlite")


@pytest.fixture
def ns(api: Api) -> str:
    return api.namespace()


def import_or_skip(module: str) -> Any:
    """``module``, imported; a missing one skips locally and fails in CI, where
    ``make test`` installs every extra."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


def postgres_url() -> str | None:
    """The PostgreSQL URL for tests, or None (skip locally, fail in CI)."""
    url = os.environ.get("LEASEKEEPER_TEST_POSTGRES_URL")
    if not url and os.environ.get("CI"):
        pytest.fail("CI needs PostgreSQL: set LEASEKEEPER_TEST_POSTGRES_URL (make test does)")
    return url or None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Soak runs take minutes: they run only under ``make soak`` (LEASEKEEPER_SOAK=1)."""
    if os.environ.get("LEASEKEEPER_SOAK"):
        return
    skip = pytest.mark.skip(reason="soak run: use make soak (LEASEKEEPER_SOAK=1)")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


def soak_scale() -> float:
    """How much of each soak run to do: ``LEASEKEEPER_SOAK_SCALE`` (1, all of it, by
    default; 0.02 tries the runs out in a fiftieth of the time)."""
    return float(os.environ.get("LEASEKEEPER_SOAK_SCALE") or 1)


#: One line per fault or load run (tests/test_faults.py), printed at the end of the session.
RUN_SUMMARIES: list[str] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Show each run's summary line even under ``-q`` without ``-s``."""
    if RUN_SUMMARIES:
        terminalreporter.section("leasekeeper runs")
        for line in RUN_SUMMARIES:
            terminalreporter.write_line(line)


def metric(text: str, name: str, *, absent: float | None = None, **labels: str) -> float:
    """The value of one sample in Prometheus text; ``absent`` if it is not there (a
    labelled child not made yet), which without ``absent`` fails the test."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "") + r" (\S+)"
    found = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    if found is None and absent is not None:
        return absent
    assert found, f"{name} {labels} not in metrics"
    return float(found.group(1))
