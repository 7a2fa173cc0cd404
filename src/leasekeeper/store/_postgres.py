"""The PostgreSQL store: several service instances, one truth.

Every instance shares the tables, the fencing sequence and the database server's
clock, so instance clocks do not matter. One ``apply`` is one READ COMMITTED
transaction on a pooled connection, sent in pipeline mode::

    round trip 1:  BEGIN; SELECT … FOR UPDATE (the key's row); SELECT clock_timestamp()
                   ── decide_with_fence, in Python ──
    round trip 2:  SELECT nextval(fence)               (only when a new owner is granted)
    round trip 3:  UPDATE or INSERT the decided row; COMMIT    (synchronous_commit=on)

so a decision costs two round trips, three when it grants. The clock is read in
its own statement *after* the row lock is held: a decision never runs at a time
from before it waited for the previous decision on the same key.

Two instances deciding on one key serialize on the row lock. A key without a row
has nothing to lock, so its first write is ``INSERT … ON CONFLICT DO NOTHING``:
when another transaction created the row first, nothing is written and the whole
decision runs again against that row. Nothing else is ever written without the
row lock, so there is no read-then-write race between instances.

Failures: serialization failures and deadlocks are retried inside the store, as
is a connection found dead before the COMMIT was sent (the server rolls such a
transaction back). When a connection dies with its COMMIT in flight, the store
reads the key's row on another connection (waiting for its lock) to learn whether
the decision took effect: if so it is returned, if not it is decided again.
Everything else that goes wrong with the database (refused, dropped, blocked, too
slow) is translated in ``_run``, the one place psycopg errors become
``ServiceUnavailable``, within ``timeout_seconds``; the pool replaces dead
connections by itself, so the store recovers when the database is back. No
message or log line carries a key id, token or query parameter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool

from leasekeeper._core.clock import Clock
from leasekeeper._core.model import Command, Decision, LeaseRecord
from leasekeeper._core.rules import decide
from leasekeeper._errors import ServiceUnavailable
from leasekeeper.store._base import decide_with_fence

__all__ = ["SCHEMA_VERSION", "PostgresStore"]

log = logging.getLogger("leasekeeper.store.postgres")

T = TypeVar("T")
Connection = psycopg.AsyncConnection[TupleRow]

SCHEMA_VERSION: Final = 1

# The fencing counter is a SEQUENCE with CACHE 1, not a one-row counter table.
# Both are linearizable store-wide sources that never go back: nextval() hands out
# strictly increasing values in the order sessions call it, whatever the instance,
# and a value is durable once any transaction that used it commits (its WAL record
# precedes the COMMIT record, which synchronous_commit=on flushes, and replicates,
# before we answer). A counter row would be just as correct, but its row lock is
# held from the increment to the end of COMMIT, so every grant in the whole store
# would queue behind the previous grant's fsync; nextval() holds no lock beyond
# the call. CACHE must stay 1: with CACHE n each session pre-allocates n values,
# and a session holding the older block would grant lower tokens after a session
# holding the newer one. Values burnt by a rolled-back attempt leave gaps, which
# the contract allows (tokens must only increase).
_DDL: Final = (
    """
    CREATE TABLE IF NOT EXISTS leasekeeper_meta (
        name  text PRIMARY KEY,
        value bigint NOT NULL
    )
    """,
    """
    CREATE SEQUENCE IF NOT EXISTS leasekeeper_fence
        AS bigint MINVALUE 1 MAXVALUE 9223372036854775807 START 1 CACHE 1 NO CYCLE
    """,
    # The same columns as the SQLite store. ``result`` is text, not jsonb: jsonb
    # rejects \\u0000, reorders keys and normalizes numbers, and a stored result
    # must come back exactly as stored.
    """
    CREATE TABLE IF NOT EXISTS leasekeeper_leases (
        key_id              bytea  PRIMARY KEY,
        fingerprint         bytea,
        absolute_expires_ms bigint NOT NULL,
        fencing_token       bigint NOT NULL,
        owner               bytea,
        lease_expires_ms    bigint NOT NULL,
        completed_ms        bigint,
        result              text,
        updated_ms          bigint NOT NULL
    )
    """,
    """
    CREATE INDEX IF NOT EXISTS leasekeeper_leases_lifecycle_end
        ON leasekeeper_leases (absolute_expires_ms)
    """,
)

# Serializes schema changes between instances starting at once (CREATE … IF NOT
# EXISTS is not safe against a concurrent CREATE). Keyed by schema, so stores in
# different schemas do not wait for each other.
_MIGRATION_LOCK: Final = (
    "SELECT pg_advisory_xact_lock(1818977131, hashtext(coalesce(%s::text, current_schema(), '')))"
)

# Milliseconds of the server's clock: clock_timestamp() moves during a transaction,
# now() is frozen at its start.
_READ_CLOCK: Final = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"

_BEGIN: Final = "BEGIN ISOLATION LEVEL READ COMMITTED"
_LOCK_ROW: Final = (
    "SELECT fingerprint, absolute_expires_ms, fencing_token, owner, lease_expires_ms, "
    "completed_ms, result, updated_ms FROM leasekeeper_leases WHERE key_id = %s FOR UPDATE"
)
_NEXT_FENCE: Final = "SELECT nextval('leasekeeper_fence')"
_UPDATE: Final = (
    "UPDATE leasekeeper_leases SET fingerprint = %s, absolute_expires_ms = %s, "
    "fencing_token = %s, owner = %s, lease_expires_ms = %s, completed_ms = %s, "
    "result = %s, updated_ms = %s WHERE key_id = %s"
)
_INSERT: Final = (
    "INSERT INTO leasekeeper_leases (fingerprint, absolute_expires_ms, fencing_token, owner, "
    "lease_expires_ms, completed_ms, result, updated_ms, key_id) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (key_id) DO NOTHING"
)
# SKIP LOCKED: a row locked by a decision in progress is left for the next batch
# (that decision may be starting a new lifecycle on it).
_PURGE_AT_DB_NOW: Final = (
    "DELETE FROM leasekeeper_leases WHERE key_id IN (SELECT key_id FROM leasekeeper_leases "
    "WHERE absolute_expires_ms <= floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint "
    "LIMIT %s FOR UPDATE SKIP LOCKED)"
)
_PURGE_AT: Final = (
    "DELETE FROM leasekeeper_leases WHERE key_id IN (SELECT key_id FROM leasekeeper_leases "
    "WHERE absolute_expires_ms <= %s LIMIT %s FOR UPDATE SKIP LOCKED)"
)
_PING: Final = "SELECT 1 FROM leasekeeper_leases LIMIT 0"

_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}\Z")
# Errors after which the same transaction, run again, may well succeed.
_TRANSIENT = (pg_errors.SerializationFailure, pg_errors.DeadlockDetected)
_MAX_ATTEMPTS = 20


@dataclass(slots=True)
class _Attempt(Generic[T]):
    """What one attempt got to, so a failure can tell whether retrying is safe."""

    #: The COMMIT has been sent: a failure from here on leaves the outcome unknown.
    committing: bool = False
    #: What the attempt returns once its COMMIT is known to have taken effect.
    result: T | None = None
    #: The record the attempt writes, to look for after a cut-off COMMIT (None: no write).
    written: LeaseRecord | None = None


class _Retry(Exception):
    """Run the decision again: another transaction created the key's row first."""


