"""``Runner.run``: the one place the PostgreSQL store's psycopg errors are retried, or
become ``ServiceUnavailable`` within the timeout, and the one place a caller is given
up on. Serialization failures, deadlocks and connections found dead before the COMMIT
was sent (rolled back by the server) are retried; after a COMMIT cut off in flight, the
rows written and the transaction's status tell which decisions took effect
(``landed``), and when even they cannot be read, the outcome is unknown.

A 503 means nothing was written: at its deadline the run gives up on its caller only
if its attempt has not begun to COMMIT, and marks the run ``abandoned`` so that the
attempt, which checks the mark as it is about to COMMIT (``Attempt.may_commit``), rolls
back instead. One that has begun to COMMIT is waited for one more timeout, then
answered "outcome unknown"::

    deadline:  attempt not committing ──► abandoned: 503, the attempt rolls back
               attempt committing ───────► its answer (or the rows' lookup) within one
                                           more timeout, else "outcome unknown"

No message or log line carries a key id, token or query parameter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool

from leasekeeper._core.model import LeaseRecord
from leasekeeper._errors import OutcomeUnknown, ServiceUnavailable
from leasekeeper.store import _postgres_sql as sql
from leasekeeper.store._base import Refusals, Throttled
from leasekeeper.store._postgres_sql import Connection

__all__ = ["MAX_ATTEMPTS", "Attempt", "Run", "Runner", "Work", "describe"]

log = logging.getLogger("leasekeeper.store.postgres")

T = TypeVar("T")

MAX_ATTEMPTS = 20
# Errors after which the same transaction, run again, may well succeed.
_TRANSIENT = (pg_errors.SerializationFailure, pg_errors.DeadlockDetected)
#: SQLSTATEs that say the database cannot take writes at all, not that one call
#: failed: a full disk, no memory, an I/O error, damaged data or indexes. (Not the rest
#: of class 53: 53400 is also one query's own limit, temp_file_limit say.)
_REFUSING = ("53100", "53200", "58030", "XX001", "XX002")


@dataclass(slots=True)
class Run:
    """One ``Runner.run``: when it gives up on its caller (the loop's time), whether it
    has (``abandoned``), and its attempt under way."""

    deadline: float
    #: Its caller was answered 503: no attempt may COMMIT any more.
    abandoned: bool = False
    attempt: Attempt[Any] | None = None


@dataclass(slots=True)
class Attempt(Generic[T]):
    """What one attempt got to, so a failure can tell whether retrying is safe."""

    #: The run it belongs to (by default one that never gives up).
    run: Run = field(default_factory=lambda: Run(math.inf))
    #: The COMMIT may have been sent: a failure from here on leaves the outcome unknown.
    committing: bool = False
    #: The records the attempt writes, to look for after a cut-off COMMIT.
    written: list[LeaseRecord] = field(default_factory=list)
    #: Of those, the key ids of rows that existed (locked and updated, not inserted).
    updated: set[bytes] = field(default_factory=set)
    #: The transaction's id, when it has one (``READ_CLOCK_AND_TXID``).
    txid: int | None = None
    #: After a cut-off COMMIT: what the attempt returns, given the key ids whose
    #: written record is found in the table (None: that could not be learned).
    resolve: Callable[[set[bytes] | None], T] | None = None

    def may_commit(self) -> bool:
        """Called just before the COMMIT is handed over, with no ``await`` between: False
        when the run has given up on its caller (roll back instead); else the attempt is
        ``committing`` from now on, and the run waits for its outcome."""
        if self.run.abandoned:
            return False
        self.committing = True
        return True


#: Work for ``Runner.run``: given a connection and its attempt, the result.
Work = Callable[[Connection, Attempt[T]], Awaitable[T]]


class Runner:
    """Runs a store's work on its pool (``run``), logging failures (``failures``) and
    refusals to write (``refusals``); ``tasks`` are for the store to cancel as it closes."""

    def __init__(self, timeout: float, failures: Throttled, refusals: Refusals) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self._timeout = timeout
        self._failures = failures
        self._refusals = refusals
        self._checking: asyncio.Task[None] | None = None

    async def run(
        self,
        pool: AsyncConnectionPool[Connection],
        what: str,
        work: Work[T],
        run: Run | None = None,
    ) -> T:
        """Run ``work`` on a pooled connection, with retries, by ``run.deadline`` (by
        default the timeout from now; see the module's docstring for what happens then):
        in a task of its own, so that the caller is answered on time even when
        cancelling a query on a dead network takes longer (the task finishes in the
        background). ``ServiceUnavailable`` when nothing was written."""
        loop = asyncio.get_running_loop()
        if run is None:
            run = Run(loop.time() + self._timeout)
        task = loop.create_task(self._attempts(pool, work, run))
        self.tasks.add(task)
        task.add_done_callback(self._settled)
        try:
            return await self._outcome(task, run, what)
        except psycopg.Error as exc:
            self._failures.log("PostgreSQL store: %s failed: %s", what, describe(exc))
            self.note_refusal(exc)
            raise ServiceUnavailable(_unavailable(exc)) from exc
        finally:
            if not task.done():
                task.cancel()

    async def _outcome(self, task: asyncio.Task[T], run: Run, what: str) -> T:
        """``task``'s result by ``run.deadline``; past it, see the module's docstring."""
        try:
            async with asyncio.timeout_at(run.deadline):
                return await asyncio.shield(task)
        except TimeoutError:
            if task.done():  # its own TimeoutError, or done as the deadline came
                return task.result()
        attempt = run.attempt
        if attempt is None or not attempt.committing:
            run.abandoned = True  # no COMMIT is sent from now on; cancelled, it rolls back
            self._failures.log(
                "PostgreSQL store: %s did not finish within %.1f s", what, self._timeout
            )
            raise ServiceUnavailable("The lease store did not answer in time")
        try:
            async with asyncio.timeout(self._timeout):
                return await asyncio.shield(task)
        except TimeoutError:
            if task.done():
                return task.result()
        self._failures.log(
            "PostgreSQL store: the outcome of a COMMIT (%s) was not known within %.1f s more",
            what,
            self._timeout,
        )
        if attempt.resolve is None:
            raise OutcomeUnknown() from None
        unknown: T = attempt.resolve(None)
        return unknown

    async def _attempts(self, pool: AsyncConnectionPool[Connection], work: Work[T], run: Run) -> T:
        loop = asyncio.get_running_loop()
        for number in range(1, MAX_ATTEMPTS + 1):
            attempt: Attempt[T] = Attempt(run)
            run.attempt = attempt
            conn: Connection | None = None
            last = number == MAX_ATTEMPTS
            try:
                timeout = max(0.0, run.deadline - loop.time())
                async with pool.connection(timeout=timeout) as conn:
                    try:
                        return await work(conn, attempt)
                    except BaseException:
                        await _end_transaction(conn)
                        raise
            except _TRANSIENT as exc:
                if last:
                    raise
                run.attempt = None  # answered: its transaction did not commit
                log.info("PostgreSQL store: retrying after %s", type(exc).__name__)
                # Jittered backoff, so the transactions that collided do not collide again.
                await asyncio.sleep(random.uniform(0.001, 0.005 * number))
            except psycopg.OperationalError as exc:
                broken = conn is not None and conn.broken
                if self.note_refusal(exc) and not broken and _severity(exc) == "ERROR":
                    # The database answered with an ERROR (a full disk is 53100): the
                    # transaction did not commit, and another attempt would meet the same
                    # refusal. (A PANIC, as on a failed WAL flush, may have committed
                    # first: that goes on to landed.)
                    raise
                if broken:
                    self._check_pool(pool)
                if attempt.committing and attempt.resolve is not None:
                    # The COMMIT was sent and its answer lost: look for its effect.
                    return attempt.resolve(await self._looked_for(pool, attempt))
                if broken and not attempt.committing:
                    # Dead before COMMIT was sent: the server rolls that transaction
                    # back, so running it again on another connection is safe.
                    run.attempt = None
                    log.info("PostgreSQL store: a pooled connection was dead; trying another")
                else:
                    raise
                if last:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _looked_for(
        self, pool: AsyncConnectionPool[Connection], attempt: Attempt[Any]
    ) -> set[bytes] | None:
        """``landed`` within a timeout of its own, or None when it cannot be learned."""
        deadline = asyncio.get_running_loop().time() + self._timeout
        try:
            async with asyncio.timeout_at(deadline):
                return await self.landed(pool, attempt, deadline)
        except (psycopg.Error, TimeoutError) as exc:
            reason = describe(exc) if isinstance(exc, psycopg.Error) else "timed out"
            log.warning(
                "PostgreSQL store: a COMMIT was cut off and its rows could not be read "
                "back (%s): its callers are told the outcome is unknown",
                reason,
            )
            return None

    def note_refusal(self, exc: psycopg.Error) -> bool:
        """Whether ``exc`` says the database cannot take writes at all, not that one
        call failed (``_REFUSING``); if so, readiness fails for a while (``Refusals``)."""
        if not (exc.sqlstate or "").startswith(_REFUSING):
            return False
        self._refusals.refused(f"{type(exc).__name__}, SQLSTATE {exc.sqlstate}")
        return True

    async def landed(
        self, pool: AsyncConnectionPool[Connection], attempt: Attempt[Any], deadline: float
    ) -> set[bytes]:
        """The key ids whose record, written by a batch whose COMMIT was cut off, took effect.

        The rows are read ``FOR UPDATE``, which waits for a transaction still holding
        them, then the transaction's status is asked for. A row equal to the written
        record took effect (its owner digest and decision time make it unique) unless
        the transaction aborted; a committed release also did when a new owner has
        taken the key since (``_ended_and_since``). Without a status (no row gave the
        transaction an id, or a standby promoted since does not know it) only equal
        rows count. The other keys' commands are decided again against their row as it
        is now: at worst conservative. A first write to a new key has no lock to wait
        for, but its new decision meets that row through ``INSERT … ON CONFLICT``, so
        nothing is granted twice.
        """
        written = attempt.written
        if not written:
            return set()
        wanted = {w.key_id: w for w in written}
        loop = asyncio.get_running_loop()
        for number in range(1, MAX_ATTEMPTS + 1):
            conn: Connection | None = None
            try:
                async with pool.connection(timeout=max(0.0, deadline - loop.time())) as conn:
                    rows = await (await conn.execute(sql.LOCK_ROWS, (sorted(wanted),))).fetchall()
                    status = None
                    if attempt.txid is not None:
                        status = await _status(conn, attempt.txid)
            except psycopg.OperationalError:
                if conn is None or not conn.broken or number == MAX_ATTEMPTS:
                    raise
                continue  # another dead pooled connection: the read is safe to repeat
            current = sql.records(rows)
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
        self.tasks.add(self._checking)
        self._checking.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the awaiting caller, if any, has reported it


async def _status(conn: Connection, txid: int) -> str | None:
    """``txid_status`` of ``txid``: committed, aborted, in progress, or None."""
    try:
        found = await (await conn.execute(sql.TXID_STATUS, (txid,))).fetchone()
    except psycopg.DataError as exc:
        # "transaction ID … is in the future": a standby promoted since, whose ids are
        # behind. No status: the rows decide alone.
        log.warning(
            "PostgreSQL store: the database does not know a transaction it ran (%s): "
            "a standby promoted since? Raise the fencing counter "
            "(leasekeeper fence --raise-to)",
            describe(exc),
        )
        return None
    return None if found is None else found[0]


def _ended_and_since(written: LeaseRecord, current: dict[bytes, LeaseRecord]) -> bool:
    """Whether ``written``, a release (its owner ended, nothing stored), has since been
    followed by a new owner (a higher fence in its row). Only for a committed transaction,
    and only a release: were that status wrong (a transaction id reused after a failover),
    a release answered as done says only what a new owner proves anyway."""
    now = current.get(written.key_id)
    return (
        written.owner is None
        and written.completed_ms is None
        and now is not None
        and now.fencing_token > written.fencing_token
    )


async def _end_transaction(conn: Connection) -> None:
    """Roll back whatever the failed attempt left open, if the connection still works."""
    if conn.broken or conn.closed:
        return
    # On failure the pool discards or resets the connection when it comes back.
    with contextlib.suppress(psycopg.Error):
        await conn.rollback()


def _severity(exc: psycopg.Error) -> str | None:
    """The error's severity as the server sent it (``ERROR``, ``FATAL``, ``PANIC``), not
    translated; None for an error that did not come from the server."""
    return exc.diag.severity_nonlocalized


def _unavailable(exc: psycopg.Error) -> str:
    """What a 503 says for ``exc``: whether the connection, the time or the database
    failed the call (never the database's own words)."""
    state = exc.sqlstate or ""
    if isinstance(exc, pg_errors.QueryCanceled):  # statement_timeout
        return "The lease store did not answer in time"
    if not state or state.startswith(("08", "57P")):  # the connection, or a shutdown
        return "The lease store cannot be reached; retry shortly"
    return "The lease store refused the request; retry shortly"


def describe(exc: BaseException) -> str:
    """What went wrong, for logs: the error class and SQLSTATE, or libpq's message.

    Server messages can quote values, so only the class and code are used for them;
    libpq's own messages (refused, closed, timed out) name hosts, not data.
    """
    if isinstance(exc, psycopg.Error) and exc.sqlstate is not None:
        return f"{type(exc).__name__} (SQLSTATE {exc.sqlstate})"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
