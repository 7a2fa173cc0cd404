"""The PostgreSQL store: several service instances, one truth.

Every instance shares the tables, the fencing sequence and the database server's
clock, so instance clocks do not matter. Concurrent ``apply`` calls are decided in
batches: each batch is one READ COMMITTED transaction on a pooled connection, sent
in pipeline mode (see ``_decide_batch``)::

    round trip 1:  BEGIN; SELECT … FOR UPDATE (the batch's rows, in key order);
                   SELECT clock_timestamp(), txid_current_if_assigned()
                   ── decide_with_fence for each command in turn, in Python ──
    round trip 2:  SELECT nextval(fence), once per new owner   (only when granting)
    round trip 3:  UPDATE the changed rows; INSERT the new ones; COMMIT
                   (synchronous_commit=on)

so a lone request costs two or three round trips, and under load one transaction
and one commit serve many requests. The clock is read in its own statement *after* the row
locks are held: a decision never runs at a time from before it waited for the
previous decision on the same key.

Two instances deciding on one key serialize on the row lock; locks are taken in key
order, so batches sharing keys queue rather than deadlock. A key without a row has
nothing to lock, so its first write is ``INSERT … ON CONFLICT DO NOTHING``: when
another transaction created the row first, nothing of that key is written and its
commands are decided again against that row. Nothing else is ever written without
the row lock, so there is no read-then-write race between instances.

Failures: serialization failures and deadlocks are retried inside the store, as
is a connection found dead before the COMMIT was sent (the server rolls such a
transaction back). When a connection dies with its COMMIT in flight, the store
reads the batch's written rows on another connection (waiting for their locks) and
asks whether its transaction committed, to learn which decisions took effect: those
that did are returned, the others are decided again (``_landed``).
Everything else that goes wrong with the database (refused, dropped, blocked, too
slow) is translated in ``_run``, the one place psycopg errors become
``ServiceUnavailable``, within ``timeout_seconds``; the pool replaces dead
connections by itself, so the store recovers when the database is back. No
message or log line carries a key id, token or query parameter.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import random
import re
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from leasekeeper._clock import Clock, elapsed_ns
from leasekeeper._core.model import Command, Decision, LeaseRecord
from leasekeeper._errors import InternalError, LeaseError, ServiceUnavailable
from leasekeeper.store._base import (
    Deadlines,
    Purged,
    Refusals,
    Throttled,
    decide_in_turn,
    settle,
)

__all__ = ["DEFAULT_POOL_SIZE", "SCHEMA_VERSION", "PostgresStore"]

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
# The database server's clock, in milliseconds: every instance reads time from it.
_DB_NOW_MS: Final = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
# The clock, and the batch's transaction id: sent after the rows are locked, which
# assigns the transaction its id whenever a row exists (FOR UPDATE marks the rows
# with it), so asking costs nothing more. After a cut-off COMMIT, txid_status() on
# another connection then says whether the transaction committed (PostgreSQL 10+).
_READ_CLOCK_AND_TXID: Final = f"SELECT {_DB_NOW_MS}, txid_current_if_assigned()"
_TXID_STATUS: Final = "SELECT txid_status(%s)"


# Whether a relation is in the schema the store's statements create and use
# (current_schema(): the first schema of the search_path that exists), not anywhere on
# the search_path, where another store's could stand: the meta table, the sequence.
_IN_OWN_SCHEMA: Final = (
    "EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = current_schema() AND c.relname = "
)
_META_IN_OWN_SCHEMA: Final = _IN_OWN_SCHEMA + "'leasekeeper_meta')"
_FENCE_IN_OWN_SCHEMA: Final = _IN_OWN_SCHEMA + "'leasekeeper_fence')"
_STORE_EXISTS: Final = "SELECT " + _META_IN_OWN_SCHEMA
_FENCE_EXISTS: Final = "SELECT " + _FENCE_IN_OWN_SCHEMA

# The schema the store would be in (the first existing one of the search_path), and
# the schemas of the search_path that hold a store, in its order.
_WHERE_THE_STORE_IS: Final = (
    "SELECT current_schema(), ARRAY(SELECT n.nspname::text FROM pg_class c "
    "JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.relname = 'leasekeeper_meta' AND n.nspname = ANY (current_schemas(false)) "
    "ORDER BY array_position(current_schemas(false), n.nspname))"
)

_BEGIN: Final = "BEGIN ISOLATION LEVEL READ COMMITTED"
# A batch's rows, locked in key order: two batches (of any instances) that share keys
# take their locks in the same order, so they queue instead of deadlocking.
_LOCK_ROWS: Final = (
    "SELECT key_id, fingerprint, absolute_expires_ms, fencing_token, owner, "
    "lease_expires_ms, completed_ms, result, updated_ms FROM leasekeeper_leases "
    "WHERE key_id = ANY(%s) ORDER BY key_id FOR UPDATE"
)
_NEXT_FENCES: Final = "SELECT nextval('leasekeeper_fence') FROM generate_series(1, %s)"
# The nine columns of a list of records, as arrays (``_columns``), as rows ``v``.
_UNNEST: Final = (
    "FROM unnest(%s::bytea[], %s::bytea[], %s::bigint[], %s::bigint[], %s::bytea[], "
    "%s::bigint[], %s::bigint[], %s::text[], %s::bigint[]) AS v (key_id, fingerprint, "
    "absolute_expires_ms, fencing_token, owner, lease_expires_ms, completed_ms, result, "
    "updated_ms) "
)
_UPDATE_MANY: Final = (
    "UPDATE leasekeeper_leases AS l SET fingerprint = v.fingerprint, "  # noqa: S608 - module constants only
    "absolute_expires_ms = v.absolute_expires_ms, fencing_token = v.fencing_token, "
    "owner = v.owner, lease_expires_ms = v.lease_expires_ms, "
    "completed_ms = v.completed_ms, result = v.result, updated_ms = v.updated_ms "
    + _UNNEST
    + "WHERE l.key_id = v.key_id"
)
_INSERT_MANY: Final = (
    "INSERT INTO leasekeeper_leases (key_id, fingerprint, absolute_expires_ms, "
    "fencing_token, owner, lease_expires_ms, completed_ms, result, updated_ms) "
    "SELECT * " + _UNNEST + "ORDER BY key_id ON CONFLICT (key_id) DO NOTHING RETURNING key_id"
)
# SKIP LOCKED: a row locked by a decision in progress is left for the next batch
# (that decision may be starting a new lifecycle on it). The records that ended first
# go first, through leasekeeper_leases_lifecycle_end: rows sit in the heap in about
# the order they were created, so one step's deletes share a few pages. The database
# clock is read once, in a subquery (an InitPlan): in the WHERE clause itself
# clock_timestamp() is volatile, so it could not bound an index scan and was evaluated
# for every row of a sequential scan instead. Measured on 1M live and 100k finished
# records: a step took 4.2 ms at the median and the last step of a cleanup, which finds
# fewer than it may delete, 762 ms (a scan of the whole table); now 3.6 and 11 ms.
# The rows are deleted where the subquery found and locked them (their ctid, which a
# held lock keeps in place until the statement ends), not looked up again one by one
# in the primary key: a step of 200 of 1M expired records ran in 1.7 ms, now 0.3 ms.
_PURGE_AT_DB_NOW: Final = (
    "DELETE FROM leasekeeper_leases WHERE ctid = ANY(ARRAY(SELECT ctid FROM leasekeeper_leases "  # noqa: S608 - module constants only
    f"WHERE absolute_expires_ms <= (SELECT {_DB_NOW_MS}) "
    "ORDER BY absolute_expires_ms LIMIT %s FOR UPDATE SKIP LOCKED))"
)
_PURGE_AT: Final = (
    "DELETE FROM leasekeeper_leases WHERE ctid = ANY(ARRAY(SELECT ctid FROM leasekeeper_leases "
    "WHERE absolute_expires_ms <= %s ORDER BY absolute_expires_ms LIMIT %s "
    "FOR UPDATE SKIP LOCKED))"
)
_PING: Final = "SELECT 1 FROM leasekeeper_leases LIMIT 0"
# What a write needs besides the table: a session that may write (not a read-only
# database, nor a standby reached by an old connection) and the fencing sequence.
_CAN_WRITE: Final = (
    "SELECT current_setting('transaction_read_only') = 'off', " + _FENCE_IN_OWN_SCHEMA
)
# Raising the counter (``raise_fence``). setval() alone could race another
# instance's nextval(): read 10, another session draws 11, setval(10) takes it back.
# ALTER SEQUENCE locks the sequence until COMMIT, and nextval() waits for that lock
# (seen on PostgreSQL 15: a nextval() sent meanwhile returned only after the COMMIT,
# and above the raised value), so between the read and the setval nothing is drawn.
# CACHE 1 is what the sequence has anyway (``_DDL``). Needs the sequence's owner.
_LOCK_FENCE: Final = "ALTER SEQUENCE leasekeeper_fence CACHE 1"
# The counter: the last value drawn, or 0 before the first (last_value is then START).
_READ_FENCE: Final = (
    "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM leasekeeper_fence"
)
_SET_FENCE: Final = "SELECT setval('leasekeeper_fence', %s)"
# Leases held at the store's now: the same definition as the other stores. A plain
# SELECT takes no row locks, and its ACCESS SHARE table lock conflicts with none that a
# write takes, so the scan neither delays a decision nor waits for one. The database
# clock is read once, in a subquery (an InitPlan): in the WHERE clause itself
# clock_timestamp() would be evaluated again for every row, and the time would move
# during the scan.
_COUNT_LIVE_AT_DB_NOW: Final = (
    "SELECT count(*) FROM leasekeeper_leases WHERE owner IS NOT NULL AND lease_expires_ms > "  # noqa: S608 - module constants only
    f"(SELECT {_DB_NOW_MS})"
)
_COUNT_LIVE_AT: Final = (
    "SELECT count(*) FROM leasekeeper_leases WHERE owner IS NOT NULL AND lease_expires_ms > %s"
)

#: Connections a store opens at most, unless told otherwise (``max_size``).
DEFAULT_POOL_SIZE: Final = 10

_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}\Z")
# Errors after which the same transaction, run again, may well succeed.
_TRANSIENT = (pg_errors.SerializationFailure, pg_errors.DeadlockDetected)
_MAX_ATTEMPTS = 20


@dataclass(slots=True)
class _Attempt(Generic[T]):
    """What one attempt got to, so a failure can tell whether retrying is safe."""

    #: The COMMIT has been sent: a failure from here on leaves the outcome unknown.
    committing: bool = False
    #: The records the attempt writes, to look for after a cut-off COMMIT.
    written: list[LeaseRecord] = field(default_factory=list)
    #: Of those, the key ids of rows that existed (locked and updated, not inserted).
    updated: set[bytes] = field(default_factory=set)
    #: The transaction's id, when it has one (``_READ_CLOCK_AND_TXID``).
    txid: int | None = None
    #: After a cut-off COMMIT: what the attempt returns, given the key ids whose
    #: written record is found in the table.
    resolve: Callable[[set[bytes]], T] | None = None


@dataclass(slots=True)
class _Pending:
    """One ``apply`` waiting for a batch: its command and its caller's future."""

    command: Command
    future: asyncio.Future[Decision]
    #: Batches that had to give this command back (its key's row appeared meanwhile).
    returned: int = 0