class PostgresStore:
    """Records in PostgreSQL (``postgresql://user@host/db``), shared by many instances.

    ``clock`` replaces the database clock (tests pass a ``FakeClock``).
    ``timeout_seconds`` bounds every call: waiting for a connection, connecting,
    each statement, and the call as a whole. ``schema`` puts the tables in that
    schema, creating it if needed; otherwise they go where the connection's
    ``search_path`` points (for example ``?options=-csearch_path%3Dname`` in the
    URL). ``application_name`` names the connections in ``pg_stat_activity``.
    """

    def __init__(
        self,
        url: str,
        *,
        clock: Clock | None = None,
        timeout_seconds: float = 5.0,
        schema: str | None = None,
        application_name: str | None = None,
        min_size: int = 1,
        max_size: int = 10,
    ) -> None:
        if timeout_seconds <= 0:
            raise ValueError("timeout_seconds must be positive")
        if schema is not None and not _SCHEMA_NAME.match(schema):
            raise ValueError("schema must be a lower-case identifier (a-z, 0-9, underscore)")
        self.schema = schema
        self._clock = clock
        self._timeout = timeout_seconds
        self._conninfo = _conninfo(url, timeout_seconds, schema, application_name)
        self._min_size = min_size
        self._max_size = max_size
        self._pool: AsyncConnectionPool[Connection] | None = None
        self._open_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._checking: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        async with self._open_lock:
            if self._pool is not None:
                return
            pool: AsyncConnectionPool[Connection] = AsyncConnectionPool(
                self._conninfo,
                kwargs={"autocommit": True},
                min_size=self._min_size,
                max_size=self._max_size,
                open=False,
                name="leasekeeper",
                timeout=self._timeout,
                # A connection that cannot be re-established is retried with
                # backoff for this long, then on demand: keeps recovery after a
                # long outage within seconds.
                reconnect_timeout=max(10.0, 2 * self._timeout),
            )
            try:
                await pool.open(wait=True, timeout=self._timeout)
                async with asyncio.timeout(self._timeout * 2):
                    await self._migrate(pool)
            except BaseException as exc:
                await pool.close()
                if isinstance(exc, pg_errors.InvalidSchemaName):
                    raise ServiceUnavailable(
                        "Cannot open the PostgreSQL store: the search_path names no existing "
                        "schema to create the tables in"
                    ) from exc
                if isinstance(exc, psycopg.Error | TimeoutError):
                    reason = _describe(exc) if isinstance(exc, psycopg.Error) else "timed out"
                    log.error("cannot open the PostgreSQL store: %s", reason)
                    raise ServiceUnavailable(f"Cannot open the PostgreSQL store: {reason}") from exc
                raise
            self._pool = pool

    async def close(self) -> None:
        async with self._open_lock:
            pool, self._pool = self._pool, None
            if pool is None:
                return
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=self._timeout)
            await pool.close(timeout=self._timeout)

    # -- the interface ---------------------------------------------------------------------

    async def apply(self, command: Command) -> Decision:
        async def run(conn: Connection, attempt: _Attempt[Decision]) -> Decision:
            return await self._decide(conn, command, attempt)

        return await self._run("apply", run)

    async def purge(self, limit: int) -> int:
        async def run(conn: Connection, attempt: _Attempt[int]) -> int:
            # One statement in autocommit: its own transaction, safe to repeat.
            if self._clock is None:
                cursor = await conn.execute(_PURGE_AT_DB_NOW, (limit,))
            else:
                cursor = await conn.execute(_PURGE_AT, (self._clock.now_ms(), limit))
            return max(cursor.rowcount, 0)

        return await self._run("purge", run)

    async def ping(self) -> None:
        async def run(conn: Connection, attempt: _Attempt[None]) -> None:
            # Touches the table, so a blocked table reads as "cannot serve".
            await conn.execute(_PING)

        await self._run("ping", run)

    # -- one decision ----------------------------------------------------------------------

    async def _decide(
        self, conn: Connection, command: Command, attempt: _Attempt[Decision]
    ) -> Decision:
        written: psycopg.AsyncCursor[TupleRow] | None = None
        clock = self._clock
        async with conn.pipeline():
            await conn.execute(_BEGIN)
            locked = await conn.execute(_LOCK_ROW, (command.key_id,))
            if clock is None:
                timed = await conn.execute(_READ_CLOCK)
                row = await locked.fetchone()  # sends the three statements: round trip 1
                now_ms = _first_int(await timed.fetchone())
            else:
                row = await locked.fetchone()
                now_ms = clock.now_ms()
            record = None if row is None else LeaseRecord(command.key_id, *row)
            # decide_with_fence takes a synchronous next_fence, and nextval() is a
            # round trip. The rules are pure and cheap, so ask them first whether
            # this decision grants a new owner, and draw a fence only then: no value
            # is drawn for a decision that does not need one.
            fence = 0
            if decide(record, command, now_ms).new_owner:
                drawn = await conn.execute(_NEXT_FENCE)
                fence = _first_int(await drawn.fetchone())  # round trip 2, grants only
            decision = decide_with_fence(record, command, now_ms, lambda: fence)
            w = decision.write
            if w is not None:
                values = (
                    w.fingerprint,
                    w.absolute_expires_ms,
                    w.fencing_token,
                    w.owner,
                    w.lease_expires_ms,
                    w.completed_ms,
                    w.result,
                    w.updated_ms,
                    w.key_id,
                )
                written = await conn.execute(_INSERT if record is None else _UPDATE, values)
            await conn.execute("COMMIT")
            attempt.committing, attempt.result, attempt.written = True, decision, w
        # Leaving the pipeline sent the write and COMMIT and waited for both.
        if record is None and written is not None and written.rowcount != 1:
            # Another transaction created the row after our SELECT found none; our
            # transaction wrote nothing (a drawn fence is merely skipped).
            raise _Retry
        return decision

    # -- the one choke point ---------------------------------------------------------------

    async def _run(self, what: str, work: Callable[[Connection, _Attempt[T]], Awaitable[T]]) -> T:
        """Run ``work`` on a pooled connection, with retries, within the timeout.

        The work runs in its own task, so that the caller is answered on time
        even when cancelling a query on a dead network would take longer; the
        task is cancelled and finishes in the background.
        """
        pool = self._pool
        if pool is None:
            raise ServiceUnavailable("The lease store is not open")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        task = loop.create_task(self._attempts(pool, work, deadline))
        self._tasks.add(task)
        task.add_done_callback(self._settled)
        try:
            async with asyncio.timeout_at(deadline):
                return await asyncio.shield(task)
        except TimeoutError:
            log.warning("PostgreSQL store: %s did not finish within %.1f s", what, self._timeout)
            raise ServiceUnavailable("The lease store did not answer in time") from None
        except psycopg.Error as exc:
            log.warning("PostgreSQL store: %s failed: %s", what, _describe(exc))
            raise ServiceUnavailable("The lease store cannot be reached; retry shortly") from exc
        finally:
            if not task.done():
                task.cancel()

    async def _attempts(
        self,
        pool: AsyncConnectionPool[Connection],
        work: Callable[[Connection, _Attempt[T]], Awaitable[T]],
        deadline: float,
    ) -> T:
        loop = asyncio.get_running_loop()
        for number in range(1, _MAX_ATTEMPTS + 1):
            attempt: _Attempt[T] = _Attempt()
            conn: Connection | None = None
            last = number == _MAX_ATTEMPTS
            try:
                async with pool.connection(timeout=max(0.0, deadline - loop.time())) as conn:
                    try:
                        return await work(conn, attempt)
                    except BaseException:
                        await _end_transaction(conn)
                        raise
            except _Retry:
                if last:
                    raise ServiceUnavailable("The lease store is too busy; retry shortly") from None
            except _TRANSIENT as exc:
                if last:
                    raise
                log.info("PostgreSQL store: retrying after %s", type(exc).__name__)
                # Jittered backoff, so the transactions that collided do not collide again.
                await asyncio.sleep(random.uniform(0.001, 0.005 * number))
            except psycopg.OperationalError:
                broken = conn is not None and conn.broken
                if broken:
                    self._check_pool(pool)
                if attempt.committing and attempt.result is not None:
                    # The COMMIT was sent and its answer lost: look for its effect.
                    if await self._committed(pool, attempt.written, deadline):
                        return attempt.result
                elif broken and not attempt.committing:
                    # Dead before COMMIT was sent: the server rolls that transaction
                    # back, so running it again on another connection is safe.
                    log.info("PostgreSQL store: a pooled connection was dead; trying another")
                else:
                    raise
                if last:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _committed(
        self, pool: AsyncConnectionPool[Connection], written: LeaseRecord | None, deadline: float
    ) -> bool:
        """Whether a decision whose COMMIT was cut off took effect.

        A decision that writes nothing holds either way. Otherwise the key's row is
        read with ``FOR UPDATE``, which waits for a transaction still holding it to
        finish: the row equals the written record (its owner digest and decision time
        make it unique) when the COMMIT took effect and nothing changed the row since.
        Otherwise the decision is made again, against whatever the row holds now; that
        is safe, and at worst conservative (a release that did happen, followed at
        once by a new owner, is reported lost). A first write to a new key is the one
        case where the lock cannot be waited for; the new decision then meets that
        row through ``INSERT … ON CONFLICT`` and decides against it, so nothing is
        granted twice.
        """
        if written is None:
            return True
        loop = asyncio.get_running_loop()
        for number in range(1, _MAX_ATTEMPTS + 1):
            conn: Connection | None = None
            try:
                async with pool.connection(timeout=max(0.0, deadline - loop.time())) as conn:
                    cursor = await conn.execute(_LOCK_ROW, (written.key_id,))
                    row = await cursor.fetchone()
            except psycopg.OperationalError:
                if conn is None or not conn.broken or number == _MAX_ATTEMPTS:
                    raise
                continue  # another dead pooled connection: the read is safe to repeat
            landed = row is not None and LeaseRecord(written.key_id, *row) == written
            log.info(
                "PostgreSQL store: a cut-off COMMIT %s",
                "had taken effect" if landed else "had not taken effect; deciding again",
            )
            return landed
        raise AssertionError("unreachable")  # pragma: no cover

    def _check_pool(self, pool: AsyncConnectionPool[Connection]) -> None:
        """Weed out the pool's other dead connections in the background (once at a time)."""
        if self._checking is not None and not self._checking.done():
            return
        self._checking = asyncio.get_running_loop().create_task(pool.check())
        self._tasks.add(self._checking)
        self._checking.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the awaiting caller, if any, has reported it

    # -- schema ----------------------------------------------------------------------------

    async def _migrate(self, pool: AsyncConnectionPool[Connection]) -> None:
        """Create or upgrade the schema, one instance at a time."""
        async with pool.connection() as conn, conn.transaction():
            await conn.execute(_MIGRATION_LOCK, (self.schema,))
            if self.schema is not None:
                await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
            encoding = await (await conn.execute("SHOW server_encoding")).fetchone()
            if encoding is None or encoding[0] != "UTF8":
                raise ServiceUnavailable(
                    "The PostgreSQL database must use the UTF8 encoding so that results "
                    "round-trip exactly"
                )
            for statement in _DDL:
                await conn.execute(statement)
            await conn.execute(
                "INSERT INTO leasekeeper_meta (name, value) VALUES ('schema_version', %s) "
                "ON CONFLICT (name) DO NOTHING",
                (SCHEMA_VERSION,),
            )
            found = await conn.execute(
                "SELECT value FROM leasekeeper_meta WHERE name = 'schema_version'"
            )
            version = _first_int(await found.fetchone())
            if version > SCHEMA_VERSION:
                raise ServiceUnavailable(
                    f"The PostgreSQL schema has version {version}; this leasekeeper knows up "
                    f"to {SCHEMA_VERSION}: upgrade leasekeeper"
                )
            cached = await conn.execute(
                "SELECT cache_size FROM pg_sequences "
                "WHERE schemaname = current_schema() AND sequencename = 'leasekeeper_fence'"
            )
            row = await cached.fetchone()
            if row is not None and row[0] != 1:
                log.warning("the fencing sequence had CACHE %s; setting CACHE 1", row[0])
                await conn.execute("ALTER SEQUENCE leasekeeper_fence CACHE 1")


