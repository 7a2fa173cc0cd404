"""The embedded SQLite store: group commit, every answer after an fsync, none on the loop.

Calls queue on the event loop (``Batcher``). When the connection is free, the loop
takes the queued lease commands, opens a ``BEGIN IMMEDIATE`` without waiting for the
lock, reads their records with one statement, decides each in turn, writes them and
COMMITs, which only hands the WAL's new pages to the system (``synchronous=NORMAL``).
The syncer (``_syncer``, a process) then fsyncs the WAL, once for every batch
committed since its last fsync, and only then are those batches answered::

    event loop:  req1 req2 req3 ─► decide 1, 2, 3, COMMIT ──► syncer: fsync(WAL)
                 req4 req5 ─► decide 4, 5, COMMIT ──────────►  (one fsync for both,
                 answer 1, 2, 3, 4, 5 ◄──────────────────────    when it came late)

The loop commits the next batch while the last is made durable. WAL frames are
appended in commit order, so one fsync covers every batch committed before it, and a
crash loses only batches nobody was told about. A batch that wrote nothing (a
replay, a refusal) is answered at once when no batch before it waits for its fsync:
what it read is durable already. After a failed fsync the kernel may have dropped
the pages it could not write, and a later fsync would prove nothing: the batches it
covered and every call after get 503 until a restart. So it is when the store's
files were deleted or replaced (looked for before each fsync), or the syncer is
gone.

Whatever can wait waits off the loop: tasks (purge steps, pings) and a batch that
finds the write lock taken run whole on the writer's thread, and are fsynced like a
batch; checkpoints run on a thread and connection of their own (``Checkpointer``).
The thread waits for the lock only until the batch's earliest deadline: a batch that
cannot begin in time writes nothing and is answered 503. A batch is claimed from the
moment it is taken (``Batcher``), so one that commits, even at its deadline, is
answered with its decisions once fsynced; one committed whose fsync fails (or never
comes) is answered "outcome unknown", since its write may survive or not.
The fencing counter has its own row, read inside each transaction, so it never goes
back, not even when every record is deleted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leasekeeper._clock import Clock, SystemClock
from leasekeeper._core.model import Command, Decision
from leasekeeper._errors import InternalError, LeaseError, OutcomeUnknown, ServiceUnavailable
from leasekeeper.store import _sqlite_sql as sql
from leasekeeper.store import _syncer
from leasekeeper.store._base import Purged, Refusals, Throttled, decide_in_turn
from leasekeeper.store._batcher import Batcher, Request, earliest, late, settle
from leasekeeper.store._sqlite_sync import Checkpointer, Files, Syncer, open_wal, report_failure

__all__ = ["SqliteStore"]

log = logging.getLogger("leasekeeper.store.sqlite")

#: Work that is not a lease decision (purge, ping): a batch alone, given the connection.
_Task = Callable[[sqlite3.Connection], Any]
_Item = Command | _Task
#: A batch's calls, each with its outcome: answered once the WAL is fsynced.
_Results = list[tuple[Request[_Item], Any]]
#: Work for the thread, whose future gets the results (None alone stops it): ``_WHOLE``
#: runs a batch whole, holding the connection, if it can begin before the
#: ``time.monotonic()`` given; ``_CATCH_UP`` checkpoints on it.
_Job = tuple[str, list[Request[_Item]], float, asyncio.Future[_Results]]
_WHOLE, _CATCH_UP = "whole", "catch-up"


def _write_failed() -> ServiceUnavailable:
    """What a call gets when SQLite refused its batch's transaction (logged apart)."""
    return ServiceUnavailable("The lease store could not complete the write")


def _not_durable() -> ServiceUnavailable:
    """What every call gets once nothing more can be made durable (logged apart)."""
    return ServiceUnavailable("The lease store could not make its writes durable")


def _unknown() -> OutcomeUnknown:
    """What a call gets whose batch was committed but not made durable: after a restart
    its write may be there or not."""
    return OutcomeUnknown(
        "The lease store committed this write but could not make it durable: its outcome is unknown"
    )


