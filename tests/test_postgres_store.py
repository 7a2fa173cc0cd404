"""What only the PostgreSQL store has: its schema, session settings, clock and failure modes.

The behaviour every store shares is in ``test_conformance.py``. Outages are made
with a TCP relay between the store and the server (``Relay``) that a test can cut
or blackhole, and with ``pg_terminate_backend`` and table locks on the real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

import pytest

from leasekeeper import FakeClock, OutcomeUnknown, ServiceUnavailable
from leasekeeper._core.model import (
    Acquire,
    Complete,
    CompletedOutcome,
    Granted,
    Held,
    Release,
    Renew,
    Renewed,
)
from leasekeeper._core.model import (
    Released as ReleasedOutcome,
)
from leasekeeper.store import Store, StoreURLError, open_store
from tests._stores import store_target
from tests.conftest import (
    StoreFactory,
    drop_schema,
    import_or_skip,
    new_schema_name,
    not_ready_until_the_hold_ends,
    postgres_url,
)

psycopg = import_or_skip("psycopg")
pytestmark = pytest.mark.postgres

T = TypeVar("T")

TTL = 60_000
LIFECYCLE = 86_400_000


@pytest.fixture
def url() -> str:
    found = postgres_url()
    if found is None:
        pytest.skip("PostgreSQL tests need LEASEKEEPER_TEST_POSTGRES_URL (make test sets it)")
    return found


def admin(url: str) -> Any:
    return psycopg.connect(url, autocommit=True, connect_timeout=5)


def admin_count(url: str, query: str, *params: object) -> int:
    """The ``SELECT count(*) …`` of ``query``, asked on an admin connection of its own."""
    with admin(url) as conn:
        row = conn.execute(query, params).fetchone()
    return int(row[0])


def relations_in(url: str, schema: str) -> int:
    """How many tables, sequences and indexes ``schema`` holds."""
    return admin_count(
        url,
        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s",
        schema,
    )


def new_id() -> bytes:
    return secrets.token_bytes(32)


def acquire(key: bytes | None = None, owner: bytes | None = None, **fields: Any) -> Acquire:
    return Acquire(
        key or new_id(),
        fields.get("fingerprint"),
        fields.get("ttl_ms", TTL),
        owner or new_id(),
        fields.get("lifecycle_ms", LIFECYCLE),
    )


@contextlib.asynccontextmanager
async def opened(store: Store) -> AsyncIterator[Any]:
    await store.open()
    try:
        yield store
    finally:
        await store.close()


def create_schema(store: Store) -> None:
    """Open and close ``store`` once, leaving its schema behind."""

    async def main() -> None:
        async with opened(store):
            pass

    asyncio.run(main())


def url_with(url: str, *, port: int | None = None, **params: str) -> str:
    """``url`` with another port on 127.0.0.1, and more query parameters."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if port is not None:
        netloc = netloc.rpartition("@")[0] + "@" if "@" in netloc else ""
        netloc += f"127.0.0.1:{port}"
    query = "&".join(filter(None, [parts.query, urlencode(params, quote_via=quote)]))
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


# -- URLs and schema -------------------------------------------------------------------------


def test_open_store_builds_a_postgres_store_for_both_schemes(url: str) -> None:
    """``postgresql://`` and ``postgres://`` both choose the PostgreSQL store."""
    from leasekeeper.store._postgres import PostgresStore

    assert isinstance(open_store("postgresql://u@db.example/leases"), PostgresStore)
    assert isinstance(open_store("POSTGRES://u@db.example/leases"), PostgresStore)


def test_the_pool_size_setting_reaches_the_store() -> None:
    """LEASEKEEPER_POSTGRES_POOL_SIZE bounds the pool, and the concurrent batches with it;
    its default is the store's own."""
    import inspect

    from leasekeeper import Settings, _server_cli
    from leasekeeper.store._postgres import PostgresStore

    default = inspect.signature(PostgresStore).parameters["max_size"].default
    assert Settings().postgres_pool_size == default
    for size, batches in ((1, 1), (2, 2), (3, 3), (64, 4)):
        env = {
            "LEASEKEEPER_STORE": "postgres://u@db.example/leases",
            "LEASEKEEPER_POSTGRES_POOL_SIZE": str(size),
        }
        store = _server_cli._service(Settings.from_env(env)).store
        assert isinstance(store, PostgresStore)
        assert (store._max_size, store._min_size, store._max_batches) == (size, 1, batches)
    assert open_store("postgresql://u@db.example/leases")._max_size == default  # type: ignore[attr-defined]
    with pytest.raises(StoreURLError, match="pool size"):
        open_store("postgresql://u@db.example/leases", pool_size=0)


def test_a_malformed_url_is_refused_without_repeating_it() -> None:
    """A URL that does not parse is a StoreURLError that does not echo a password."""
    with pytest.raises(StoreURLError) as caught:
        open_store("postgresql://user:hunter2@[::1/db?nonsense_parameter=1")
    assert "hunter2" not in str(caught.value)


def test_concurrent_starts_create_one_schema(make_store: StoreFactory, url: str) -> None:
    """Several instances opening a fresh schema at once all succeed and share one counter."""

    async def main() -> None:
        first = make_store("postgres", clock=None)
        others = [make_store("postgres", like=first, clock=None) for _ in range(3)]
        stores = [first, *others]
        await asyncio.gather(*(s.open() for s in stores))
        try:
            decisions = await asyncio.gather(*(s.apply(acquire()) for s in stores))
            fences = sorted(
                d.outcome.record.fencing_token for d in decisions if isinstance(d.outcome, Granted)
            )
            assert fences == [1, 2, 3, 4]
        finally:
            await asyncio.gather(*(s.close() for s in stores))

    asyncio.run(main())