def _conninfo(url: str, timeout: float, schema: str | None, application_name: str | None) -> str:
    """The connection string: the URL's parameters, with the store's session settings.

    Session settings travel in the startup packet (``options``), so they cost no
    round trip and no connection can run without them. ``synchronous_commit=on``
    comes last so that nothing in the URL can turn it off; the timeouts come first
    so that the URL can override them.
    """
    try:
        params: dict[str, Any] = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        # The URL may hold a password: never repeat it.
        raise ValueError("malformed PostgreSQL URL") from None
    ms = math.ceil(timeout * 1000)
    ours = [
        f"-c statement_timeout={ms}",
        # A session frozen inside a transaction must not hold a key's row lock for long.
        f"-c idle_in_transaction_session_timeout={max(2 * ms, 5000)}",
    ]
    given = params.get("options")
    if given:
        ours.append(str(given))
    ours.append("-c synchronous_commit=on")
    if schema is not None:
        ours.append(f"-c search_path={schema}")
    params["options"] = " ".join(ours)
    if application_name is not None:
        params["application_name"] = application_name
    params.setdefault("application_name", "leasekeeper")
    params.setdefault("connect_timeout", str(max(2, math.ceil(timeout))))
    # With several hosts listed (failover), write only to the primary.
    params.setdefault("target_session_attrs", "read-write")
    # Notice a vanished server within seconds instead of the kernel's minutes.
    params.setdefault("keepalives", "1")
    params.setdefault("keepalives_idle", str(max(1, math.ceil(timeout))))
    params.setdefault("keepalives_interval", "1")
    params.setdefault("keepalives_count", "3")
    params.setdefault("tcp_user_timeout", str(ms))
    return make_conninfo("", **params)


async def _end_transaction(conn: Connection) -> None:
    """Roll back whatever the failed attempt left open, if the connection still works."""
    if conn.broken or conn.closed:
        return
    # On failure the pool discards or resets the connection when it comes back.
    with contextlib.suppress(psycopg.Error):
        await conn.rollback()


def _first_int(row: TupleRow | None) -> int:
    if row is None or row[0] is None:
        raise ServiceUnavailable("The lease store returned no value")
    return int(row[0])


def _describe(exc: BaseException) -> str:
    """What went wrong, for logs: the error class and SQLSTATE, or libpq's message.

    Server messages can quote values, so only the class and code are used for
    them; libpq's own messages (refused, closed, timed out) name hosts, not data.
    """
    if isinstance(exc, psycopg.Error) and exc.sqlstate is not None:
        return f"{type(exc).__name__} (SQLSTATE {exc.sqlstate})"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