class SqliteStore:
    """Records in one SQLite file (``sqlite:///path/to.db``). Its syncer is a process
    unless ``fsync_process`` is False, when it is a thread of this process: for tests
    that stand in for the fsync (``_syncer.sync_data``)."""

    def __init__(
        self,
        path: str | Path,
        clock: Clock | None = None,
        *,
        max_batch: int = 512,
        timeout_seconds: float = 5.0,
        fsync_process: bool = True,
    ) -> None:
        self.path = Path(path)
        self._clock = clock or SystemClock()
        self._failures = Throttled(log, logging.ERROR, self._clock.now_ms)
        self._refusals = Refusals(self._clock.now_ms)
        self._timeout = timeout_seconds
        # One runner: the store has one connection. A task is a batch by itself.
        self._batcher: Batcher[_Item] = Batcher(
            self._run_batch,
            timeout_seconds=timeout_seconds,
            max_batch=max_batch,
            log=log,
            alone=callable,
        )
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._open_lock = asyncio.Lock()
        # Set by open(); the event loop's side, used on that loop only:
        self._conn: sqlite3.Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Why nothing more can be made durable (a failed fsync, the files deleted or
        #: replaced, the syncer gone): from then on every call fails.
        self._failed: Exception | None = None
        #: The WAL file, opened by the thread for the syncer to fsync, and the files'
        #: identities as opened (``_syncer.moved``).
        self._wal_fd = -1
        self._files: Files = []
        self._checkpointer: Checkpointer | None = None
        self._fsync_process = fsync_process
        self._syncer: Syncer | None = None
        #: Batches committed, oldest first, each answered when the syncer has fsynced it.
        self._unsynced: collections.deque[_Results] = collections.deque()

    async def open(self) -> None:
        async with self._open_lock:
            if self._thread is not None:
                return
            loop = asyncio.get_running_loop()
            ready: asyncio.Future[sqlite3.Connection] = loop.create_future()
            thread = threading.Thread(
                target=self._writer, args=(loop, ready), name="leasekeeper-sqlite", daemon=True
            )
            thread.start()
            try:
                self._conn = await asyncio.shield(ready)
            except asyncio.CancelledError:  # a server stopped while it starts, say
                # The thread goes on connecting; once it has, it is told to stop (and
                # closes what it opened), as it would be by close().
                ready.add_done_callback(self._stop_once_connected)
                raise
            try:
                self._syncer = await Syncer.start(
                    loop,
                    self._wal_fd,
                    self._files,
                    self._synced,
                    self._sync_failed,
                    process=self._fsync_process,
                    first_fsync_within=self._timeout,
                )
            except BaseException:
                self._jobs.put(None)
                await loop.run_in_executor(None, thread.join)
                self._conn = None
                raise
            self._loop = loop
            self._thread = thread

    def _stop_once_connected(self, ready: asyncio.Future[sqlite3.Connection]) -> None:
        if not ready.cancelled() and ready.exception() is None:
            self._jobs.put(None)

    async def close(self) -> None:
        """Refuse new calls, answer every queued one, then stop the thread."""
        store_loop = self._loop
        if (
            store_loop is not None
            and store_loop is not asyncio.get_running_loop()
            and store_loop.is_running()
        ):  # the loop that uses the connection closes it
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.close(), store_loop))
            return
        async with self._open_lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            if store_loop is asyncio.get_running_loop():
                await self._batcher.idle()
            syncer, self._syncer = self._syncer, None
            if syncer is not None:  # it answers what it was given, then ends
                await syncer.close()
            self._fail_unsynced()  # (when it could not)
            self._jobs.put(None)
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
            self._conn = None

    async def apply(self, command: Command) -> Decision:
        decision: Decision = await self._submit(command)
        return decision

    async def purge(self, limit: int, after: bytes | None = None) -> Purged:
        """Looks at the next ``limit`` keys past ``after`` and deletes the finished ones."""
        start = b"" if after is None else after  # every key id sorts after the empty blob
        now_ms = self._clock.now_ms
        purged: Purged = await self._submit(
            lambda conn: sql.purge_step(conn, start, limit, now_ms())
        )
        return purged

    async def raise_fence(self, at_least: int) -> int:
        """One transaction on the writer's thread, fsynced before it returns, like a batch;
        a batch decided after it reads the raised counter."""
        counter: int = await self._submit(lambda conn: sql.raise_fence(conn, at_least))
        return counter

    async def ping(self) -> None:
        """The thread can begin a write, the tables, their columns, the schema version
        and the fencing counter are as this leasekeeper makes them (a decision could be
        made), and no write was refused lately (``Refusals``)."""
        self._refusals.check()

        def run(conn: sqlite3.Connection) -> None:
            if self._refuse_moved():
                raise _not_durable()
            problem = sql.schema_problem(conn)
            if problem is not None:
                raise ServiceUnavailable(f"The lease store cannot decide: {problem}")

        await self._submit(run)

    @property
    def where(self) -> str:
        """Where the store is, for messages."""
        return f"at {self.path}"

    @property
    def described(self) -> str:
        """The file, its whole path: a relative one depends on where the server started."""
        return f"SQLite file {self.path.resolve()}"

    async def exists(self) -> bool:
        """Whether the store is there already, read without creating anything
        (``_sqlite_sql.exists``)."""
        return sql.exists(self.path, self._timeout)

    async def damage(self) -> str | None:
        """What ``PRAGMA integrity_check`` finds wrong, or None (``_sqlite_sql.damage``)."""
        return sql.damage(self.path, self._timeout)

    async def count_live(self) -> int:
        """Leases held now, counted on a reader connection of its own; a scan, so read it
        every few seconds at most."""
        now = self._clock.now_ms()
        try:
            return await asyncio.to_thread(sql.count_live, self.path, self._timeout, now)
        except sqlite3.Error as exc:
            raise ServiceUnavailable("The lease store could not be read") from exc

    def fencing_counter(self) -> int:
        """The counter's committed value, read on a separate connection (tests, tools)."""
        return sql.fencing_counter(self.path)

    # -- the event loop's side -------------------------------------------------------------

    async def _submit(self, item: _Item) -> Any:
        loop = asyncio.get_running_loop()
        if self._thread is None or self._loop is None:
            raise ServiceUnavailable("The lease store is not open")
        if self._failed is not None:
            raise _not_durable()
        if loop is not self._loop:  # a caller on another event loop (thread): forward
            if not self._loop.is_running():
                raise ServiceUnavailable("The lease store's event loop is not running")
            forwarded = asyncio.run_coroutine_threadsafe(self._submit(item), self._loop)
            return await asyncio.wrap_future(forwarded)
        return await self._batcher.submit(item)

    async def _run_batch(self, batch: list[Request[_Item]]) -> None:
        """The batcher's ``run``: decide lease commands on the loop, in a ``BEGIN
        IMMEDIATE`` taken without waiting, or else (a task, the write lock taken) on the
        thread, which waits there; then hand the results to the syncer."""
        checkpointer = self._checkpointer
        if self._failed is None and checkpointer is not None and checkpointer.behind:
            await self._on_thread(_CATCH_UP, [])  # catch_up clears it
        if self._failed is not None:  # nothing more is written: see the module's docstring
            for request in batch:
                settle(request.future, _not_durable())
            return
        if callable(batch[0].item):
            results = await self._whole_on_thread(batch)
        else:
            conn = self._conn
            assert conn is not None
            try:
                conn.execute("BEGIN IMMEDIATE")  # busy_timeout is 0 on this connection
            except sqlite3.Error:
                results = await self._whole_on_thread(batch)
            else:
                changes = conn.total_changes
                results = self._commit_on_loop(conn, batch)
                if conn.total_changes == changes and not self._unsynced:
                    # It wrote nothing, and what it read is durable: no fsync to wait for.
                    Batcher.answer(results)
                    return
        if results:
            self._make_durable(results)

    async def _whole_on_thread(self, batch: list[Request[_Item]]) -> _Results:
        """``batch`` run whole on the thread, which waits for the write lock until the
        batch's earliest deadline at most."""
        until = time.monotonic() + earliest(batch) - asyncio.get_running_loop().time()
        try:
            return await self._on_thread(_WHOLE, batch, until)
        except asyncio.CancelledError:  # the store's loop is ending: the thread may commit
            for request in batch:
                settle(request.future, _unknown())
            raise

    def _commit_on_loop(self, conn: sqlite3.Connection, batch: list[Request[_Item]]) -> _Results:
        results: _Results = []
        try:
            self._decide_in_transaction(conn, batch, results)
            conn.execute("COMMIT")  # to the OS: the syncer fsyncs before anyone is answered
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                self._failures.log(
                    "SQLite batch failed, %d operations refused: %s", len(batch), exc
                )
                self._refused(exc)
                raise _write_failed() from None
            raise
        return results

    async def _on_thread(
        self, kind: str, batch: list[Request[_Item]], until: float = 0.0
    ) -> _Results:
        """Have the thread do ``kind`` of job with ``batch`` (by ``until``); its results."""
        done: asyncio.Future[_Results] = asyncio.get_running_loop().create_future()
        self._jobs.put((kind, batch, until, done))
        return await done

    def _make_durable(self, results: _Results) -> None:
        """Have the syncer fsync the WAL, then answer ``results`` (a batch just committed:
        one fsync covers every COMMIT made before it)."""
        self._unsynced.append(results)
        if self._failed is not None or self._syncer is None:
            self._fail_unsynced()
        else:
            self._syncer.request()

    def _synced(self, batches: int) -> None:
        """The syncer made the oldest ``batches`` batches durable."""
        for _ in range(batches):
            Batcher.answer(self._unsynced.popleft())
        if self._checkpointer is not None:
            self._checkpointer.poke()

    def _sync_failed(self, error: Exception, kind: str) -> None:
        """The syncer could not make the WAL durable: refuse what waits for it and, from
        now on, everything (``_failed``), and say so once."""
        if self._failed is None:
            self._failed = error
            report_failure(error, kind)
        self._fail_unsynced()

    def _fail_unsynced(self) -> None:
        """Answer the batches committed and not made durable: their outcome is unknown."""
        while self._unsynced:
            for request, _ in self._unsynced.popleft():
                settle(request.future, _unknown())

    # -- the writer's thread ---------------------------------------------------------------

    def _writer(
        self, loop: asyncio.AbstractEventLoop, ready: asyncio.Future[sqlite3.Connection]
    ) -> None:
        """The thread: opens the connection, then runs jobs until told to stop."""
        try:
            conn = sql.connect_writer(self.path, self._timeout)
            try:
                self._wal_fd, self._files = open_wal(self.path)
            except BaseException:
                conn.close()
                raise
        except (sqlite3.Error, OSError, RuntimeError, ValueError) as exc:  # ValueError: a NUL
            error = ServiceUnavailable(f"Cannot open the SQLite store at {self.path}: {exc}")
            loop.call_soon_threadsafe(settle, ready, error)
            return
        checkpointer = Checkpointer(self.path, self._timeout)
        if not checkpointer.start():
            # SQLite's own, in the COMMITs: the loop's, which then wait for each checkpoint.
            conn.execute("PRAGMA wal_autocheckpoint = 1000")
        self._checkpointer = checkpointer
        loop.call_soon_threadsafe(settle, ready, conn)
        try:
            while (job := self._jobs.get()) is not None:
                kind, batch, until, done = job
                results: _Results = []
                if kind == _WHOLE:
                    try:
                        results = self._run_whole(conn, batch, until)
                    except Exception:  # never let the thread die: its callers would hang
                        log.exception("SQLite writer failed a batch of %d operations", len(batch))
                        results = [(request, InternalError()) for request in batch]
                        with contextlib.suppress(sqlite3.Error):
                            if conn.in_transaction:  # nothing of the batch is kept
                                conn.execute("ROLLBACK")
                else:
                    checkpointer.catch_up(conn)
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    loop.call_soon_threadsafe(settle, done, results)
        finally:
            checkpointer.stop()
            conn.close()
            os.close(self._wal_fd)

    def _refuse_moved(self) -> bool:
        """On the thread (a ping): whether the files were deleted or replaced, as the
        syncer checks before every fsync; if so, refuse everything from now on."""
        if self._failed is not None:
            return True
        moved = _syncer.moved(self._wal_fd, self._files)
        if moved is None:
            return False
        self._failed = RuntimeError(moved)
        report_failure(moved, _syncer.MOVED.decode())
        return True

    def _run_whole(
        self, conn: sqlite3.Connection, batch: list[Request[_Item]], until: float
    ) -> _Results:
        """On the thread: one whole transaction, waiting for the lock until ``until`` (a
        ``time.monotonic()``); a batch that cannot begin by then writes nothing: 503."""
        results: _Results = []
        wait_ms = int((until - time.monotonic()) * 1000)
        if wait_ms <= 0:
            return [(request, late()) for request in batch]
        try:
            conn.execute(f"PRAGMA busy_timeout = {wait_ms}")
            try:
                conn.execute("BEGIN IMMEDIATE")
            finally:
                conn.execute("PRAGMA busy_timeout = 0")
            try:
                if callable(batch[0].item):
                    self._run_task(conn, batch[0], results)
                else:
                    self._decide_in_transaction(conn, batch, results)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            self._failures.log(
                "SQLite transaction failed, %d operations refused: %s", len(batch), exc
            )
            self._refused(exc)
            error = _write_failed()
            results = [(request, error) for request in batch]
        return results

    def _refused(self, exc: sqlite3.Error) -> None:
        """Note a refusal for readiness when ``exc`` says the file cannot be written at
        all (``sql.REFUSING``), not one transaction's trouble (a lock held too long)."""
        if sql.primary_code(exc) in sql.REFUSING:
            self._refusals.refused(str(exc))

    # -- decisions, on either side ---------------------------------------------------------

    def _decide_in_transaction(
        self, conn: sqlite3.Connection, batch: list[Request[_Item]], results: _Results
    ) -> None:
        """Decide ``batch`` (lease commands) and write the fencing counter they moved."""
        (start,) = conn.execute(sql.READ_FENCE).fetchone()
        fence = start

        def next_fence() -> int:
            nonlocal fence
            fence += 1
            return int(fence)

        self._decide_all(conn, batch, next_fence, results)
        if fence != start:
            sql.write_fence(conn, fence)

    def _decide_all(
        self,
        conn: sqlite3.Connection,
        batch: list[Request[_Item]],
        next_fence: Callable[[], int],
        results: _Results,
    ) -> None:
        """Decide ``batch`` (lease commands) in order, each on the records as the ones
        before it left them, and write the last state of every changed record."""
        live = [request for request in batch if not request.future.done()]
        commands = [request.item for request in live if not callable(request.item)]  # (all)
        keys = list(dict.fromkeys(command.key_id for command in commands))
        records = sql.read_records(conn, keys)
        outcomes, writes = decide_in_turn(commands, records, self._clock.now_ms, next_fence)
        results.extend(zip(live, outcomes, strict=True))
        sql.write_records(conn, list(writes.values()))

    @staticmethod
    def _run_task(conn: sqlite3.Connection, request: Request[_Item], results: _Results) -> None:
        task = request.item
        if request.future.done() or not callable(task):
            return
        try:
            results.append((request, task(conn)))
        except sqlite3.Error:
            raise
        except LeaseError as exc:
            results.append((request, exc))
        except Exception:
            log.exception("SQLite task failed")
            results.append((request, InternalError()))