def test_a_new_store_says_in_which_schema_and_an_existing_one_does_not(
    make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Opening makes a new, empty store (its counter from 1) wherever the schema has
    none: the log names the schema, once, so that a wrong search_path shows."""
    store = make_store("postgres")
    with caplog.at_level(logging.INFO, logger="leasekeeper.store.postgres"):
        create_schema(store)
        create_schema(make_store("postgres", like=store))
    created = [r.getMessage() for r in caplog.records if "new, empty store" in r.getMessage()]
    assert created == [f"created a new, empty store in the schema {store.schema}"]  # type: ignore[attr-defined]


def test_schema_keeps_digests_as_bytea_times_as_bigint_results_as_text(
    make_store: StoreFactory, url: str
) -> None:
    """Column types match the SQLite store's, results are text, the fence sequence has CACHE 1."""
    store = make_store("postgres")
    create_schema(store)
    schema = store.schema  # type: ignore[attr-defined]
    with admin(url) as conn:
        columns = dict(
            conn.execute(
                "SELECT column_name, data_type FROM information_schema.columns "
                "WHERE table_schema = %s AND table_name = 'leasekeeper_leases'",
                (schema,),
            ).fetchall()
        )
        cache = conn.execute(
            "SELECT cache_size, cycle FROM pg_sequences WHERE schemaname = %s "
            "AND sequencename = 'leasekeeper_fence'",
            (schema,),
        ).fetchone()
    assert columns == {
        "key_id": "bytea",
        "fingerprint": "bytea",
        "absolute_expires_ms": "bigint",
        "fencing_token": "bigint",
        "owner": "bytea",
        "lease_expires_ms": "bigint",
        "completed_ms": "bigint",
        "result": "text",
        "updated_ms": "bigint",
    }
    assert cache == (1, False)


def test_a_newer_schema_is_refused(make_store: StoreFactory, url: str) -> None:
    """A schema written by a newer leasekeeper stops this one from starting."""
    store = make_store("postgres")
    create_schema(store)
    with admin(url) as conn:
        conn.execute(
            f"UPDATE {store.schema}.leasekeeper_meta SET value = 99 "  # type: ignore[attr-defined]
            "WHERE name = 'schema_version'"
        )
    with pytest.raises(ServiceUnavailable, match="upgrade leasekeeper"):
        asyncio.run(make_store("postgres", like=store).open())


def test_a_missing_search_path_schema_is_explained(url: str) -> None:
    """Without ``schema=``, a search_path naming no existing schema gives a clear error."""
    missing = new_schema_name()
    store = open_store(url_with(url, options=f"-csearch_path={missing}"), timeout_seconds=2)
    with pytest.raises(ServiceUnavailable, match="search_path"):
        asyncio.run(store.open())


def test_a_schema_created_before_the_stores_on_the_search_path_does_not_move_it(
    url: str, clock: FakeClock
) -> None:
    """The default search_path is ``"$user", public``: a store made in ``public`` moves
    to a schema named after the role the moment someone creates one, unless it is pinned.
    A running instance keeps the schema it opened in, whatever is created ahead of it on
    the search_path (it would otherwise see an empty store there, with a counter from 1);
    an instance started afterwards refuses to open rather than make a second store in
    the new first schema, and says which schema holds the store."""
    from leasekeeper.store._postgres import PostgresStore

    first, store_schema = new_schema_name(), new_schema_name()
    with admin(url) as conn:
        conn.execute(f'CREATE SCHEMA "{store_schema}"')  # "first" does not exist yet
    path = url_with(url, options=f"-csearch_path={first},{store_schema}")
    key = new_id()

    def store() -> Any:
        return PostgresStore(path, application_name=store_schema, clock=clock)

    async def main() -> None:
        async with opened(store()) as running:
            granted = await running.apply(acquire(key))
            assert isinstance(granted.outcome, Granted)
            token = granted.outcome.record.fencing_token
            with admin(url) as conn:
                conn.execute(f'CREATE SCHEMA "{first}"')
            # Another store opened in the new first schema, tables and counter from 1.
            async with opened(PostgresStore(url, schema=first, clock=clock)) as other:
                assert isinstance((await other.apply(acquire(new_id()))).outcome, Granted)
            # The running instance still decides on its own records.
            again = await running.apply(acquire(key))
            assert isinstance(again.outcome, Held)
            clock.advance(TTL / 1000)
            later = await running.apply(acquire(key))
            assert isinstance(later.outcome, Granted)
            assert later.outcome.record.fencing_token > token
        with admin(url) as conn:
            conn.execute(f'DROP SCHEMA "{first}" CASCADE')
            conn.execute(f'CREATE SCHEMA "{first}"')
        with pytest.raises(ServiceUnavailable) as refused:
            await store().open()
        message = str(refused.value)
        assert f'"{first}"' in message and f'"{store_schema}"' in message, message
        assert "search_path" in message and url not in message
        assert relations_in(url, first) == 0

    try:
        asyncio.run(main())
    finally:
        drop_schema(url, first)
        drop_schema(url, store_schema)


def test_a_schema_whose_name_needs_quoting_is_pinned(url: str, clock: FakeClock) -> None:
    """The pinned search_path quotes the schema's name: capitals, a space, a quote."""
    from leasekeeper.store._postgres import PostgresStore

    name = f'Lease "Store" {new_schema_name()}'
    quoted = '"' + name.replace('"', '""') + '"'
    with admin(url) as conn:
        conn.execute(f"CREATE SCHEMA {quoted}")
    path = url_with(url, options="-csearch_path=" + quoted.replace(" ", "\\ "))

    async def main() -> int:
        async with opened(PostgresStore(path, clock=clock)) as store:
            decision = await store.apply(acquire())
            assert isinstance(decision.outcome, Granted)
            async with store._pool.connection() as conn:
                shown = await (await conn.execute("SHOW search_path")).fetchone()
            assert shown == (quoted,)
            return decision.outcome.record.fencing_token

    try:
        assert asyncio.run(main()) == 1
        assert admin_count(url, "SELECT count(*) FROM pg_tables WHERE schemaname = %s", name) == 2
    finally:
        with admin(url) as conn:
            conn.execute(f"DROP SCHEMA {quoted} CASCADE")


def test_fence_and_cleanup_create_no_store_in_an_empty_schema(
    make_store: StoreFactory, url: str
) -> None:
    """``leasekeeper fence`` and ``cleanup`` on a URL whose schema holds no leasekeeper
    tables (a search_path left out or mistyped) are usage errors that create nothing:
    otherwise a new empty store's counter is raised while the real one stays low. On
    the real store they work."""
    from click.testing import CliRunner

    from leasekeeper.cli import main

    real = make_store("postgres")
    create_schema(real)
    empty = new_schema_name()
    with admin(url) as conn:
        conn.execute(f'CREATE SCHEMA "{empty}"')
    try:
        # The real store on the search_path too, but behind the empty schema, where the
        # tables would be created: still no store there.
        for path in (empty, f"{empty},{real.schema}"):  # type: ignore[attr-defined]
            empty_url = url_with(url, options=f"-csearch_path={path}")
            for argv in (["fence", "--raise-to", "9000"], ["cleanup"]):
                done = CliRunner().invoke(main, [*argv, "--store", empty_url])
                assert done.exit_code == 2, done.output
                assert "no leasekeeper store in that PostgreSQL database and schema" in (
                    done.output
                )
                assert url not in done.output
        assert relations_in(url, empty) == 0
    finally:
        with admin(url) as conn:
            conn.execute(f'DROP SCHEMA "{empty}" CASCADE')
    real_url = url_with(url, options=f"-csearch_path={real.schema}")  # type: ignore[attr-defined]
    done = CliRunner().invoke(main, ["fence", "--raise-to", "9000", "--store", real_url])
    assert done.exit_code == 0 and '"fencing_counter":9000' in done.output, done.output


def test_a_store_that_cannot_connect_says_why(url: str) -> None:
    """Not only the pool's "initialization incomplete": libpq's own reason (refused, no
    such database), so that a mistyped URL is found from the one error line."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        closed_port = free.getsockname()[1]
    parts = urlsplit(url)
    no_database = urlunsplit(parts._replace(path="/leasekeeper_no_such_database"))
    for wrong, why in (
        (url_with(url, port=closed_port), "Connection refused"),
        (no_database, 'database "leasekeeper_no_such_database" does not exist'),
    ):
        store = open_store(wrong, timeout_seconds=1)
        with pytest.raises(ServiceUnavailable, match="Cannot open the PostgreSQL store") as failed:
            asyncio.run(store.open())
        assert why in str(failed.value)


# -- sessions and the database clock ---------------------------------------------------------


def test_sessions_commit_synchronously_whatever_the_url_says(
    make_store: StoreFactory, url: str
) -> None:
    """synchronous_commit is on even when the URL asks for off; timeouts come from the store."""
    store = make_store(
        "postgres", url=url_with(url, options="-c synchronous_commit=off"), timeout_seconds=3
    )

    async def main() -> tuple[Any, ...]:
        async with opened(store), store._pool.connection() as conn:  # type: ignore[attr-defined]
            cursor = await conn.execute(
                "SELECT current_setting('synchronous_commit'), "
                "current_setting('statement_timeout'), current_schema(), "
                "current_setting('application_name')"
            )
            row = await cursor.fetchone()
            assert row is not None
            return tuple(row)

    settings = asyncio.run(main())
    assert settings == ("on", "3s", store.schema, store.schema)  # type: ignore[attr-defined]


def test_a_role_s_session_settings_do_not_reach_the_store(
    make_store: StoreFactory, url: str
) -> None:
    """A role (or database) with its own client_encoding or lock_timeout, common advice
    for migrations, changes nothing: the store's sessions speak UTF-8 (under LATIN1, a
    result in Japanese failed in psycopg, and its whole batch was answered 500) and wait
    for a row lock as long as the store timeout allows (a 20 ms lock_timeout turned
    two instances' ordinary contention into 503s for every key in the waiting batch)."""
    role = f"lk_role_{secrets.token_hex(4)}"
    with admin(url) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN SUPERUSER")
        conn.execute(f"ALTER ROLE {role} SET client_encoding = 'LATIN1'")
        conn.execute(f"ALTER ROLE {role} SET lock_timeout = '20ms'")
    try:
        as_role = urlunsplit(urlsplit(url)._replace(netloc=f"{role}@127.0.0.1:5432"))
        store = make_store("postgres", url=as_role)

        async def main() -> tuple[tuple[Any, ...], Any]:
            async with opened(store), store._pool.connection() as conn:  # type: ignore[attr-defined]
                cursor = await conn.execute(
                    "SELECT current_user, current_setting('client_encoding'), "
                    "current_setting('lock_timeout')"
                )
                settings = await cursor.fetchone()
                key, owner = new_id(), new_id()
                assert isinstance((await store.apply(acquire(key, owner))).outcome, Granted)
                await store.apply(Complete(key, owner, '{"city":"東京"}'))
                again = await store.apply(acquire(key))
                assert settings is not None
                return tuple(settings), again.outcome

        settings, outcome = asyncio.run(main())
        assert settings == (role, "UTF8", "0")
        assert isinstance(outcome, CompletedOutcome)
        assert outcome.record.result == '{"city":"東京"}'
    finally:
        with admin(url) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def test_the_url_s_client_encoding_is_overruled(make_store: StoreFactory, url: str) -> None:
    """``?client_encoding=latin1`` in the URL would make psycopg unable to send or read
    what other instances store: the store speaks UTF-8 whatever the URL says."""
    store = make_store("postgres", url=url_with(url, client_encoding="latin1"))

    async def main() -> Any:
        async with opened(store):
            key, owner = new_id(), new_id()
            await store.apply(acquire(key, owner))
            await store.apply(Complete(key, owner, '"Grüße aus 東京"'))
            return (await store.apply(acquire(key))).outcome

    outcome = asyncio.run(main())
    assert isinstance(outcome, CompletedOutcome)
    assert outcome.record.result == '"Grüße aus 東京"'


def test_without_a_clock_the_database_clock_decides(make_store: StoreFactory, url: str) -> None:
    """With no injected clock, ``now`` is the database server's clock_timestamp()."""

    async def main() -> None:
        async with opened(make_store("postgres", clock=None)) as store:
            before = time.time_ns() // 1_000_000
            decision = await store.apply(acquire(ttl_ms=5000))
            after = time.time_ns() // 1_000_000
            assert isinstance(decision.outcome, Granted)
            now = decision.outcome.now_ms
            # The server runs on this machine in the tests, so the clocks agree.
            assert before - 50 <= now <= after + 50
            assert decision.outcome.record.lease_expires_ms == now + 5000

            key = new_id()
            await store.apply(acquire(key, lifecycle_ms=1))
            await asyncio.sleep(0.01)  # real time: this test is about the real clock
            assert (await store.purge(100)).deleted >= 1

    asyncio.run(main())


def test_purge_takes_the_records_that_ended_first(
    make_store: StoreFactory, url: str, clock: FakeClock
) -> None:
    """Each step deletes the records whose lifecycle ended first, whatever the order in
    which they were written (rows sit in the heap in about that order in a real store)."""
    store = make_store("postgres")
    keys = {lifecycle: new_id() for lifecycle in (3_000, 1_000, 2_000)}  # written in this order

    async def main() -> list[set[bytes]]:
        left = []
        async with opened(store):
            for lifecycle, key in keys.items():
                await store.apply(acquire(key, lifecycle_ms=lifecycle))
            clock.advance(3)
            table = f"{store.schema}.leasekeeper_leases"  # type: ignore[attr-defined]
            for _ in range(3):
                assert await store.purge(1) == (1, b"")
                with admin(url) as conn:
                    left.append({bytes(k) for (k,) in conn.execute(f"SELECT key_id FROM {table}")})
        return left

    assert asyncio.run(main()) == [
        {keys[3_000], keys[2_000]},
        {keys[3_000]},
        set(),
    ]


def test_the_purge_reads_the_database_clock_once_and_bounds_an_index_scan(
    make_store: StoreFactory, url: str
) -> None:
    """In the WHERE clause itself, clock_timestamp() could bound no index scan: each
    step was a sequential scan reading the clock for every row (the last step of a
    cleanup of 1M records took 762 ms). Read once in a subquery, it bounds the scan of
    the lifecycle index. The rows found are deleted by their ctid, without a second
    lookup of each in the primary key."""
    from leasekeeper.store._postgres_sql import PURGE_AT_DB_NOW

    store = make_store("postgres", clock=None)
    create_schema(store)
    with admin(url) as conn:
        conn.execute(f"SET search_path = {store.schema}")  # type: ignore[attr-defined]
        conn.execute("SET enable_seqscan = off")  # any plan that can use an index does
        plan = "\n".join(
            row[0] for row in conn.execute("EXPLAIN " + PURGE_AT_DB_NOW, (200,)).fetchall()
        )
    # An index scan, or on an empty table a bitmap scan: either is bounded by the index.
    assert "on leasekeeper_leases_lifecycle_end" in plan, plan
    assert "Index Cond: (absolute_expires_ms <= $0)" in plan, plan
    assert "Seq Scan" not in plan, plan
    # The rows found are deleted where they lie, not looked up again by key.
    assert "Tid Scan on leasekeeper_leases" in plan, plan
    assert "leasekeeper_leases_pkey" not in plan, plan


def test_without_a_clock_the_live_count_reads_the_database_clock(make_store: StoreFactory) -> None:
    """With no injected clock, ``count_live`` counts at the database server's clock too."""

    async def main() -> None:
        async with opened(make_store("postgres", clock=None)) as store:
            await store.apply(acquire(ttl_ms=60_000))
            await store.apply(acquire(ttl_ms=300))
            assert await store.count_live() == 2
            await asyncio.sleep(0.4)  # real time: the short lease runs out
            assert await store.count_live() == 1

    asyncio.run(main())


def test_the_live_count_and_decisions_do_not_wait_for_each_other(
    make_store: StoreFactory, url: str
) -> None:
    """The count's query takes no lock a decision needs, and needs none a decision holds:
    it answers while a transaction holds every row for update, and decisions and
    cleanup go on while a transaction that ran the count is still open."""
    from leasekeeper.store._postgres_sql import COUNT_LIVE_AT_DB_NOW

    store = make_store("postgres", clock=None, timeout_seconds=2)
    key, owner = new_id(), new_id()

    async def main() -> None:
        async with opened(store):
            await store.apply(acquire(key, owner))
            await store.apply(acquire())
            table = f"{store.schema}.leasekeeper_leases"  # type: ignore[attr-defined]
            with admin(url) as other:
                other.execute("BEGIN")
                other.execute(f"SELECT key_id FROM {table} FOR UPDATE")  # as a batch does
                started = time.monotonic()
                assert await store.count_live() == 2
                assert time.monotonic() - started < 1
                other.execute("ROLLBACK")
                other.execute("BEGIN")
                other.execute(f"SET LOCAL search_path = {store.schema}")  # type: ignore[attr-defined]
                counted = other.execute(COUNT_LIVE_AT_DB_NOW).fetchone()
                assert counted is not None and counted[0] == 2
                started = time.monotonic()
                renewed = await store.apply(Renew(key, owner, TTL))
                assert isinstance(renewed.outcome, Renewed)
                assert isinstance((await store.apply(acquire())).outcome, Granted)
                await store.purge(100)
                assert time.monotonic() - started < 1
                other.execute("ROLLBACK")

    asyncio.run(main())


def test_a_grant_during_a_raise_of_the_counter_draws_above_it(
    make_store: StoreFactory, url: str
) -> None:
    """``raise_fence`` reads the counter and sets it in one transaction whose first
    statement locks the sequence: a grant that draws its token meanwhile (another
    instance's, here the store's own) waits for the COMMIT and draws above the raised
    value, instead of the setval taking back what it drew. Here the raise's statements
    run on a connection of the test's, which holds the transaction open."""
    from leasekeeper.store._postgres_sql import LOCK_FENCE, READ_FENCE, SET_FENCE

    store = make_store("postgres", timeout_seconds=10)

    async def waiting_for_a_lock(conn: Any, schema: str) -> bool:
        for _ in range(500):
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE application_name = %s AND wait_event_type = 'Lock'",
                (schema,),
            ).fetchone()
            if row[0]:
                return True
            await asyncio.sleep(0.01)  # polling the server's state, not waiting out a time
        return False

    async def main() -> None:
        async with opened(store):
            first = await store.apply(acquire())
            assert isinstance(first.outcome, Granted)
            assert first.outcome.record.fencing_token == 1
            schema = store.schema
            with admin(url) as raiser, admin(url) as watcher:
                raiser.execute("BEGIN")
                raiser.execute(f"SET LOCAL search_path = {schema}")
                raiser.execute(LOCK_FENCE)
                assert raiser.execute(READ_FENCE).fetchone() == (1,)
                grant = asyncio.ensure_future(store.apply(acquire()))
                assert await waiting_for_a_lock(watcher, schema)
                assert not grant.done()
                raiser.execute(SET_FENCE, (500,))
                raiser.execute("COMMIT")
                decision = await grant
            assert isinstance(decision.outcome, Granted)
            assert decision.outcome.record.fencing_token == 501
            assert await store.raise_fence(0) == 501

    asyncio.run(main())


