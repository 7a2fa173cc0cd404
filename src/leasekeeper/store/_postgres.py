"""The PostgreSQL store: several service instances, one truth.

Every instance shares the tables, the fencing sequence and the database server's
clock, so instance clocks do not matter. ``apply`` calls are decided in batches, each
one READ COMMITTED transaction on a pooled connection (``_decide_batch``).

Two instances deciding on one key serialize on the row lock; locks are taken in key
order, so batches sharing keys queue rather than deadlock. A key without a row has
nothing to lock, so its first write is ``INSERT … ON CONFLICT DO NOTHING``: when
another transaction created the row first, nothing of that key is written and its
commands are decided again against that row. Nothing else is ever written without
the row lock, so there is no read-then-write race between instances.

Failures are retried or translated in one place, ``_postgres_run``; the pool replaces
dead connections by itself, so the store recovers when the database is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from leasekeeper._clock import Clock, elapsed_ns
from leasekeeper._core.model import (
    Command,
    Complete,
    CompletedOutcome,
    Decision,
    Release,
    Released,
)
from leasekeeper._errors import LeaseError, OutcomeUnknown, ServiceUnavailable
from leasekeeper.store import _postgres_sql as sql
from leasekeeper.store._base import Purged, Refusals, Throttled, decide_in_turn
from leasekeeper.store._batcher import Batcher, Request, earliest
from leasekeeper.store._postgres_run import MAX_ATTEMPTS, Attempt, Run, Runner, Work, describe
from leasekeeper.store._postgres_sql import SCHEMA_VERSION, Connection

__all__ = ["DEFAULT_POOL_SIZE", "SCHEMA_VERSION", "PostgresStore"]

log = logging.getLogger("leasekeeper.store.postgres")

T = TypeVar("T")

#: Connections a store opens at most, unless told otherwise (``max_size``).
DEFAULT_POOL_SIZE: Final = 10

_Results = list[tuple[Request[Command], Decision | LeaseError]]


@dataclass(slots=True)
class _Batch:
    """A committed batch: each command's decision (or error), and the commands to run again."""

    results: _Results
    again: list[Request[Command]]