@dataclass(slots=True)
class _Batch:
    """A committed batch: each command's decision (or error), and the commands to run again."""

    results: list[tuple[_Pending, Decision | LeaseError]]
    again: list[_Pending]


class PostgresStore:
    """Records in PostgreSQL (``postgresql://user@host/db``), shared by many instances.

    ``clock`` replaces the database clock (tests pass a ``FakeClock``).
    ``timeout_seconds`` bounds every call: waiting for a connection, connecting,
    each statement, and the call as a whole. ``schema`` puts the tables in that
    schema, creating it if needed; otherwise they go where the connection's
    ``search_path`` points (for example ``?options=-csearch_path%3Dname`` in the
    URL): its first existing schema, looked up when the store opens and kept while
    it is open (``_pinned``). ``application_name`` names the connections in ``pg_stat_activity``.

    ``max_size`` is the most connections the store opens (its pool keeps at least
    ``min_size``, at most ``max_size``; ``LEASEKEEPER_POSTGRES_POOL_SIZE``). Up to
    ``max_batch`` queued commands are decided in one transaction, and up to
    ``max_batches`` such transactions run at once, each on a connection of its own:
    never more than ``max_size``, since a batch without a connection would only hold
    its commands back from the next one. ``purge``, ``ping`` and ``count_live`` take
    a pooled connection for one statement each. No call ever holds one connection
    while waiting for another (a cut-off COMMIT is looked for after its connection
    went back), so even a pool of one serves everything, in turn.
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
        max_size: int = DEFAULT_POOL_SIZE,
        max_batch: int = 256,
        max_batches: int = 4,
    ) -> None:
        if timeout_seconds <= 0:
            raise ValueError("timeout_seconds must be positive")
        if max_size < 1:
            raise ValueError("the pool size must be at least 1")
        if schema is not None and not _SCHEMA_NAME.match(schema):
            raise ValueError("schema must be a lower-case identifier (a-z, 0-9, underscore)")
        self.schema = schema
        self._clock = clock
        #: Failed calls: when the database is down or read-only, every batch fails.
        paced = clock.now_ms if clock is not None else _elapsed_ms
        self._failures = Throttled(log, logging.WARNING, paced)
        self._refusals = Refusals(paced)
        self._timeout = timeout_seconds
        self._deadlines = Deadlines(timeout_seconds)
        self._given_conninfo = _conninfo(url, timeout_seconds, schema, application_name)
        #: What the pool connects with: the given one, with the schema pinned once open.
        self._conninfo = self._given_conninfo
        self._min_size = min(min_size, max_size)
        self._max_size = max_size
        self._pool: AsyncConnectionPool[Connection] | None = None
        self._open_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._checking: asyncio.Task[None] | None = None
        self._max_batch = max_batch
        self._max_batches = max(1, min(max_batches, max_size))
        self._waiting: deque[_Pending] = deque()
        self._batches = 0  # batch runners active

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        async with self._open_lock:
            if self._pool is not None:
                return
            pool: AsyncConnectionPool[Connection] | None = None
            try:
                pool = await self._new_pool(self._given_conninfo)
                if self.schema is None:  # look the schema up, then pin it (_pinned)
                    async with asyncio.timeout(self._timeout), pool.connection() as conn:
                        self._conninfo = await self._pinned(conn, self._given_conninfo)
                    await pool.close()
                    pool = None
                    pool = await self._new_pool(self._conninfo)
                async with asyncio.timeout(self._timeout * 2):
                    await self._migrate(pool)
            except BaseException as exc:
                if pool is not None:
                    await pool.close()
                if isinstance(exc, pg_errors.InvalidSchemaName):
                    raise ServiceUnavailable(
                        "Cannot open the PostgreSQL store: the search_path names no existing "
                        "schema to create the tables in"
                    ) from exc
                if isinstance(exc, PoolTimeout):  # the pool says only that it gave up
                    reason = await self._why_no_connection() or _describe(exc)
                    raise ServiceUnavailable(f"Cannot open the PostgreSQL store: {reason}") from exc
                if isinstance(exc, psycopg.Error | TimeoutError):
                    reason = _describe(exc) if isinstance(exc, psycopg.Error) else "timed out"
                    raise ServiceUnavailable(f"Cannot open the PostgreSQL store: {reason}") from exc
                raise
            self._pool = pool

    async def _new_pool(self, conninfo: str) -> AsyncConnectionPool[Connection]:
        """An open pool on ``conninfo``: connecting is retried for up to the timeout."""
        pool: AsyncConnectionPool[Connection] = AsyncConnectionPool(
            conninfo,
            kwargs={"autocommit": True},
            min_size=self._min_size,
            max_size=self._max_size,
            open=False,
            name="leasekeeper",
            timeout=self._timeout,
            # A connection that cannot be re-established is retried with backoff for
            # this long, then on demand: keeps recovery after a long outage within seconds.
            reconnect_timeout=max(10.0, 2 * self._timeout),
        )
        try:
            await pool.open(wait=True, timeout=self._timeout)
        except BaseException:
            await pool.close()
            raise
        return pool

    async def _pinned(self, conn: Connection, conninfo: str) -> str:
        """``conninfo`` with the search_path set to the one schema the store is in.

        Without ``schema=``, the store is in the first existing schema of the search
        path (``current_schema()``), which moves when someone creates a schema ahead
        of it: the default ``"$user", public`` takes a schema named after the role the
        moment it exists. Looked up once, here, and then set on every connection, the
        schema stays put for as long as the store is open. A search path whose first
        schema holds no store while a later one does is refused: the store would
        otherwise start over, empty and with a counter from 1, beside the real one.
        """
        row = await (await conn.execute(_WHERE_THE_STORE_IS)).fetchone()
        current, holding = row if row is not None else (None, [])
        if current is None:  # no schema to create the tables in: _migrate explains
            return conninfo
        if holding and current not in holding:
            raise ServiceUnavailable(
                f'Cannot open the PostgreSQL store: the first schema of the search_path, "'
                f'{current}", holds no leasekeeper store, but "{holding[0]}", later on it, '
                "does; name the schema to use in the URL's options (-c search_path=NAME)"
            )
        params = conninfo_to_dict(conninfo)
        pinned = _option_value('"' + current.replace('"', '""') + '"')
        params["options"] = f"{params.get('options') or ''} -c search_path={pinned}".strip()
        return make_conninfo("", **params)

    async def _why_no_connection(self) -> str | None:
        """Why a connection cannot be made (libpq's reason: refused, no such database or
        role, authentication failed), from one attempt of its own; None if it can."""
        try:
            async with asyncio.timeout(self._timeout):
                conn = await psycopg.AsyncConnection.connect(self._conninfo)
                await conn.close()
        except psycopg.Error as exc:
            return _describe(exc)
        except TimeoutError:
            return "connecting timed out"
        return None

    async def close(self) -> None:
        async with self._open_lock:
            pool, self._pool = self._pool, None
            if pool is None:
                return
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=self._timeout)
            while self._waiting:  # queued, never taken by a batch: answer them now
                settle(self._waiting.popleft().future, ServiceUnavailable("The lease store closed"))
            await pool.close(timeout=self._timeout)

    # -- the interface ---------------------------------------------------------------------

    async def apply(self, command: Command) -> Decision:
        """Queue ``command`` for the next batch; see ``_decide_batch``.

        Up to ``max_batches`` batches run at once, each on its own connection and
        each taking every queued command (at most ``max_batch``): under load one
        transaction, two round trips and one commit serve many requests.
        """
        if self._pool is None:
            raise ServiceUnavailable("The lease store is not open")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Decision] = loop.create_future()
        self._waiting.append(_Pending(command, future))
        if self._batches < self._max_batches:
            self._batches += 1
            task = loop.create_task(self._run_batches())
            self._tasks.add(task)
            task.add_done_callback(self._settled)
        self._deadlines.watch(future)
        return await future

    async def purge(self, limit: int, after: bytes | None = None) -> Purged:
        """Deletes up to ``limit`` finished records, those that ended first (see
        ``_PURGE_AT_DB_NOW``); the walk is over when fewer than ``limit`` were left."""

        async def run(conn: Connection, attempt: _Attempt[int]) -> int:
            # One statement in autocommit: its own transaction, safe to repeat.
            if self._clock is None:
                cursor = await conn.execute(_PURGE_AT_DB_NOW, (limit,))
            else:
                cursor = await conn.execute(_PURGE_AT, (self._clock.now_ms(), limit))
            return max(cursor.rowcount, 0)

        deleted = await self._run("purge", run)
        return Purged(deleted, b"" if deleted >= limit else None)

    @property
    def where(self) -> str:
        """Where the store is, for messages (never the URL, which may hold a password)."""
        return "in that PostgreSQL database and schema (check the URL's search_path)"

    async def damage(self) -> str | None:
        """None: PostgreSQL checks its own pages; there is no file here to check."""
        return None

    async def exists(self) -> bool:
        """Whether leasekeeper's tables are in the store's schema already, on a connection
        of its own and without creating anything: for the operator commands that must
        not make a new, empty store (``leasekeeper fence``) when the URL names another
        schema or database than the one the servers use."""
        try:
            async with await psycopg.AsyncConnection.connect(self._conninfo) as conn:
                found = await conn.execute(_STORE_EXISTS)
                row = await found.fetchone()
        except psycopg.Error as exc:
            log.warning("PostgreSQL store: looking for the store failed: %s", _describe(exc))
            raise ServiceUnavailable("The lease store cannot be reached") from None
        return row is not None and bool(row[0])

    async def ping(self) -> None:
        """Whether requests can be served: the table can be read (a blocked table reads
        as "cannot serve"), and written (``_CAN_WRITE``), else ``ServiceUnavailable``."""

        self._refusals.check()

        async def run(conn: Connection, attempt: _Attempt[None]) -> None:
            await conn.execute(_PING)
            found = await conn.execute(_CAN_WRITE)
            writable, sequence = await found.fetchone() or (False, False)
            if not writable:
                raise ServiceUnavailable("The PostgreSQL database is read-only")
            if not sequence:
                raise ServiceUnavailable("The PostgreSQL fencing sequence is missing")

        await self._run("ping", run)

    async def raise_fence(self, at_least: int) -> int:
        """One transaction that holds the sequence's lock (``_LOCK_FENCE``) from the read
        to the COMMIT; safe to repeat, so a retried attempt changes nothing more."""

        async def run(conn: Connection, attempt: _Attempt[int]) -> int:
            async with conn.transaction():
                # prepare=False: DDL cannot be prepared, and these run once.
                await conn.execute(_LOCK_FENCE, prepare=False)
                current = _first_int(
                    await (await conn.execute(_READ_FENCE, prepare=False)).fetchone()
                )
                if at_least > current:
                    await conn.execute(_SET_FENCE, (at_least,), prepare=False)
                    current = at_least
            return current

        return await self._run("raise_fence", run)

    async def count_live(self) -> int:
        """Leases held at the store's now (the ``leasekeeper_live_leases`` gauge).

        One read-only statement on a pooled connection: a scan of the table, so read
        it every few seconds at most. It holds no lock a decision waits for.
        """

        async def run(conn: Connection, attempt: _Attempt[int]) -> int:
            # prepare=False: planned on the table as it is now (see _decide_batch).
            if self._clock is None:
                cursor = await conn.execute(_COUNT_LIVE_AT_DB_NOW, prepare=False)
            else:
                cursor = await conn.execute(_COUNT_LIVE_AT, (self._clock.now_ms(),), prepare=False)
            return _first_int(await cursor.fetchone())

        return await self._run("count_live", run)

    # -- batches of decisions --------------------------------------------------------------

    async def _run_batches(self) -> None:
        """Take queued commands in batches and decide them, until the queue is empty."""
        waiting = self._waiting
        try:
            while waiting:
                batch: list[_Pending] = []
                while waiting and len(batch) < self._max_batch:
                    pending = waiting.popleft()
                    if not pending.future.done():  # else its caller gave up
                        batch.append(pending)
                if batch:
                    await self._decide_and_answer(batch)
        finally:
            self._batches -= 1

    async def _decide_and_answer(self, batch: list[_Pending]) -> None:
        async def work(conn: Connection, attempt: _Attempt[_Batch]) -> _Batch:
            return await self._decide_batch(conn, batch, attempt)

        try:
            done = await self._run("apply", work)
        except BaseException as exc:
            error: LeaseError
            if isinstance(exc, ServiceUnavailable):
                error = exc
            elif isinstance(exc, asyncio.CancelledError):  # close() cancels the batches
                error = ServiceUnavailable("The lease store is closing")
            else:
                log.error("PostgreSQL store: a batch failed", exc_info=exc)
                error = InternalError()
            for pending in batch:
                settle(pending.future, error)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for pending, outcome in done.results:
            settle(pending.future, outcome)
        for pending in reversed(done.again):
            pending.returned += 1
            if pending.returned >= _MAX_ATTEMPTS:
                settle(pending.future, ServiceUnavailable("The lease store is too busy"))
            else:
                self._waiting.appendleft(pending)

    async def _decide_batch(
        self, conn: Connection, batch: list[_Pending], attempt: _Attempt[_Batch]
    ) -> _Batch:
        """Decide ``batch`` in one transaction of two round trips, three when it grants::

            1:  BEGIN; SELECT … FOR UPDATE (the batch's rows, in key order);
                SELECT clock_timestamp(), txid_current_if_assigned()
                    ── decide_with_fence for each command in turn, in Python ──
           (2:  SELECT nextval(fence), once per new owner; decide again with them)
            3:  UPDATE the changed rows; INSERT the new ones … ON CONFLICT DO NOTHING;
                COMMIT                                    (synchronous_commit=on)

        Each command is decided on the records as the commands before it left them,
        exactly as if they had run one at a time. The clock is read after the row locks
        are held, and so are the fences, one per new owner, so the counter moves by
        grants only, as on every other store. A key without a row has nothing to lock: when
        another transaction creates its row first, nothing of that key is written, and
        its commands go back to the queue to be decided against that row.
        """
        keys = sorted({pending.command.key_id for pending in batch})
        clock = self._clock
        async with conn.pipeline():
            await conn.execute(_BEGIN)
            # prepare=False: planned for each batch, on the table as it is now. A prepared
            # statement keeps a generic plan chosen while the table was small (a scan),
            # and ran at a tenth of the speed once it held tens of thousands of rows.
            locked = await conn.execute(_LOCK_ROWS, (keys,), prepare=False)
            timed = await conn.execute(_READ_CLOCK_AND_TXID)
            rows = await locked.fetchall()  # sends the statements: round trip 1
            row = await timed.fetchone()
            if clock is None:
                now_ms = _first_int(row)
            else:
                now_ms = clock.now_ms()
            attempt.txid = None if row is None or row[1] is None else int(row[1])
            # A caller whose deadline passed while its batch waited (for a runner, a
            # connection or these row locks) has been told 503 already: nothing is
            # decided for it, or a lease could be granted whose token nobody holds,
            # and the key would answer "held" for its whole ttl.
            batch = [pending for pending in batch if not pending.future.done()]
            if not batch:
                await conn.execute("ROLLBACK")
                return _Batch([], [])
            found = {bytes(row[0]): LeaseRecord(bytes(row[0]), *row[1:]) for row in rows}
            # The rules say which commands grant a new owner; fences are drawn for
            # exactly those, and the batch is decided again with them (the rules are
            # pure: the same records and time give the same decisions).
            commands = [pending.command for pending in batch]
            at_now = itertools.repeat(now_ms).__next__
            placeholders = itertools.count(1)
            outcomes, writes = decide_in_turn(commands, found, at_now, placeholders.__next__)
            grants = next(placeholders) - 1
            if grants:
                drawn = await conn.execute(_NEXT_FENCES, (grants,))
                fences = sorted(int(row[0]) for row in await drawn.fetchall())  # round trip 2
                outcomes, writes = decide_in_turn(commands, found, at_now, iter(fences).__next__)
            results = list(zip(batch, outcomes, strict=True))
            existing = set(found)
            updates = [w for key, w in writes.items() if key in existing]
            inserts = [w for key, w in writes.items() if key not in existing]
            if updates:
                await conn.execute(_UPDATE_MANY, _columns(updates), prepare=False)
            inserted = (
                await conn.execute(_INSERT_MANY, _columns(inserts), prepare=False)
                if inserts
                else None
            )
            # Marked before the COMMIT is handed over: in pipeline mode the call itself
            # may send it (when the batch's statements fill libpq's output buffer) and
            # then read a broken connection's error. A COMMIT that may have been sent
            # is looked for (_landed), never decided again as if it had not been.
            attempt.committing, attempt.written = True, list(writes.values())
            attempt.updated = {w.key_id for w in updates}
            attempt.resolve = functools.partial(_split, results, set(writes))
            await conn.execute("COMMIT")
        # Leaving the pipeline sent the writes and COMMIT and waited for them.
        if inserted is not None and inserted.rowcount != len(inserts):
            created = {bytes(row[0]) for row in await inserted.fetchall()}
            return _split(results, set(writes), set(existing) | created)
        return _Batch(results, [])

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
            self._failures.log(
                "PostgreSQL store: %s did not finish within %.1f s", what, self._timeout
            )
            raise ServiceUnavailable("The lease store did not answer in time") from None
        except psycopg.Error as exc:
            self._failures.log("PostgreSQL store: %s failed: %s", what, _describe(exc))
            self._note_refusal(exc)
            raise ServiceUnavailable(_unavailable(exc)) from exc
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
            except _TRANSIENT as exc:
                if last:
                    raise
                log.info("PostgreSQL store: retrying after %s", type(exc).__name__)
                # Jittered backoff, so the transactions that collided do not collide again.
                await asyncio.sleep(random.uniform(0.001, 0.005 * number))
            except psycopg.OperationalError as exc:
                broken = conn is not None and conn.broken
                if self._note_refusal(exc) and not broken and _severity(exc) == "ERROR":
                    # The database answered with an ERROR (a full disk is 53100): the
                    # transaction did not commit, and another attempt would meet the same
                    # refusal. (A PANIC, as on a failed WAL flush, may have committed
                    # first: that goes on to _landed.)
                    raise
                if broken:
                    self._check_pool(pool)
                if attempt.committing and attempt.resolve is not None:
                    # The COMMIT was sent and its answer lost: look for its effect.
                    landed = await self._landed(pool, attempt, deadline)
                    return attempt.resolve(landed)
                if broken and not attempt.committing:
                    # Dead before COMMIT was sent: the server rolls that transaction
                    # back, so running it again on another connection is safe.
                    log.info("PostgreSQL store: a pooled connection was dead; trying another")
                else:
                    raise
                if last:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _note_refusal(self, exc: psycopg.Error) -> bool:
        """Whether ``exc`` says the database cannot take writes at all, not that one
        request failed (``_REFUSING``); if so, readiness fails for a while (``Refusals``)."""
        if not (exc.sqlstate or "").startswith(_REFUSING):
            return False
        self._refusals.refused(f"{type(exc).__name__}, SQLSTATE {exc.sqlstate}")
        return True

    async def _landed(
        self, pool: AsyncConnectionPool[Connection], attempt: _Attempt[Any], deadline: float
    ) -> set[bytes]:
        """The key ids whose record, written by a batch whose COMMIT was cut off, took effect.

        The rows are read with ``FOR UPDATE``, which waits for a transaction still
        holding them to finish; then the transaction's status is asked for
        (``txid_status``). A row that equals the written record took effect (its owner
        digest and decision time make it unique), unless the transaction aborted. A
        committed transaction's release also took effect when a new owner has taken the
        key since (``_ended_and_since``): it is answered released, not lost. Without a
        status (no row existed to give the transaction an id, it is still in progress,
        or its id is unknown to a standby promoted since) only equal rows count.
        Commands on the keys not found are decided again, against whatever their row
        holds now; that is safe, and at worst conservative. Commands whose key was not
        written hold either way. A first write to a new key
        is the one case where the lock cannot be waited for; the new decision then
        meets that row through ``INSERT … ON CONFLICT`` and decides against it, so
        nothing is granted twice.
        """
        written = attempt.written
        if not written:
            return set()
        wanted = {w.key_id: w for w in written}
        loop = asyncio.get_running_loop()
        for number in range(1, _MAX_ATTEMPTS + 1):
            conn: Connection | None = None
            try:
                async with pool.connection(timeout=max(0.0, deadline - loop.time())) as conn:
                    cursor = await conn.execute(_LOCK_ROWS, (sorted(wanted),))
                    rows = await cursor.fetchall()
                    status = None
                    if attempt.txid is not None:
                        try:
                            asked = await conn.execute(_TXID_STATUS, (attempt.txid,))
                            found = await asked.fetchone()
                            status = None if found is None else found[0]
                        except psycopg.DataError as exc:
                            # "transaction ID … is in the future": a standby promoted
                            # since, whose ids are behind. No status: rows decide alone.
                            log.warning(
                                "PostgreSQL store: the database does not know a transaction "
                                "it ran (%s): a standby promoted since? Raise the fencing "
                                "counter (leasekeeper fence --raise-to)",
                                _describe(exc),
                            )
                            status = None
            except psycopg.OperationalError:
                if conn is None or not conn.broken or number == _MAX_ATTEMPTS:
                    raise
                continue  # another dead pooled connection: the read is safe to repeat
            current = {bytes(row[0]): LeaseRecord(bytes(row[0]), *row[1:]) for row in rows}
            if status == "aborted":
                landed: set[bytes] = set()
            else:
                landed = {key for key, record in current.items() if record == wanted.get(key)}
                if status == "committed":
                    landed |= {
                        key for key in attempt.updated if _ended_and_since(wanted[key], current)
                    }
            if len(landed) == len(wanted):
                log.info("PostgreSQL store: a cut-off COMMIT had taken effect")
            elif not landed:
                log.info("PostgreSQL store: a cut-off COMMIT had not taken effect; deciding again")
            else:
                log.info(
                    "PostgreSQL store: a cut-off COMMIT had taken effect for %d of %d keys; "
                    "deciding the others again",
                    len(landed),
                    len(wanted),
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
        new_in = None
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
            sequence = await conn.execute(_FENCE_EXISTS)
            sequence_was_missing = await sequence.fetchone() == (False,)
            for statement in _DDL:
                await conn.execute(statement)
            if sequence_was_missing:
                await self._restart_fence_above_the_table(conn)
            created = await conn.execute(
                "INSERT INTO leasekeeper_meta (name, value) VALUES ('schema_version', %s) "
                "ON CONFLICT (name) DO NOTHING RETURNING current_schema()",
                (SCHEMA_VERSION,),
            )
            new_in = await created.fetchone()
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
        if new_in is not None:  # committed: said only of a store that now exists
            log.info("created a new, empty store in the schema %s", new_in[0])

    @staticmethod
    async def _restart_fence_above_the_table(conn: Connection) -> None:
        """The fencing sequence was just created (inside the migration's transaction, so
        no one draws from it yet) beside a table that may hold records already (the
        sequence was dropped, or left out of a restore): start it above the highest
        token stored, never at 1 below tokens already handed out."""
        found = await conn.execute("SELECT max(fencing_token), count(*) FROM leasekeeper_leases")
        row = await found.fetchone()
        if row is None or row[0] is None:
            return
        highest, records = int(row[0]), int(row[1])
        await conn.execute(_SET_FENCE, (highest,))
        log.warning(
            "the fencing sequence was missing beside %d stored records; it was created to "
            "continue above the highest of their tokens (%d). If higher tokens were handed "
            "out before (a restore from a backup), raise it with `leasekeeper fence`",
            records,
            highest,
        )


#: SQLSTATEs that say the database cannot take writes at all, not that one request
#: failed: a full disk, no memory, an I/O error, damaged data or indexes. (Not the rest
#: of class 53: 53400 is also one query's own limit, temp_file_limit say.)
_REFUSING = ("53100", "53200", "58030", "XX001", "XX002")


def _severity(exc: psycopg.Error) -> str | None:
    """The error's severity as the server sent it (``ERROR``, ``FATAL``, ``PANIC``), not
    translated; None for an error that did not come from the server."""
    return exc.diag.severity_nonlocalized


def _unavailable(exc: psycopg.Error) -> str:
    """What a 503 says for ``exc``: whether the connection, the time or the database
    failed the request (never the database's own words)."""
    state = exc.sqlstate or ""
    if isinstance(exc, pg_errors.QueryCanceled):  # statement_timeout
        return "The lease store did not answer in time"
    if not state or state.startswith(("08", "57P")):  # the connection, or a shutdown
        return "The lease store cannot be reached; retry shortly"
    return "The lease store refused the request; retry shortly"


def _elapsed_ms() -> int:
    """Milliseconds of elapsed time: what paces log lines when no clock is injected
    (the database server's clock decides everything else)."""
    return elapsed_ns() // 1_000_000


#: libpq's refusal of a query parameter it does not know: the name is no secret.
_UNKNOWN_PARAMETER = re.compile(r'invalid URI query parameter: "([A-Za-z0-9_]{1,64})"')


def _check_userinfo(url: str) -> None:
    """``ValueError`` for a URL whose password (or user) holds ``@``, ``/`` or ``#``
    unencoded: libpq would split it elsewhere than meant (``user:a@b@host``: password
    ``a``, host ``b@host``), and a part of the password would be taken for the host,
    the port, the database or a query parameter, and logged with every failed
    connection or repeated in a refusal. The message does not repeat the URL.

    Read as libpq reads it: the user and password run up to the first ``@`` before
    any ``/``, a ``?`` included (``user:a?b@c@host`` is password ``a?b`` and host
    ``c@host``; ``user:a?b@c/d@host``, host ``c``); after them, an ``@`` before the
    query is in the host or the database. With no ``@`` before the first ``/``, libpq
    sees no user or password: an ``@`` after that ``/``, in the database or after a
    ``?`` that came before it (``user:a?b=1/c@host``: host ``user``, port ``a``, a
    parameter ``b``), is a password's."""
    rest = url.partition("://")[2]
    before_path = rest.partition("/")[0]
    if "@" in before_path:
        userinfo, _, after = rest.partition("@")
        split = "@" in after.partition("?")[0] or "#" in userinfo
    else:
        after_slash = rest[len(before_path) + 1 :]
        split = "@" in rest.partition("?")[0] or ("?" in before_path and "@" in after_slash)
    if split:
        raise ValueError(
            "the user name or password holds @, / or # as it is; "
            "percent-encode them (%40, %2F, %23)"
        )


def _conninfo(url: str, timeout: float, schema: str | None, application_name: str | None) -> str:
    """The connection string: the URL's parameters, with the store's session settings.

    Session settings travel in the startup packet (``options``), so they cost no
    round trip and no connection can run without them, and they win over the role's
    and the database's (``ALTER ROLE ... SET``). ``synchronous_commit=on`` comes last
    so that nothing in the URL can turn it off; the timeouts come first so that the
    URL can override them (``lock_timeout=0``: a batch waits for a row lock another
    instance's batch holds, within ``statement_timeout``, rather than fail at a role's
    short one). The client encoding is UTF-8 whatever the URL, the role or
    ``PGCLIENTENCODING`` say: results are stored and read back as UTF-8 text.
    """
    _check_userinfo(url)
    try:
        params: dict[str, Any] = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        # The URL may hold a password: never repeat it, nor libpq's words about it, but
        # the name of a query parameter libpq does not know (``?schema=``, say).
        unknown = _UNKNOWN_PARAMETER.match(str(exc))
        if unknown:
            raise ValueError(
                f"malformed PostgreSQL URL: libpq knows no parameter {unknown[1]!r} "
                "(a schema is chosen with ?options=-csearch_path%3Dname)"
            ) from None
        raise ValueError("malformed PostgreSQL URL") from None
    ms = math.ceil(timeout * 1000)
    ours = [
        f"-c statement_timeout={ms}",
        # A session frozen inside a transaction must not hold a key's row lock for long.
        f"-c idle_in_transaction_session_timeout={max(2 * ms, 5000)}",
        "-c lock_timeout=0",
    ]
    given = params.get("options")
    if given:
        ours.append(str(given))
    ours.append("-c synchronous_commit=on")
    if schema is not None:
        ours.append(f"-c search_path={schema}")
    params["options"] = " ".join(ours)
    params["client_encoding"] = "UTF8"
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


def _option_value(value: str) -> str:
    """``value`` as one word of libpq's ``options``, which splits on whitespace and
    takes a backslash as an escape."""
    return re.sub(r"([\\\s])", r"\\\1", value)


async def _end_transaction(conn: Connection) -> None:
    """Roll back whatever the failed attempt left open, if the connection still works."""
    if conn.broken or conn.closed:
        return
    # On failure the pool discards or resets the connection when it comes back.
    with contextlib.suppress(psycopg.Error):
        await conn.rollback()


def _columns(records: list[LeaseRecord]) -> tuple[list[Any], ...]:
    """``records`` as the nine column arrays that ``_UNNEST`` reads."""
    return (
        [r.key_id for r in records],
        [r.fingerprint for r in records],
        [r.absolute_expires_ms for r in records],
        [r.fencing_token for r in records],
        [r.owner for r in records],
        [r.lease_expires_ms for r in records],
        [r.completed_ms for r in records],
        [r.result for r in records],
        [r.updated_ms for r in records],
    )


def _split(
    results: list[tuple[_Pending, Decision | LeaseError]],
    written: set[bytes],
    landed: set[bytes],
) -> _Batch:
    """Answer the commands whose key was not written, or was written and is found
    (``landed``); give the others back to be decided again."""
    answered, again = [], []
    for pending, outcome in results:
        key = pending.command.key_id
        if key in written and key not in landed:
            again.append(pending)
        else:
            answered.append((pending, outcome))
    return _Batch(answered, again)


def _ended_and_since(written: LeaseRecord, current: dict[bytes, LeaseRecord]) -> bool:
    """Whether ``written``, a release (its owner ended, nothing stored), has since been
    followed by a new owner: its row now holds a higher fence.

    Only for a transaction known to have committed (``txid_status``), and only for a
    release: were that status wrong (a transaction id used again after a failover to an
    asynchronous standby), answering a release as done tells its caller only that it no
    longer owns the key, which a new owner proves anyway; a complete answered as done
    would claim a result stored that is not."""
    now = current.get(written.key_id)
    return (
        written.owner is None
        and written.completed_ms is None
        and now is not None
        and now.fencing_token > written.fencing_token
    )


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