def test_a_missing_fence_sequence_is_recreated_above_the_stored_tokens(
    make_store: StoreFactory, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A fencing sequence dropped (or left out of a restore) beside stored records is
    created again above their highest token, with a WARNING, never at 1 below them."""
    store = make_store("postgres")
    key = new_id()

    async def grant_five() -> int:
        async with opened(store):
            for _ in range(5):
                decision = await store.apply(acquire(key, ttl_ms=1))
                assert isinstance(decision.outcome, Granted)
                await store.apply(Release(key, decision.outcome.record.owner or b""))
            return decision.outcome.record.fencing_token

    async def grant_again() -> int:
        async with opened(store):
            decision = await store.apply(acquire(key))
            assert isinstance(decision.outcome, Granted)
            return decision.outcome.record.fencing_token

    highest = asyncio.run(grant_five())
    with admin(url) as conn:
        conn.execute(f'DROP SEQUENCE "{store.schema}".leasekeeper_fence')
    with caplog.at_level(logging.WARNING, logger="leasekeeper.store.postgres"):
        assert asyncio.run(grant_again()) == highest + 1
    assert f"continue above the highest of their tokens ({highest})" in caplog.text


def test_a_fence_sequence_elsewhere_on_the_search_path_is_not_taken_for_the_stores(
    url: str, clock: FakeClock
) -> None:
    """With a search path of two schemas (no ``schema=``), the store's own sequence is
    the one in the first: another store's in the second does not hide that it is
    missing, neither from the migration nor from readiness."""
    from leasekeeper.store._postgres import PostgresStore

    ours, other = new_schema_name(), new_schema_name()
    with admin(url) as conn:
        conn.execute(f'CREATE SCHEMA "{ours}"')
        conn.execute(f'CREATE SCHEMA "{other}"')
        conn.execute(f'CREATE SEQUENCE "{other}".leasekeeper_fence')  # another install's
    path = url_with(url, options=f"-csearch_path={ours},{other}")
    key = new_id()

    def store() -> Any:
        return PostgresStore(path, application_name=ours, clock=clock)

    async def grants(count: int) -> int:
        async with opened(store()) as opened_store:
            for _ in range(count):
                decision = await opened_store.apply(acquire(key))
                assert isinstance(decision.outcome, Granted)
                await opened_store.apply(Release(key, decision.outcome.record.owner or b""))
            return decision.outcome.record.fencing_token

    async def ping_after_drop() -> None:
        async with opened(store()) as opened_store:
            with admin(url) as conn:
                conn.execute(f'DROP SEQUENCE "{ours}".leasekeeper_fence')
            with pytest.raises(ServiceUnavailable, match="fencing sequence is missing"):
                await opened_store.ping()

    try:
        highest = asyncio.run(grants(5))
        with admin(url) as conn:
            conn.execute(f'DROP SEQUENCE "{ours}".leasekeeper_fence')
        assert asyncio.run(grants(1)) == highest + 1
        asyncio.run(ping_after_drop())
    finally:
        drop_schema(url, ours)
        drop_schema(url, other)


def test_readiness_needs_a_writable_database_and_the_fence_sequence(
    make_store: StoreFactory, url: str
) -> None:
    """ping (/readyz) fails while the database is read-only (every write would fail) or
    the fencing sequence is missing (every grant would), not only when it is down."""
    store = make_store("postgres", max_size=1)

    async def main() -> None:
        async with opened(store):
            await store.ping()
            pool = store._pool  # type: ignore[attr-defined]
            async with pool.connection() as conn:  # the pool's one connection
                await conn.execute("SET SESSION default_transaction_read_only = on")
            with pytest.raises(ServiceUnavailable, match="read-only"):
                await store.ping()
            async with pool.connection() as conn:
                await conn.execute("SET SESSION default_transaction_read_only = off")
            await store.ping()
            with admin(url) as conn:
                conn.execute(f'DROP SEQUENCE "{store.schema}".leasekeeper_fence')
            with pytest.raises(ServiceUnavailable, match="fencing sequence is missing"):
                await store.ping()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (
            "ALTER TABLE leasekeeper_leases DROP COLUMN owner",
            "its table leasekeeper_leases is not leasekeeper's (it lacks the column owner)",
        ),
        (
            "ALTER TABLE leasekeeper_leases ADD COLUMN extra int NOT NULL DEFAULT 0",
            "its table leasekeeper_leases is not leasekeeper's (it has columns leasekeeper "
            "does not make: extra)",
        ),
        (
            "ALTER TABLE leasekeeper_leases ALTER COLUMN result TYPE jsonb USING result::jsonb",
            "its table leasekeeper_leases is not leasekeeper's (it has columns of other types",
        ),
        (
            "ALTER TABLE leasekeeper_meta DROP CONSTRAINT leasekeeper_meta_pkey",
            "its table leasekeeper_meta is not leasekeeper's (it has columns of other types",
        ),
        (
            "UPDATE leasekeeper_meta SET value = 0 WHERE name = 'schema_version'",
            "its schema version is 0, and this leasekeeper's is 1",
        ),
    ],
    ids=["missing column", "extra column", "other type", "no primary key", "old version"],
)
def test_a_schema_whose_tables_are_not_as_leasekeeper_makes_them_is_not_ready_nor_opened(
    make_store: StoreFactory, url: str, change: str, why: str
) -> None:
    """A table missing a column (or with one more, or of another type, or without its
    key), or another schema version: ping (/readyz) fails saying so while the store is
    open, and the store refuses to open, rather than answer every acquire 503."""
    store = make_store("postgres", max_size=1)
    schema = store.schema  # type: ignore[attr-defined]

    async def main() -> None:
        async with opened(store):
            await store.ping()
            with admin(url) as conn:
                conn.execute(f"SET search_path = {schema}")
                conn.execute(change)
            with pytest.raises(ServiceUnavailable) as refused:
                await store.ping()
            assert refused.value.error.startswith("The lease store cannot decide: ")
            assert why in refused.value.error
        reopened = make_store("postgres", like=store)
        with pytest.raises(ServiceUnavailable) as refused:
            await reopened.open()
        assert refused.value.error.startswith("Cannot open the PostgreSQL store: ")
        assert why in refused.value.error

    asyncio.run(main())


def test_another_programs_tables_of_the_same_names_are_left_alone(
    make_store: StoreFactory, url: str
) -> None:
    """A schema holding another program's table named leasekeeper_leases is not taken for
    a store: opening fails before anything is created beside it."""
    store = make_store("postgres")
    schema = store.schema  # type: ignore[attr-defined]
    with admin(url) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.leasekeeper_leases (id int PRIMARY KEY)")
    with pytest.raises(ServiceUnavailable, match="it lacks the columns key_id, fingerprint"):
        asyncio.run(store.open())
    assert relations_in(url, schema) == 2  # the table and its key's index, nothing more


def test_readiness_fails_while_the_database_refuses_writes_for_want_of_room(
    make_store: StoreFactory, clock: FakeClock, url: str
) -> None:
    """A write refused for want of room (SQLSTATE 53100, disk_full, raised here by a
    trigger on inserts) is answered at once and fails ping (``/readyz``) until 10 s
    after the last such refusal, even while updates in place (renewals) succeed; a
    refusal that is one request's trouble (a lock not available) does not."""
    store = make_store("postgres")

    def refuse_inserts(errcode: str | None) -> None:
        with admin(url) as conn:
            conn.execute(f'DROP TRIGGER IF EXISTS refuse ON "{store.schema}".leasekeeper_leases')
            if errcode is None:
                return
            conn.execute(
                f'CREATE OR REPLACE FUNCTION "{store.schema}".refuse() RETURNS trigger '
                f"LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'no room' "
                f"USING ERRCODE = '{errcode}'; END $$"
            )
            conn.execute(
                f'CREATE TRIGGER refuse BEFORE INSERT ON "{store.schema}".leasekeeper_leases '
                f'FOR EACH ROW EXECUTE FUNCTION "{store.schema}".refuse()'
            )

    full = r"refusing writes \(DiskFull, SQLSTATE 53100\)"

    async def main() -> None:
        async with opened(store):
            held = acquire()
            assert isinstance((await store.apply(held)).outcome, Granted)
            refuse_inserts("lock_not_available")
            with pytest.raises(ServiceUnavailable, match="too busy"):
                await store.apply(acquire())
            await store.ping()

            refuse_inserts("disk_full")
            with pytest.raises(ServiceUnavailable, match="refused the request"):
                await store.apply(acquire())
            with pytest.raises(ServiceUnavailable, match=full):
                await store.ping()
            renewed = await store.apply(Renew(held.key_id, held.owner, 60_000))
            assert isinstance(renewed.outcome, Renewed)  # an update: no trigger
            await not_ready_until_the_hold_ends(store, clock, full)

            with pytest.raises(ServiceUnavailable):
                await store.apply(acquire())
            with pytest.raises(ServiceUnavailable, match=full):
                await store.ping()
            refuse_inserts(None)  # room again
            assert isinstance((await store.apply(acquire())).outcome, Granted)
            clock.advance(10)
            await store.ping()

    asyncio.run(main())


def test_failing_batches_are_logged_at_most_once_a_second(
    make_store: StoreFactory, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """With every write failing (a read-only database here), each caller gets its 503,
    but the log gets one line a second, then one that counts the lines it left out."""
    store = make_store("postgres", max_size=1)

    async def main() -> None:
        async with opened(store):
            async with store._pool.connection() as conn:  # type: ignore[attr-defined]
                await conn.execute("SET SESSION default_transaction_read_only = on")
            for _ in range(20):
                with pytest.raises(ServiceUnavailable, match="refused the request"):
                    await store.apply(acquire())
            clock.advance(1)
            with pytest.raises(ServiceUnavailable):
                await store.apply(acquire())

    with caplog.at_level(logging.WARNING, logger="leasekeeper.store.postgres"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "ReadOnlySqlTransaction" in lines[0]
    assert lines[1].endswith("(and 19 more since the last such line)")


def test_only_a_database_that_cannot_write_at_all_fails_readiness(
    make_store: StoreFactory,
) -> None:
    """A full disk, no memory, an I/O error or damaged data count; one query's own limit
    (53400, temp_file_limit say), a lock or a read-only transaction do not; an error made
    on this side (no severity) is never answered at once as a refusal."""
    from psycopg import errors as pg_errors

    from leasekeeper.store._postgres_run import _severity

    store = make_store("postgres")  # not opened: the classification needs no database

    def refusing(exc: psycopg.Error) -> bool:
        return bool(store._runner.note_refusal(exc))  # type: ignore[attr-defined]

    for counted in (
        pg_errors.DiskFull,
        pg_errors.OutOfMemory,
        pg_errors.IoError,
        pg_errors.DataCorrupted,
        pg_errors.IndexCorrupted,
    ):
        assert refusing(counted()), counted
    for not_counted in (
        pg_errors.ConfigurationLimitExceeded,
        pg_errors.TooManyConnections,
        pg_errors.LockNotAvailable,
        pg_errors.ReadOnlySqlTransaction,
        pg_errors.QueryCanceled,
    ):
        assert not refusing(not_counted()), not_counted
    assert _severity(pg_errors.DiskFull()) is None  # not from a server: no severity


def test_a_503_says_which_of_the_connection_the_time_or_the_database_failed() -> None:
    """The 503's sentence follows the error: a lost connection or a shutdown "cannot be
    reached", a statement timeout "did not answer in time", and a refusal (a read-only
    database, a lock not available) "refused the request"."""
    from psycopg import errors as pg_errors

    from leasekeeper.store._postgres_run import _unavailable

    assert "cannot be reached" in _unavailable(psycopg.OperationalError("connection lost"))
    assert "cannot be reached" in _unavailable(pg_errors.AdminShutdown())
    assert "did not answer in time" in _unavailable(pg_errors.QueryCanceled())
    assert "refused the request" in _unavailable(pg_errors.ReadOnlySqlTransaction())
    assert "refused the request" in _unavailable(pg_errors.LockNotAvailable())


# -- failures --------------------------------------------------------------------------------


def test_transient_errors_are_retried_invisibly(make_store: StoreFactory, url: str) -> None:
    """Serialization failures and deadlocks inside a decision are retried by the store."""
    store = make_store("postgres")
    create_schema(store)
    schema = store.schema  # type: ignore[attr-defined]
    with admin(url) as conn:
        conn.execute(f"SET search_path = {schema}")
        conn.execute("CREATE SEQUENCE failures")
        conn.execute(
            """
            CREATE FUNCTION fail_a_few() RETURNS trigger LANGUAGE plpgsql AS $$
            DECLARE n bigint := nextval('failures');
            BEGIN
                IF n <= 2 THEN RAISE EXCEPTION 'injected' USING ERRCODE = 'serialization_failure';
                ELSIF n <= 4 THEN RAISE EXCEPTION 'injected' USING ERRCODE = 'deadlock_detected';
                END IF;
                RETURN NEW;
            END $$
            """
        )
        conn.execute(
            "CREATE TRIGGER fail_a_few BEFORE INSERT OR UPDATE ON leasekeeper_leases "
            "FOR EACH ROW EXECUTE FUNCTION fail_a_few()"
        )

    async def main() -> None:
        async with opened(make_store("postgres", like=store)) as again:
            key, owner = new_id(), new_id()
            assert isinstance((await again.apply(acquire(key, owner))).outcome, Granted)
            done = await again.apply(Complete(key, owner, '"ok"'))
            assert isinstance(done.outcome, CompletedOutcome)

    asyncio.run(main())


def test_endless_transient_errors_end_in_unavailable(make_store: StoreFactory, url: str) -> None:
    """A decision that can never commit is refused as unavailable, in bounded time."""
    store = make_store("postgres", timeout_seconds=3)
    create_schema(store)
    with admin(url) as conn:
        conn.execute(f"SET search_path = {store.schema}")  # type: ignore[attr-defined]
        conn.execute(
            """
            CREATE FUNCTION always_fail() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = 'serialization_failure'; END $$
            """
        )
        conn.execute(
            "CREATE TRIGGER always_fail BEFORE INSERT ON leasekeeper_leases "
            "FOR EACH ROW EXECUTE FUNCTION always_fail()"
        )

    async def main() -> None:
        async with opened(make_store("postgres", like=store, timeout_seconds=3)) as again:
            started = time.monotonic()
            with pytest.raises(ServiceUnavailable):
                await again.apply(acquire())
            assert time.monotonic() - started < 3.5

    asyncio.run(main())


def test_killed_connections_are_replaced_without_failing_requests(
    make_store: StoreFactory, url: str
) -> None:
    """After pg_terminate_backend on every store connection, requests still succeed."""
    store = make_store("postgres", min_size=4, max_size=4)
    name = store.schema  # type: ignore[attr-defined]  # also the application_name

    async def main() -> None:
        async with opened(store):
            await asyncio.gather(*(store.apply(acquire()) for _ in range(16)))
            for _ in range(3):
                with admin(url) as conn:
                    killed = conn.execute(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = %s",
                        (name,),
                    ).fetchone()
                assert killed is not None
                assert killed[0] >= 1
                for _ in range(8):
                    assert isinstance((await store.apply(acquire())).outcome, Granted)

    asyncio.run(main())


@pytest.mark.parametrize("pool_size", [1, 2])
def test_a_small_pool_serves_concurrent_requests_within_its_size(
    tmp_path: Path, pool_size: int
) -> None:
    """With LEASEKEEPER_POSTGRES_POOL_SIZE 1 or 2, 50 concurrent acquires on 5 keys (with
    readiness checks, cleanups and live counts among them) grant each key once, nothing waits for a
    connection that never comes, and the store never has more connections than that."""
    with store_target("postgres", tmp_path) as target:
        assert target.admin_url is not None and target.schema is not None
        store = open_store(target.url, pool_size=pool_size)
        seen: list[int] = []

        async def count_connections(stop: asyncio.Event) -> None:
            async with await psycopg.AsyncConnection.connect(
                target.admin_url, autocommit=True
            ) as conn:
                while not stop.is_set():
                    cursor = await conn.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                        (target.schema,),
                    )
                    row = await cursor.fetchone()
                    assert row is not None
                    seen.append(int(row[0]))
                    pool = getattr(store, "_pool", None)
                    if pool is not None:
                        seen.append(pool.get_stats()["pool_size"])
                    await asyncio.sleep(0.002)

        async def later(call: Callable[[], Awaitable[T]]) -> T:
            await asyncio.sleep(random.uniform(0, 0.05))
            return await call()

        async def main() -> None:
            stop = asyncio.Event()
            counting = asyncio.create_task(count_connections(stop))
            try:
                async with opened(store):
                    keys = [new_id() for _ in range(5)]
                    acquires = [
                        later(functools.partial(store.apply, acquire(keys[i % 5])))
                        for i in range(50)
                    ]
                    chores = [later(store.ping) for _ in range(5)]
                    chores += [later(functools.partial(store.purge, 10)) for _ in range(5)]
                    chores += [later(store.count_live) for _ in range(5)]  # type: ignore[attr-defined]
                    decisions = await asyncio.gather(*acquires)
                    await asyncio.gather(*chores)
                    assert await store.count_live() == 5  # type: ignore[attr-defined]
                    stats = store._pool.get_stats()  # type: ignore[attr-defined]
            finally:
                stop.set()
                await counting
            grants = [d.outcome for d in decisions if isinstance(d.outcome, Granted)]
            held = [d.outcome for d in decisions if isinstance(d.outcome, Held)]
            assert len(grants) == 5 and len(held) == 45
            assert {g.record.key_id for g in grants} == set(keys)
            fences = {g.record.key_id: g.record.fencing_token for g in grants}
            assert all(h.record.fencing_token == fences[h.record.key_id] for h in held)
            assert stats["pool_max"] == pool_size
            assert stats.get("connections_num", 0) <= pool_size

        asyncio.run(main())
        assert seen and max(seen) <= pool_size, max(seen)
        assert max(seen) >= 1


def test_a_blocked_table_answers_unavailable_within_the_timeout(
    make_store: StoreFactory, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that cannot get its rows answers ServiceUnavailable on time, and recovers."""
    caplog.set_level(logging.DEBUG)
    store = make_store("postgres", timeout_seconds=1)
    key, owner = new_id(), new_id()

    async def main() -> None:
        async with opened(store):
            await store.apply(acquire(key, owner))
            with admin(url) as blocker:
                blocker.execute("BEGIN")
                blocker.execute(
                    f"LOCK TABLE {store.schema}.leasekeeper_leases "  # type: ignore[attr-defined]
                    "IN ACCESS EXCLUSIVE MODE"
                )
                for call in (store.apply(Renew(key, owner, TTL)), store.ping(), store.count_live()):
                    started = time.monotonic()
                    with pytest.raises(ServiceUnavailable) as caught:
                        await call
                    elapsed = time.monotonic() - started
                    assert 0.9 <= elapsed <= 1.5, elapsed
                    assert caught.value.retry_after == 1
                blocker.execute("ROLLBACK")
            renewed = await store.apply(Renew(key, owner, TTL))
            assert isinstance(renewed.outcome, Renewed)
            await store.ping()
            assert await store.count_live() == 1

    asyncio.run(main())
    logged = " ".join(record.getMessage() for record in caplog.records)
    for secret in (key, owner):
        assert secret.hex() not in logged
        assert repr(secret) not in logged


def test_a_request_answered_503_while_its_batch_waited_is_not_decided(
    make_store: StoreFactory, url: str
) -> None:
    """A request whose deadline passes while its batch waits for a row lock has been
    told 503: when the lock comes free, nothing is written for it, and no fence drawn."""
    store = make_store("postgres", timeout_seconds=1, max_batches=1)
    first, second = new_id(), new_id()

    async def main() -> None:
        async with opened(store):
            for key in (first, second):  # rows to lock, and no live lease on them
                owner = new_id()
                await store.apply(acquire(key, owner))
                await store.apply(Release(key, owner))
            schema = store.schema  # type: ignore[attr-defined]
            with admin(url) as blocker:
                blocker.execute("BEGIN")
                blocker.execute(
                    f"SELECT 1 FROM {schema}.leasekeeper_leases WHERE key_id = ANY(%s) FOR UPDATE",
                    ([first, second],),
                )
                # The first batch waits for its lock until the store's timeout; the
                # second request waits behind it (one batch at a time), then for the
                # lock, and its caller's deadline passes meanwhile.
                waiting = asyncio.ensure_future(store.apply(acquire(first)))
                await asyncio.sleep(0.3)
                with pytest.raises(ServiceUnavailable):
                    await store.apply(acquire(second))
                with pytest.raises(ServiceUnavailable):
                    await waiting
                blocker.execute("ROLLBACK")  # the second batch gets its lock now
            # Runs after the second batch (one batch at a time), on another key.
            after = await store.apply(acquire())
            with admin(url) as check:
                rows = check.execute(
                    f"SELECT owner IS NULL, fencing_token FROM {schema}.leasekeeper_leases "
                    "WHERE key_id = ANY(%s)",
                    ([first, second],),
                ).fetchall()
            assert sorted(rows) == [(True, 1), (True, 2)]  # both as released, untouched
            # Two fences drawn before, none for the requests answered 503: this is the third.
            assert after.outcome.record.fencing_token == 3  # type: ignore[union-attr]

    asyncio.run(main())


async def until_a_store_waits_for_a_lock(url: str, schema: str) -> None:
    """Return once one of the store's connections (named after ``schema``) waits for a
    lock on the server; fail after 10 s."""
    async with asyncio.timeout(10):
        while True:
            waiting = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
            if admin_count(url, waiting + " AND wait_event_type = 'Lock'", schema):
                return
            await asyncio.sleep(0.01)


def test_a_new_key_another_instance_creates_during_a_batch_is_decided_again(
    make_store: StoreFactory, url: str, clock: FakeClock
) -> None:
    """Two new keys in one batch; another instance creates the row of one of them while
    the batch inserts it (the batch's INSERT waits for that transaction, then does
    nothing for the key). The other key is granted, and the taken one is decided again
    against the row that won: held, by that instance's owner, never a second owner."""
    store = make_store("postgres", max_batches=1)
    mine, contested = new_id(), new_id()

    async def main() -> None:
        async with opened(store):
            schema = store.schema  # type: ignore[attr-defined]
            now = clock.now_ms()
            with admin(url) as other:
                other.execute("BEGIN")
                other.execute(
                    f"INSERT INTO {schema}.leasekeeper_leases VALUES "
                    "(%s, NULL, %s, 1000, %s, %s, NULL, NULL, %s)",
                    (contested, now + LIFECYCLE, new_id(), now + TTL, now),
                )
                batch = asyncio.gather(store.apply(acquire(mine)), store.apply(acquire(contested)))
                await until_a_store_waits_for_a_lock(url, schema)
                other.execute("COMMIT")
                granted, taken = await batch
            assert isinstance(granted.outcome, Granted)
            assert granted.outcome.record.key_id == mine
            assert isinstance(taken.outcome, Held), taken.outcome
            assert taken.outcome.record.fencing_token == 1000
            again = await store.apply(acquire(contested))
            assert isinstance(again.outcome, Held)
            assert again.outcome.record.fencing_token == 1000

    asyncio.run(main())


def test_without_a_clock_a_decision_runs_at_the_time_its_row_lock_came(
    make_store: StoreFactory, url: str
) -> None:
    """The database clock is read after the batch's row locks are held, not when its
    transaction began: a lease that ran out while the batch waited for its row (another
    transaction held it) is taken by a new owner, not answered as held."""
    store = make_store("postgres", clock=None)
    key, owner = new_id(), new_id()

    async def main() -> None:
        async with opened(store):
            schema = store.schema  # type: ignore[attr-defined]
            first = await store.apply(acquire(key, owner, ttl_ms=2000))
            assert isinstance(first.outcome, Granted)
            expiry = first.outcome.record.lease_expires_ms
            with admin(url) as blocker:
                blocker.execute("BEGIN")
                blocker.execute(
                    f"SELECT 1 FROM {schema}.leasekeeper_leases WHERE key_id = %s FOR UPDATE",
                    (key,),
                )
                waiting = asyncio.ensure_future(store.apply(acquire(key)))
                await until_a_store_waits_for_a_lock(url, schema)
                while True:  # the database clock passes the lease's expiry meanwhile
                    with admin(url) as conn:
                        (db_now,) = conn.execute(
                            "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
                        ).fetchone()
                    if db_now >= expiry:
                        break
                    await asyncio.sleep(0.05)
                blocker.execute("COMMIT")
            decision = await waiting
            assert isinstance(decision.outcome, Granted), decision.outcome
            assert decision.outcome.now_ms >= expiry
            assert decision.outcome.record.fencing_token > first.outcome.record.fencing_token

    asyncio.run(main())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_database_fails_open_within_the_timeout() -> None:
    """Opening a store whose server refuses connections fails as unavailable, on time."""
    store = open_store(f"postgresql://postgres@127.0.0.1:{free_port()}/test", timeout_seconds=1)
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable, match="Cannot open the PostgreSQL store"):
        asyncio.run(store.open())
    assert time.monotonic() - started < 2.5


class Link:
    """One relayed connection: both ends, and whether the server's answers still pass."""

    def __init__(self, *writers: asyncio.StreamWriter) -> None:
        self.writers = writers
        self.muted = False

    def abort(self) -> None:
        for writer in self.writers:
            writer.transport.abort()


class Relay:
    """A TCP relay to PostgreSQL that a test can cut (refuse, drop) or blackhole (stall)."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._refusing = False
        self._links: set[Link] = set()
        self._server: asyncio.Server | None = None
        self._trap: tuple[bytes, bool, bool] | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            writer.transport.abort()
            return
        await self._flowing.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        link = Link(writer, up_writer)
        self._links.add(link)
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, link, from_client=True),
                self._pump(up_reader, writer, link, from_client=False),
            )
        finally:
            self._links.discard(link)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: Link,
        *,
        from_client: bool,
    ) -> None:
        try:
            while data := await reader.read(65536):
                await self._flowing.wait()
                if link.muted:
                    continue  # the answers of a trapped connection are lost
                trap = self._trap
                if from_client and trap is not None and trap[0] in data:
                    self._trap = None
                    link.muted = True
                    if trap[1]:
                        writer.write(data)
                        await writer.drain()
                        await asyncio.sleep(0.2)  # the server acts on it; nobody hears back
                    if trap[2]:
                        continue  # held open: nothing ends, nothing comes back
                    return
                writer.write(data)
                await writer.drain()
        except (OSError, RuntimeError):
            pass
        finally:
            link.abort()

    def cut(self) -> None:
        """Drop every connection and refuse new ones, as a stopped server would."""
        self._refusing = True
        for link in list(self._links):
            link.abort()

    def blackhole(self) -> None:
        """Stop passing bytes either way, as a broken network would."""
        self._flowing.clear()

    def trap(self, marker: bytes, *, deliver: bool, hold: bool = False) -> None:
        """Drop the connection that next sends ``marker``, once it reached the server or not;
        with ``hold``, keep it open instead, passing nothing more (a server that stopped).

        Either way the server's answer never comes back.
        """
        self._trap = (marker, deliver, hold)

    @property
    def trapped(self) -> bool:
        return self._trap is None

    def restore(self) -> None:
        self._refusing = False
        self._flowing.set()

    async def stop(self) -> None:
        self.restore()
        self.cut()
        if self._server is not None:
            self._server.close()


@pytest.fixture
def target(url: str) -> tuple[str, int]:
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(url)
    return str(params.get("host", "127.0.0.1")), int(params.get("port", 5432))


async def until_granted(store: Store, within: float) -> float:
    """Seconds until an acquire succeeds again (fails the test after ``within``)."""
    started = time.monotonic()
    while True:
        try:
            if isinstance((await store.apply(acquire())).outcome, Granted):
                return time.monotonic() - started
        except ServiceUnavailable:
            pass
        assert time.monotonic() - started < within, "the store did not recover"
        await asyncio.sleep(0.1)


def test_a_dropped_database_answers_unavailable_and_recovers(
    make_store: StoreFactory, url: str, target: tuple[str, int]
) -> None:
    """Connections dropped and refused: ServiceUnavailable on time; back by itself after."""

    async def main() -> None:
        relay = Relay(*target)
        port = await relay.start()
        store = make_store("postgres", url=url_with(url, port=port), timeout_seconds=1)
        try:
            async with opened(store):
                await store.apply(acquire())
                relay.cut()
                for call in (store.apply(acquire()), store.ping()):
                    started = time.monotonic()
                    with pytest.raises(ServiceUnavailable):
                        await call
                    assert time.monotonic() - started <= 1.5
                await asyncio.sleep(0.5)  # stays down a while
                relay.restore()
                assert await until_granted(store, within=5.0) < 5.0
                await store.ping()
        finally:
            await relay.stop()

    asyncio.run(main())


def test_a_server_that_stops_answering_the_schema_lookup_ends_the_open(
    url: str, target: tuple[str, int]
) -> None:
    """Opening without ``schema=`` first looks the schema up: a server that takes the
    connection and then never answers (stopped, a hung host) ends the open with
    ServiceUnavailable, as it does at every other step, instead of waiting for ever."""
    from leasekeeper.store._postgres import PostgresStore

    schema = new_schema_name()
    with admin(url) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')

    async def main() -> None:
        relay = Relay(*target)
        port = await relay.start()
        path = url_with(url, port=port, options=f"-csearch_path={schema}")
        store = PostgresStore(path, application_name=schema, timeout_seconds=1)
        relay.trap(b"current_schemas", deliver=False, hold=True)
        try:
            with pytest.raises(ServiceUnavailable, match="timed out"):
                await asyncio.wait_for(store.open(), 60)
            assert relay.trapped
        finally:
            await relay.stop()

    try:
        asyncio.run(main())
    finally:
        drop_schema(url, schema)


def test_a_stalled_network_answers_unavailable_within_the_timeout(
    make_store: StoreFactory, url: str, target: tuple[str, int]
) -> None:
    """A network that swallows packets mid-request still gets an answer within the timeout."""

    async def main() -> None:
        relay = Relay(*target)
        port = await relay.start()
        store = make_store("postgres", url=url_with(url, port=port), timeout_seconds=1)
        try:
            async with opened(store):
                key, owner = new_id(), new_id()
                await store.apply(acquire(key, owner))
                relay.blackhole()
                started = time.monotonic()
                with pytest.raises(ServiceUnavailable):
                    await store.apply(Renew(key, owner, TTL))
                assert time.monotonic() - started <= 1.5
                relay.restore()
                assert await until_granted(store, within=5.0) < 5.0
        finally:
            await relay.stop()

    asyncio.run(main())


def test_the_store_refuses_calls_when_not_open(url: str) -> None:
    """Calls on a store that is not open are unavailable, not a crash."""
    store = open_store(url)
    with pytest.raises(ServiceUnavailable):
        asyncio.run(store.apply(acquire()))
    with pytest.raises(ServiceUnavailable):
        asyncio.run(store.count_live())  # type: ignore[attr-defined]


# The extended-protocol Parse message of our COMMIT (the BEGIN's "READ COMMITTED" differs).
COMMIT_MESSAGE = b"\x00COMMIT\x00"


def test_a_commit_whose_answer_was_lost_is_found_and_acknowledged(
    make_store: StoreFactory,
    url: str,
    target: tuple[str, int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """When a COMMIT reaches the server but its answer is lost, the decision still stands."""
    caplog.set_level(logging.INFO, logger="leasekeeper.store.postgres")

    async def main() -> None:
        relay = Relay(*target)
        port = await relay.start()
        store = make_store("postgres", url=url_with(url, port=port), timeout_seconds=3)
        try:
            async with opened(store):
                key, owner = new_id(), new_id()
                relay.trap(COMMIT_MESSAGE, deliver=True)
                granted = await store.apply(acquire(key, owner))
                assert relay.trapped
                assert isinstance(granted.outcome, Granted)
                renewed = await store.apply(Renew(key, owner, TTL))
                assert isinstance(renewed.outcome, Renewed)
                assert renewed.outcome.record.fencing_token == granted.outcome.record.fencing_token
        finally:
            await relay.stop()

    asyncio.run(main())
    assert "a cut-off COMMIT had taken effect" in caplog.text


def test_a_release_that_took_effect_is_released_even_once_a_new_owner_holds_the_key(
    make_store: StoreFactory,
    url: str,
    target: tuple[str, int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A release's COMMIT reaches the server, its answer is lost, and before the store
    looks, another instance grants the freed key: the row no longer shows the release,
    but the transaction committed, so the answer is released, not lost."""
    caplog.set_level(logging.INFO, logger="leasekeeper.store.postgres")

    async def main() -> None:
        relay = Relay(*target)
        port = await relay.start()
        store = make_store("postgres", url=url_with(url, port=port), timeout_seconds=3)
        other = make_store("postgres", like=store, url=url, timeout_seconds=3)
        try:
            async with opened(store), opened(other):
                key, owner = new_id(), new_id()
                granted = await store.apply(acquire(key, owner))
                assert isinstance(granted.outcome, Granted)
                landed = store._runner.landed  # type: ignore[attr-defined]
                newer: list[Any] = []

                async def after_a_new_owner(*args: Any) -> set[bytes]:
                    newer.append(await other.apply(acquire(key, new_id())))
                    return await landed(*args)  # type: ignore[no-any-return]

                store._runner.landed = after_a_new_owner  # type: ignore[attr-defined]
                relay.trap(COMMIT_MESSAGE, deliver=True)
                released = await store.apply(Release(key, owner))
                assert relay.trapped
                assert isinstance(newer[0].outcome, Granted)
                assert newer[0].outcome.record.fencing_token > granted.outcome.record.fencing_token
                assert isinstance(released.outcome, ReleasedOutcome), released.outcome
        finally:
            await relay.stop()

    asyncio.run(main())
    assert "a cut-off COMMIT had taken effect" in caplog.text


def test_only_an_ended_owner_followed_by_a_new_one_counts_without_its_row() -> None:
    """After a committed cut-off COMMIT, a row that changed since confirms a release
    followed by a higher fence, never a renew, a grant or a complete: a reused
    transaction id must not tell an owner it holds a lease it lost, or that a result is
    stored that is not."""
    from leasekeeper._core.model import LeaseRecord
    from leasekeeper.store._postgres_run import _ended_and_since

    key = new_id()

    def record(fence: int, owner: bytes | None, completed: int | None = None) -> LeaseRecord:
        return LeaseRecord(key, None, 10_000, fence, owner, 5_000, completed, None, 1_000)

    released, renewed, completed = record(4, None), record(4, new_id()), record(4, None, 2_000)
    newer = {key: record(5, new_id())}
    assert _ended_and_since(released, newer)
    assert not _ended_and_since(renewed, newer)
    assert not _ended_and_since(completed, newer)
    assert not _ended_and_since(released, {key: record(4, new_id())})
    assert not _ended_and_since(released, {})


def test_a_transaction_id_the_database_never_issued_leaves_the_rows_to_decide(
    make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """After a failover to a standby whose transaction ids are behind, asking for the
    status of the lost COMMIT's id fails ("in the future"): the rows decide alone, the
    batch is not answered 503 for it, and a WARNING says to raise the fencing counter."""
    from leasekeeper.store._postgres_run import Attempt

    store = make_store("postgres", timeout_seconds=3)

    async def main() -> set[bytes]:
        async with opened(store):
            key, owner = new_id(), new_id()
            granted = await store.apply(acquire(key, owner))
            assert isinstance(granted.outcome, Granted)
            attempt: Attempt[Any] = Attempt()
            attempt.written = [granted.outcome.record]
            attempt.updated = {key}
            async with store._pool.connection() as conn:  # type: ignore[attr-defined]
                now = await (await conn.execute("SELECT txid_current()")).fetchone()
            assert now is not None
            attempt.txid = int(now[0]) + 1_000_000  # not handed out yet: "in the future"
            landed: set[bytes] = await store._runner.landed(  # type: ignore[attr-defined]
                store._pool,  # type: ignore[attr-defined]
                attempt,
                asyncio.get_running_loop().time() + 3,
            )
            return {k for k in landed if k == key}

    assert len(asyncio.run(main())) == 1
    assert "does not know a transaction it ran" in caplog.text
    assert "leasekeeper fence --raise-to" in caplog.text


def test_a_commit_that_never_arrived_is_decided_again(
    make_store: StoreFactory,
    url: str,
    target: tuple[str, int],
    clock: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """When a COMMIT is lost on its way, the transaction rolls back and the store decides again."""
    caplog.set_level(logging.INFO, logger="leasekeeper.store.postgres")

    async def main() -> None:
        relay = Relay(*target)
        port = await relay.start()
        store = make_store("postgres", url=url_with(url, port=port), timeout_seconds=3)
        try:
            async with opened(store):
                key, owner = new_id(), new_id()
                granted = await store.apply(acquire(key, owner))
                assert isinstance(granted.outcome, Granted)
                clock.advance(10)
                relay.trap(COMMIT_MESSAGE, deliver=False)
                renewed = await store.apply(Renew(key, owner, TTL))
                assert relay.trapped
                assert isinstance(renewed.outcome, Renewed)
                assert renewed.outcome.record.lease_expires_ms == clock.now_ms() + TTL
        finally:
            await relay.stop()

    asyncio.run(main())
    assert "a cut-off COMMIT had not taken effect; deciding again" in caplog.text


def test_a_cut_off_commit_whose_rows_cannot_be_read_back_has_an_unknown_outcome(
    make_store: StoreFactory,
    url: str,
    target: tuple[str, int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A COMMIT reaches the server, its answer is lost, and reading the rows back fails
    too: the caller is told the outcome is unknown ("outcome": "unknown"), never a
    plain 503, which would say nothing was written. Here the grant had landed."""

    async def main() -> None:
        relay = Relay(*target)
        port = await relay.start()
        store = make_store("postgres", url=url_with(url, port=port), timeout_seconds=3)
        try:
            async with opened(store):

                async def unreadable(*args: Any) -> set[bytes]:
                    raise psycopg.OperationalError("the lookup's connection failed too")

                store._runner.landed = unreadable  # type: ignore[attr-defined]
                key = new_id()
                relay.trap(COMMIT_MESSAGE, deliver=True)
                with pytest.raises(OutcomeUnknown) as unknown:
                    await store.apply(acquire(key))
                assert relay.trapped
                assert unknown.value.body()["outcome"] == "unknown"
                assert "could not be read back" in unknown.value.error
                again = await store.apply(acquire(key))
                assert isinstance(again.outcome, Held)  # it had landed: unknown was right
        finally:
            await relay.stop()

    with caplog.at_level(logging.WARNING, logger="leasekeeper.store.postgres"):
        asyncio.run(main())
    assert "its callers are told the outcome is unknown" in caplog.text


def test_a_commit_whose_answer_never_comes_has_an_unknown_outcome_a_timeout_later(
    make_store: StoreFactory, url: str, target: tuple[str, int]
) -> None:
    """A COMMIT is sent and nothing ever comes back on its connection (a server that
    stopped): at the deadline the batch is not given up on as if nothing was written;
    one timeout later its caller is told the outcome is unknown."""

    async def main() -> None:
        relay = Relay(*target)
        port = await relay.start()
        store = make_store("postgres", url=url_with(url, port=port), timeout_seconds=1)
        try:
            async with opened(store):
                relay.trap(COMMIT_MESSAGE, deliver=True, hold=True)
                started = time.monotonic()
                with pytest.raises(OutcomeUnknown):
                    await store.apply(acquire())
                assert 1.9 < time.monotonic() - started < 4
        finally:
            await relay.stop()

    asyncio.run(main())


class OnePool:
    """A pool of one fake connection, for ``Runner`` alone."""

    broken = closed = False

    @contextlib.asynccontextmanager
    async def connection(self, **options: float) -> AsyncIterator[Any]:
        yield self


def test_a_run_given_up_on_lets_no_attempt_commit_and_one_committing_is_waited_for() -> None:
    """At its deadline a run whose attempt has not begun to COMMIT answers 503 and
    abandons the run: that attempt can no longer COMMIT (it must roll back). One whose
    attempt has begun to COMMIT is waited for, and its own answer is the caller's."""
    from leasekeeper.store._base import Refusals, Throttled
    from leasekeeper.store._postgres_run import Attempt, Runner

    log = logging.getLogger("test")
    runner = Runner(0.1, Throttled(log, logging.INFO, lambda: 0), Refusals(lambda: 0))
    asked: list[bool] = []

    async def slow_then_commit(conn: Any, attempt: Attempt[str]) -> str:
        try:
            await asyncio.sleep(1)
        finally:
            asked.append(attempt.may_commit())
        return "committed"

    async def commit_then_slow(conn: Any, attempt: Attempt[str]) -> str:
        assert attempt.may_commit()
        await asyncio.sleep(0.15)  # past the deadline, within one more timeout
        return "committed"

    async def main() -> None:
        pool: Any = OnePool()
        with pytest.raises(ServiceUnavailable, match="did not answer in time") as late:
            await runner.run(pool, "apply", slow_then_commit)
        assert not isinstance(late.value, OutcomeUnknown)
        for _ in range(10):
            await asyncio.sleep(0)
        assert asked == [False]
        assert await runner.run(pool, "apply", commit_then_slow) == "committed"

    asyncio.run(main())


def test_closing_answers_every_queued_request(make_store: StoreFactory) -> None:
    """Requests queued for a batch when the store closes are answered, not left to time out."""
    store = make_store("postgres", timeout_seconds=30, max_batch=10, max_batches=1)

    async def main() -> None:
        await store.open()
        calls = [asyncio.ensure_future(store.apply(acquire())) for _ in range(600)]
        await asyncio.sleep(0)  # every call is queued; the first batch has begun
        started = time.monotonic()
        await store.close()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert time.monotonic() - started < 10
        assert all(
            isinstance(o, ServiceUnavailable) or isinstance(o.outcome, Granted)  # type: ignore[union-attr]
            for o in outcomes
        )
        assert any(isinstance(o, ServiceUnavailable) for o in outcomes)

    asyncio.run(main())


def test_an_unforeseen_failure_of_a_batch_is_internal_and_the_store_goes_on(
    make_store: StoreFactory,
) -> None:
    """A bug in a batch answers its requests 500 internal (not unavailable) and no others."""
    from leasekeeper._errors import InternalError

    store = make_store("postgres")

    async def main() -> None:
        async with opened(store):
            original = store._decide_batch  # type: ignore[attr-defined]
            calls = 0

            async def flaky(*args: Any) -> Any:
                nonlocal calls
                calls += 1
                if calls == 1:
                    raise RuntimeError("simulated bug")
                return await original(*args)

            store._decide_batch = flaky  # type: ignore[attr-defined]
            with pytest.raises(InternalError):
                await store.apply(acquire())
            assert isinstance((await store.apply(acquire())).outcome, Granted)

    asyncio.run(main())