class PostgresStore:
    """Records in PostgreSQL (``postgresql://user@host/db``), shared by many instances.

    ``clock`` replaces the database clock (tests). ``timeout_seconds`` bounds every call:
    waiting for a connection, connecting, each statement, and the call as a whole. The
    tables go in ``schema`` (created if need be), else in the first existing schema of
    the ``search_path``, pinned while the store is open (``_postgres_sql.pinned``).

    The pool holds ``min_size`` to ``max_size`` connections. Up to ``max_batch`` commands
    are decided in one transaction, and up to ``max_batches`` transactions run at once,
    never more than ``max_size``. No call holds a connection while waiting for another, so
    even a pool of one serves everything, in turn.
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
        if schema is not None and not sql.SCHEMA_NAME.match(schema):
            raise ValueError("schema must be a lower-case identifier (a-z, 0-9, underscore)")
        self.schema = schema
        self._clock = clock
        #: Failed calls: when the database is down or read-only, every batch fails.
        paced = clock.now_ms if clock is not None else _elapsed_ms
        self._failures = Throttled(log, logging.WARNING, paced)
        self._refusals = Refusals(paced)
        self._timeout = timeout_seconds
        self._given_conninfo = sql.conninfo(url, timeout_seconds, schema, application_name)
        #: What the pool connects with: the given one, with the schema pinned once open.
        self._conninfo = self._given_conninfo
        self._min_size = min(min_size, max_size)
        self._max_size = max_size
        self._pool: AsyncConnectionPool[Connection] | None = None
        self._open_lock = asyncio.Lock()
        self._runner = Runner(timeout_seconds, self._failures, self._refusals)
        self._max_batches = max(1, min(max_batches, max_size))
        self._batcher: Batcher[Command] = Batcher(
            self._decide_and_answer,
            timeout_seconds=timeout_seconds,
            max_batch=max_batch,
            log=log,
            runners=self._max_batches,
        )
        self._on_change: Callable[[bytes | None], None] | None = None
        self._listener: asyncio.Task[None] | None = None

    #: How often a waiting acquire asks again without a notification (``ChangeFeed``).
    recheck_seconds: Final = 2.0

    def on_change(self, callback: Callable[[bytes | None], None]) -> None:
        """Call ``callback`` on the releases and completions of every instance: they
        NOTIFY in the transaction that writes them, and each instance LISTENs on a
        connection of its own (``_listen``)."""
        self._on_change = callback

    async def _listen(
        self, callback: Callable[[bytes | None], None], listening: asyncio.Event
    ) -> None:
        """LISTEN for changes on a connection of its own, for as long as the store is
        open (``listening`` is set once it does); reconnected with backoff when it
        fails, and then ``callback(None)``: what was committed meanwhile went unheard."""
        pause = 0.1
        again = False  # the first LISTEN comes as the store opens: nothing to have missed
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True)
                try:
                    await conn.execute(sql.LISTEN)
                    if again:
                        callback(None)
                    again = True
                    listening.set()
                    pause = 0.1
                    async for note in conn.notifies():
                        try:
                            key_id = bytes.fromhex(note.payload)
                        except ValueError:  # not ours: the channel is shared by name
                            continue
                        callback(key_id)
                finally:
                    await conn.close()
            except psycopg.Error as exc:
                self._failures.log("listening for changes failed: %s", describe(exc))
            await asyncio.sleep(pause)
            pause = min(pause * 2, self.recheck_seconds)

    async def open(self) -> None:
        async with self._open_lock:
            if self._pool is not None:
                return
            pool: AsyncConnectionPool[Connection] | None = None
            try:
                pool = await self._new_pool(self._given_conninfo)
                if self.schema is None:  # look the schema up, then pin it
                    async with asyncio.timeout(self._timeout), pool.connection() as conn:
                        row = await (await conn.execute(sql.WHERE_THE_STORE_IS)).fetchone()
                        current, holding = row if row is not None else (None, [])
                        self._conninfo = sql.pinned(self._given_conninfo, current, holding)
                    await pool.close()
                    pool = None
                    pool = await self._new_pool(self._conninfo)
                async with asyncio.timeout(self._timeout * 2), pool.connection() as conn:
                    await sql.migrate(conn, self.schema)
                if self._on_change is not None:
                    listening = asyncio.Event()
                    self._listener = asyncio.create_task(self._listen(self._on_change, listening))
                    # Open once changes are heard; failing that, the waiters' re-checks
                    # cover until the listener connects.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._timeout):
                            await listening.wait()
            except BaseException as exc:
                if pool is not None:
                    await pool.close()
                if isinstance(exc, pg_errors.InvalidSchemaName):
                    reason = "the search_path names no existing schema to create the tables in"
                elif isinstance(exc, PoolTimeout):  # the pool says only that it gave up
                    reason = await self._why_no_connection() or describe(exc)
                elif isinstance(exc, psycopg.Error | TimeoutError):
                    reason = describe(exc) if isinstance(exc, psycopg.Error) else "timed out"
                else:
                    raise
                raise ServiceUnavailable(f"Cannot open the PostgreSQL store: {reason}") from exc
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
            # this long, then on demand: recovery after a long outage takes seconds.
            reconnect_timeout=max(10.0, 2 * self._timeout),
        )
        try:
            await pool.open(wait=True, timeout=self._timeout)
        except BaseException:
            await pool.close()
            raise
        return pool

    async def _why_no_connection(self) -> str | None:
        """Why a connection cannot be made (libpq's reason: refused, no such database or
        role, authentication failed), from one attempt of its own; None if it can."""
        try:
            async with asyncio.timeout(self._timeout):
                conn = await psycopg.AsyncConnection.connect(self._conninfo)
                await conn.close()
        except psycopg.Error as exc:
            return describe(exc)
        except TimeoutError:
            return "connecting timed out"
        return None

    async def close(self) -> None:
        async with self._open_lock:
            pool, self._pool = self._pool, None
            if pool is None:
                return
            listener, self._listener = self._listener, None
            if listener is not None:
                listener.cancel()
            tasks = [*self._runner.tasks, *self._batcher.tasks]
            if listener is not None:
                tasks.append(listener)
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=self._timeout)
            # Queued, never taken by a batch: answered now.
            self._batcher.refuse_all(ServiceUnavailable("The lease store closed"))
            await pool.close(timeout=self._timeout)

    async def apply(self, command: Command) -> Decision:
        """Queue ``command`` for the next batch (``_decide_batch``)."""
        if self._pool is None:
            raise ServiceUnavailable("The lease store is not open")
        decision: Decision = await self._batcher.submit(command)
        return decision

    async def purge(self, limit: int, after: bytes | None = None) -> Purged:
        """Deletes up to ``limit`` finished records, those that ended first (see
        ``PURGE_AT_DB_NOW``); the walk is over when fewer than ``limit`` were left."""

        async def run(conn: Connection, attempt: Attempt[int]) -> int:
            # One statement in autocommit: its own transaction, safe to repeat.
            if self._clock is None:
                cursor = await conn.execute(sql.PURGE_AT_DB_NOW, (limit,))
            else:
                cursor = await conn.execute(sql.PURGE_AT, (self._clock.now_ms(), limit))
            return max(cursor.rowcount, 0)

        deleted = await self._run("purge", run)
        return Purged(deleted, b"" if deleted >= limit else None)

    @property
    def where(self) -> str:
        """Where the store is, for messages (never the URL, which may hold a password)."""
        return "in that PostgreSQL database and schema (check the URL's search_path)"

    @property
    def described(self) -> str:
        """The database, host and port, libpq's defaults (its environment included) for
        what the URL leaves out; never the user or the password."""
        given = conninfo_to_dict(self._given_conninfo)
        defaults = {
            option.keyword.decode(): option.val.decode()
            for option in psycopg.pq.Conninfo.get_defaults()
            if option.val is not None
        }

        def value(name: str, otherwise: str) -> str:
            return str(given.get(name) or defaults.get(name) or otherwise)

        database = value("dbname", "(the user's name)")
        host = value("host", "the local socket")
        return f"PostgreSQL database {database} on {host} port {value('port', '5432')}"

    async def damage(self) -> str | None:
        """None: PostgreSQL checks its own pages; there is no file here to check."""
        return None

    async def exists(self) -> bool:
        """Whether leasekeeper's tables are in the store's schema, read on a connection of
        its own without creating anything (``leasekeeper fence`` must make no new store
        when the URL names another schema or database than the servers')."""
        try:
            async with await psycopg.AsyncConnection.connect(self._conninfo) as conn:
                row = await (await conn.execute(sql.STORE_EXISTS)).fetchone()
        except psycopg.Error as exc:
            log.warning("PostgreSQL store: looking for the store failed: %s", describe(exc))
            raise ServiceUnavailable("The lease store cannot be reached") from None
        return row is not None and bool(row[0])

    async def ping(self) -> None:
        """Whether calls can be served: the table can be read (a blocked table reads as
        "cannot serve"), and written (``CAN_WRITE``), and the tables, their columns, the
        schema version and the fencing counter are as this leasekeeper makes them (a
        decision could be made), else ``ServiceUnavailable``."""
        self._refusals.check()

        async def run(conn: Connection, attempt: Attempt[None]) -> None:
            await conn.execute(sql.PING)
            found = await conn.execute(sql.CAN_WRITE)
            writable, sequence = await found.fetchone() or (False, False)
            if not writable:
                raise ServiceUnavailable("The PostgreSQL database is read-only")
            if not sequence:
                raise ServiceUnavailable("The PostgreSQL fencing sequence is missing")
            problem = await sql.schema_problem(conn)
            if problem is not None:
                raise ServiceUnavailable(f"The lease store cannot decide: {problem}")

        await self._run("ping", run)

    async def raise_fence(self, at_least: int) -> int:
        """One transaction that holds the sequence's lock (``LOCK_FENCE``) from the read
        to the COMMIT; safe to repeat, so a retried attempt changes nothing more."""

        async def run(conn: Connection, attempt: Attempt[int]) -> int:
            async with conn.transaction():
                # prepare=False: DDL cannot be prepared, and these run once.
                await conn.execute(sql.LOCK_FENCE, prepare=False)
                found = await conn.execute(sql.READ_FENCE, prepare=False)
                current = sql.first_int(await found.fetchone())
                if at_least > current:
                    await conn.execute(sql.SET_FENCE, (at_least,), prepare=False)
                    current = at_least
            return current

        return await self._run("raise_fence", run)

    async def count_live(self) -> int:
        """Leases held at the store's now: one read-only statement that holds no lock a
        decision waits for, but a scan, so read it every few seconds at most."""

        async def run(conn: Connection, attempt: Attempt[int]) -> int:
            # prepare=False: planned on the table as it is now (see _decide_batch).
            if self._clock is None:
                cursor = await conn.execute(sql.COUNT_LIVE_AT_DB_NOW, prepare=False)
            else:
                now = self._clock.now_ms()
                cursor = await conn.execute(sql.COUNT_LIVE_AT, (now,), prepare=False)
            return sql.first_int(await cursor.fetchone())

        return await self._run("count_live", run)

    async def _decide_and_answer(self, batch: list[Request[Command]]) -> None:
        """Decide ``batch`` (the batcher's ``run``) by its earliest deadline, answer it,
        and give back what must be decided again. Given up on at that deadline (nothing
        was written), the calls with time left are given back too, the rest get 503;
        any other failure of the whole batch, which wrote nothing, is raised to the
        batcher. Cancelled (the store closing) while its COMMIT may be on its way, the
        calls it wrote for are answered "outcome unknown"."""

        async def work(conn: Connection, attempt: Attempt[_Batch]) -> _Batch:
            return await self._decide_batch(conn, batch, attempt)

        run = Run(earliest(batch))
        try:
            done = await self._run("apply", work, run)
        except ServiceUnavailable:
            if not run.abandoned:
                raise
            self._batcher.retry(batch, MAX_ATTEMPTS)
            return
        except asyncio.CancelledError:
            attempt = run.attempt
            if attempt is not None and attempt.committing and attempt.resolve is not None:
                self._batcher.answer(attempt.resolve(None).results)
            raise
        self._batcher.answer(done.results)
        self._batcher.retry(done.again, MAX_ATTEMPTS)

    async def _decide_batch(
        self, conn: Connection, batch: list[Request[Command]], attempt: Attempt[_Batch]
    ) -> _Batch:
        """Decide ``batch`` in one transaction of two round trips, three when it grants::

            1:  BEGIN; SELECT … FOR UPDATE (the batch's rows, in key order);
                SELECT clock_timestamp(), txid_current_if_assigned()
                    ── decide_with_fence for each command in turn, in Python ──
           (2:  SELECT nextval(fence), once per new owner; decide again with them)
            3:  UPDATE the changed rows; INSERT the new ones … ON CONFLICT DO NOTHING;
                COMMIT                                    (synchronous_commit=on)

        The clock and the fences are read after the row locks are held, so a decision
        never runs at a time from before it waited for its key, and the counter moves
        by grants only. A command whose key's row another transaction created first goes
        back to the queue (``_split``).
        """
        keys = sorted({request.item.key_id for request in batch})
        clock = self._clock
        async with conn.pipeline():
            await conn.execute(sql.BEGIN)
            # prepare=False: planned for each batch, on the table as it is now. A prepared
            # statement keeps a generic plan chosen while the table was small (a scan).
            locked = await conn.execute(sql.LOCK_ROWS, (keys,), prepare=False)
            timed = await conn.execute(sql.READ_CLOCK_AND_TXID)
            rows = await locked.fetchall()  # sends the statements: round trip 1
            row = await timed.fetchone()
            now_ms = sql.first_int(row) if clock is None else clock.now_ms()
            attempt.txid = None if row is None or row[1] is None else int(row[1])
            # A caller whose deadline passed while its batch waited (for a runner, a
            # connection or these row locks) has been told 503 already: nothing is
            # decided for it, or a lease could be granted whose token nobody holds.
            batch = [request for request in batch if not request.future.done()]
            if not batch:
                await conn.execute("ROLLBACK")
                return _Batch([], [])
            found = sql.records(rows)
            # Fences are drawn for exactly the commands the rules grant, and the batch is
            # decided again with them (the rules are pure: same records, same decisions).
            commands = [request.item for request in batch]
            at_now = itertools.repeat(now_ms).__next__
            placeholders = itertools.count(1)
            outcomes, writes = decide_in_turn(commands, found, at_now, placeholders.__next__)
            grants = next(placeholders) - 1
            if grants:
                drawn = await conn.execute(sql.NEXT_FENCES, (grants,))
                fences = sorted(int(row[0]) for row in await drawn.fetchall())  # round trip 2
                outcomes, writes = decide_in_turn(commands, found, at_now, iter(fences).__next__)
            results = list(zip(batch, outcomes, strict=True))
            updates = [w for key, w in writes.items() if key in found]
            inserts = [w for key, w in writes.items() if key not in found]
            if updates:
                await conn.execute(sql.UPDATE_MANY, sql.columns(updates), prepare=False)
            inserted = None
            if inserts:
                inserted = await conn.execute(sql.INSERT_MANY, sql.columns(inserts), prepare=False)
            if self._on_change is not None and (changed := _changed(results)):
                await conn.execute(sql.NOTIFY_CHANGED, (changed,))
            attempt.written = list(writes.values())
            attempt.updated = {w.key_id for w in updates}
            attempt.resolve = functools.partial(_split, results, set(writes))
            # Marked committing before the COMMIT is handed over: in pipeline mode the
            # call itself may send it (when the statements fill libpq's output buffer)
            # and then read a broken connection's error. A COMMIT that may have been sent
            # is looked for (``Runner.landed``), never decided again as if it had not
            # been. A batch whose callers were answered 503 meanwhile rolls back.
            if not attempt.may_commit():
                await conn.execute("ROLLBACK")
                return _Batch([], [])
            await conn.execute("COMMIT")
        # Leaving the pipeline sent the writes and COMMIT and waited for them.
        if inserted is not None and inserted.rowcount != len(inserts):
            created = {bytes(row[0]) for row in await inserted.fetchall()}
            return _split(results, set(writes), set(found) | created)
        return _Batch(results, [])

    async def _run(self, what: str, work: Work[T], run: Run | None = None) -> T:
        """``work`` on a pooled connection, with retries, by ``run``'s deadline (by
        default within the timeout; ``Runner``)."""
        pool = self._pool
        if pool is None:
            raise ServiceUnavailable("The lease store is not open")
        return await self._runner.run(pool, what, work, run)


def _split(results: _Results, written: set[bytes], landed: set[bytes] | None) -> _Batch:
    """Answer the commands whose key was not written, or was written and is found
    (``landed``); give the others back to be decided again. With ``landed`` None (it
    could not be learned) the commands whose key was written are answered "outcome
    unknown": their write may have taken effect."""
    answered: _Results = []
    again = []
    for request, outcome in results:
        key = request.item.key_id
        if key not in written:
            answered.append((request, outcome))
        elif landed is None:
            answered.append((request, _unknown()))
        elif key in landed:
            answered.append((request, outcome))
        else:
            again.append(request)
    return _Batch(answered, again)


def _changed(results: _Results) -> list[str]:
    """The keys (hex key ids) this batch released or completed: what waiters wake on."""
    return [
        request.item.key_id.hex()
        for request, decided in results
        if isinstance(request.item, Release | Complete)
        and isinstance(decided, Decision)
        and isinstance(decided.outcome, Released | CompletedOutcome)
    ]


def _unknown() -> OutcomeUnknown:
    return OutcomeUnknown(
        "The lease store's connection failed while it committed this write, and the write "
        "could not be read back: its outcome is unknown"
    )


def _elapsed_ms() -> int:
    """Milliseconds of elapsed time: what paces log lines when no clock is injected
    (the database server's clock decides everything else)."""
    return elapsed_ns() // 1_000_000
