"""The embedded SQLite store: group commit, every answer after an fsync, none on the loop.

Requests queue on the event loop. When the connection is free, the loop takes the
queued lease commands (up to ``max_batch``), opens a ``BEGIN IMMEDIATE``
transaction without waiting for the lock, reads their records with one statement,
decides each in turn, writes them with one statement and COMMITs, which only hands
the WAL's new pages to the operating system (``synchronous=NORMAL``). The syncer, a
small process of its own (``_syncer``), then fsyncs the WAL, once for every batch
committed since its last fsync, and only then are those batches answered::

    event loop:  req1 req2 req3 ─► decide 1, 2, 3, COMMIT ──► syncer: fsync(WAL)
                 req4 req5 ─► decide 4, 5, COMMIT ──────────►  (one fsync for both,
                 answer 1, 2, 3, 4, 5 ◄──────────────────────    when it came late)

So a request is acknowledged only once its batch is on the disk, which is what
``synchronous=FULL`` gives, but the fsync no longer holds the connection: the loop
decides and commits the next batch while the last one is being made durable,
instead of waiting for a thread (which must first take the GIL from the busy loop)
to COMMIT and hand the connection back. The syncer is a process rather than a thread
because a thread takes the GIL back after each of its system calls, and the busy
loop stalls each time (``_syncer`` says how much that cost); where no process can be
started it is a thread all the same. Each batch is decided on what the batches
before it committed; since WAL frames are appended in commit order, one fsync covers
every batch committed before it, and a crash loses only batches that nobody was told
about. If an fsync fails, the batches it covered and every request after it are
refused: the store answers 503 until it is restarted, because after a failed fsync
the kernel may have dropped the pages it could not write, and a later fsync that
succeeds would prove nothing. So it is when the store's files were deleted or
replaced (the syncer looks before each fsync) or when the syncer is gone.

Everything that can wait (the fsync, a write lock held by another process, a
cleanup step, a checkpoint) happens off the loop: tasks (cleanup steps, pings) and
any batch that finds the write lock taken run whole on the writer's thread, which
holds the connection meanwhile, and are fsynced by the syncer like a batch. WAL
checkpoints run on another thread and connection (``_Checkpointer``). The fencing
counter lives in its own row and is read inside each transaction, so it never goes
back, not even when every record is deleted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import queue
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leasekeeper._clock import Clock, SystemClock
from leasekeeper._core.model import Command, Decision, LeaseRecord
from leasekeeper._errors import InternalError, LeaseError, ServiceUnavailable
from leasekeeper.store import _syncer
from leasekeeper.store._base import (
    Deadlines,
    Purged,
    Refusals,
    Throttled,
    decide_in_turn,
    settle,
)

__all__ = ["SqliteStore"]

log = logging.getLogger("leasekeeper.store.sqlite")

SCHEMA_VERSION = 1
#: The oldest SQLite library that runs the store's statements (upserts: 3.24.0).
_OLDEST_SQLITE = (3, 24, 0)
#: Page cache of the writer connection, in KiB when negative (SQLite default: 2 MiB).
_CACHE_KIB = -65_536
#: The WAL file is truncated to this size when it starts over.
_WAL_KEEP_BYTES = 64 * 1024 * 1024
#: WAL frames (pages) past which the checkpointer makes the WAL start over.
_WAL_RESTART_FRAMES = 16_384

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
) WITHOUT ROWID;
INSERT OR IGNORE INTO meta (name, value) VALUES ('fence', 0);
CREATE TABLE IF NOT EXISTS leases (
    key_id              BLOB PRIMARY KEY,
    fingerprint         BLOB,
    absolute_expires_ms INTEGER NOT NULL,
    fencing_token       INTEGER NOT NULL,
    owner               BLOB,
    lease_expires_ms    INTEGER NOT NULL,
    completed_ms        INTEGER,
    result              TEXT,
    updated_ms          INTEGER NOT NULL
) WITHOUT ROWID;
-- Earlier versions purged through this index. Purges now walk the table in key order.
DROP INDEX IF EXISTS leases_lifecycle_end;
"""

_SELECT_MANY = (
    "SELECT key_id, fingerprint, absolute_expires_ms, fencing_token, owner, "
    "lease_expires_ms, completed_ms, result, updated_ms FROM leases WHERE key_id IN "
)
#: Keys per SELECT: far below SQLite's limit on bound parameters (32,766).
_SELECT_CHUNK = 500
#: The record's columns: ``LeaseRecord``'s fields, in their order.
_COLUMNS = LeaseRecord.__struct_fields__
_UPSERT_INTO = (
    "INSERT INTO leases (key_id, fingerprint, absolute_expires_ms, fencing_token, owner, "
    "lease_expires_ms, completed_ms, result, updated_ms) VALUES "
)
_UPSERT_SET = (
    " ON CONFLICT (key_id) DO UPDATE SET fingerprint = excluded.fingerprint, "
    "absolute_expires_ms = excluded.absolute_expires_ms, "
    "fencing_token = excluded.fencing_token, owner = excluded.owner, "
    "lease_expires_ms = excluded.lease_expires_ms, completed_ms = excluded.completed_ms, "
    "result = excluded.result, updated_ms = excluded.updated_ms"
)
#: Which of a record's four nullable columns (fingerprint, owner, completed_ms,
#: result) are NULL: an upsert statement of its own for each (``_upsert``).
_Nulls = tuple[bool, bool, bool, bool]


@functools.lru_cache(maxsize=16)
def _upsert(nulls: _Nulls) -> str:
    """The upsert of a record whose nullable columns are NULL as ``nulls`` says.

    NULL is written into the statement rather than bound, and blobs are bound as
    ``bytearray`` (``_params``): Python 3.11's sqlite3 looks for an adapter for
    every parameter that is ``None`` or ``bytes``, and formats and discards an
    AttributeError for each, which made binding a row cost about four times its
    insert. sqlite3's adapters are one table for the whole process, so registering
    some would change them for a program that embeds leasekeeper.
    """
    null = dict(zip(("fingerprint", "owner", "completed_ms", "result"), nulls, strict=True))
    values = ", ".join("NULL" if null.get(column) else "?" for column in _COLUMNS)
    return _UPSERT_INTO + "(" + values + ")" + _UPSERT_SET  # only NULL and ? marks put in


def _params(record: LeaseRecord) -> tuple[_Nulls, list[object]]:
    """Which nullable columns of ``record`` are NULL, and the values to bind for the
    rest, in ``_upsert``'s order, blobs as ``bytearray`` (why: ``_upsert``)."""
    fingerprint, owner = record.fingerprint, record.owner
    completed_ms, result = record.completed_ms, record.result
    params: list[object] = [bytearray(record.key_id)]
    if fingerprint is not None:
        params.append(bytearray(fingerprint))
    params += (record.absolute_expires_ms, record.fencing_token)
    if owner is not None:
        params.append(bytearray(owner))
    params.append(record.lease_expires_ms)
    if completed_ms is not None:
        params.append(completed_ms)
    if result is not None:
        params.append(result)
    params.append(record.updated_ms)
    nulls = (fingerprint is None, owner is None, completed_ms is None, result is None)
    return nulls, params


@functools.lru_cache(maxsize=64)
def _select_many(count: int) -> str:
    """The batch read for ``count`` key ids (only ``?`` marks are put into the text)."""
    return _SELECT_MANY + "(" + ", ".join("?" * count) + ")"


_READ_FENCE = "SELECT value FROM meta WHERE name = 'fence'"
_STORE_TABLES = (
    "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name IN ('leases', 'meta')"
)
_READ_VERSION = "SELECT value FROM meta WHERE name = 'schema_version'"
_RAISE_FENCE = "UPDATE meta SET value = max(value, ?) WHERE name = 'fence'"
_COUNT_LIVE = "SELECT count(*) FROM leases WHERE owner IS NOT NULL AND lease_expires_ms > ?"
#: A purge step walks the table in key order: the next ``limit`` keys past the
#: last step's, then the finished records among them. Records live in key order,
#: so a step's deletes share a few neighbouring pages: a step through a million
#: finished records writes about 13 pages to the WAL per 200 records, where
#: deleting them in order of expiry (through an index) wrote about 214, all over
#: the file, and so did every later checkpoint.
_PURGE_SPAN = (
    "SELECT count(*), max(key_id) FROM "
    "(SELECT key_id FROM leases WHERE key_id > ? ORDER BY key_id LIMIT ?)"
)
_PURGE = "DELETE FROM leases WHERE key_id > ? AND key_id <= ? AND absolute_expires_ms <= ?"


#: Work for the writer that is not a lease decision (purge, ping): it gets the
#: connection inside the batch's transaction.
_Task = Callable[[sqlite3.Connection], Any]


#: SQLite's primary result codes that say the store cannot take writes at all (its own
#: fixed messages, which name no data): a full disk, an I/O error, a read-only or
#: unopenable file, a damaged one.
_REFUSING = frozenset(
    {
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_READONLY,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_CORRUPT,
        sqlite3.SQLITE_NOTADB,
    }
)


def _log_moved(what: str) -> None:
    log.critical(
        "the SQLite store's files were deleted or replaced while it was open (%s): "
        "the lease store refuses every request until leasekeeper is restarted. Put the "
        "file back, or before restarting raise the fencing counter above every token "
        "handed out (leasekeeper fence --raise-to): a new file starts it again",
        what,
    )


def _primary_code(exc: sqlite3.Error) -> int:
    """SQLite's primary result code of ``exc`` (its extended code's low byte); 0 for the
    sqlite3 module's own errors, which carry none."""
    return (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF


def _write_failed() -> ServiceUnavailable:
    """What a request gets when SQLite refused its batch's transaction (logged apart)."""
    return ServiceUnavailable("The lease store could not complete the write")


def _not_durable() -> ServiceUnavailable:
    """What every request gets once an fsync of the WAL has failed (logged apart)."""
    return ServiceUnavailable("The lease store could not make its writes durable")


@dataclass(slots=True)
class _Op:
    """One request for the connection: a lease ``command``, or else a ``task``."""

    command: Command | None
    task: _Task | None
    future: asyncio.Future[Any]


#: A batch's ops, each with its outcome: answered once the WAL is fsynced.
_Results = list[tuple[_Op, Any]]
#: Work for the thread, one of two kinds (None alone stops the thread): ``_WHOLE``
#: with ops to run whole on the thread, holding the connection (a task, or commands
#: that found the write lock taken); ``_CATCH_UP``: a checkpoint on the writer's
#: connection (``_Checkpointer.catch_up``), which the thread holds meanwhile.
_Job = tuple[str, list[_Op]]
_WHOLE, _CATCH_UP = "whole", "catch-up"


class SqliteStore:
    """Records in one SQLite file (``sqlite:///path/to.db``).

    Opening it starts its syncer (the module's docstring), a process unless
    ``fsync_process`` is False, when it runs on a thread of this process: for tests
    that stand in for the fsync (``_syncer.sync_data``), which they can only do here.
    """

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
        self._max_batch = max_batch
        self._timeout = timeout_seconds
        self._deadlines = Deadlines(timeout_seconds)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._open_lock = asyncio.Lock()
        # Set by open(); the event loop's side, used on that loop only:
        self._conn: sqlite3.Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: collections.deque[_Op] = collections.deque()
        #: The connection is in a batch: the loop's statements or the thread's job.
        self._busy = False
        self._idle = asyncio.Event()
        #: Why nothing more can be made durable (a failed fsync, the files deleted or
        #: replaced, the syncer gone): from then on every call fails.
        self._failed: Exception | None = None
        #: The WAL file, opened by the thread for the syncer to fsync.
        self._wal_fd = -1
        #: The database and WAL files as opened: (path, (device, inode)) each
        #: (``_syncer.moved``).
        self._files: list[tuple[str, tuple[int, int]]] = []
        self._checkpointer: _Checkpointer | None = None
        self._fsync_process = fsync_process
        self._syncer: _Syncer | None = None
        #: Batches committed, oldest first, each answered when the syncer has fsynced it.
        self._unsynced: collections.deque[_Results] = collections.deque()

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        async with self._open_lock:
            if self._thread is not None:
                return
            loop = asyncio.get_running_loop()
            ready: asyncio.Future[sqlite3.Connection] = loop.create_future()
            thread = threading.Thread(
                target=self._sync_thread,
                args=(loop, ready),
                name="leasekeeper-sqlite",
                daemon=True,
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
                self._syncer = await _Syncer.start(
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
            self._busy = False
            self._idle = asyncio.Event()
            self._idle.set()
            self._thread = thread

    def _stop_once_connected(self, ready: asyncio.Future[sqlite3.Connection]) -> None:
        if not ready.cancelled() and ready.exception() is None:
            self._jobs.put(None)

    async def close(self) -> None:
        """Refuse new requests, answer every queued one, then stop the thread."""
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
                await self._idle.wait()
            syncer, self._syncer = self._syncer, None
            if syncer is not None:  # it answers what it was given, then ends
                await syncer.close()
            self._fail_unsynced()  # (when it could not)
            self._jobs.put(None)
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
            self._conn = None

    # -- the interface ---------------------------------------------------------------------

    async def apply(self, command: Command) -> Decision:
        decision: Decision = await self._submit(command, None)
        return decision

    async def purge(self, limit: int, after: bytes | None = None) -> Purged:
        """Looks at the next ``limit`` keys past ``after`` and deletes the finished ones."""
        clock = self._clock
        start = b"" if after is None else after  # every key id sorts after the empty blob

        def run(conn: sqlite3.Connection) -> Purged:
            seen, last = conn.execute(_PURGE_SPAN, (start, limit)).fetchone()
            if not seen:
                return Purged(0, None)
            deleted = conn.execute(_PURGE, (start, last, clock.now_ms())).rowcount
            return Purged(deleted, bytes(last) if seen == limit else None)

        purged: Purged = await self._submit(None, run)
        return purged

    async def raise_fence(self, at_least: int) -> int:
        """One transaction on the writer's thread, fsynced before it returns, like a batch;
        a batch decided after it reads the raised counter (``_decide_in_transaction``)."""

        def run(conn: sqlite3.Connection) -> int:
            conn.execute(_RAISE_FENCE, (at_least,))
            (value,) = conn.execute(_READ_FENCE).fetchone()
            return int(value)

        counter: int = await self._submit(None, run)
        return counter

    @property
    def where(self) -> str:
        """Where the store is, for messages."""
        return f"at {self.path}"

    async def exists(self) -> bool:
        """Whether the store is there already (a file holding leasekeeper's tables), read
        without creating or changing anything: for the operator commands that must not
        make a new, empty store (``leasekeeper fence``) in a mistyped path, an empty
        file or another program's database. A database too damaged to list its tables
        is there (``damage()`` says how); a file SQLite cannot read for another reason
        (unreadable) raises ``sqlite3.Error`` rather than pass for "no store"."""
        if not self.path.is_file():
            return False
        try:
            with self._read_only(leave_no_files=True) as conn:
                tables = conn.execute(_STORE_TABLES).fetchone()
                if tables is None or tables[0] != 2:
                    return False
                version = conn.execute(_READ_VERSION).fetchone()
        except sqlite3.DatabaseError as exc:
            code = _primary_code(exc)
            if code == sqlite3.SQLITE_NOTADB:
                return False  # not a database at all: no store of ours
            if code == sqlite3.SQLITE_CORRUPT:
                return True  # a damaged one: whose it was cannot be read; not "none here"
            raise
        return version is not None

    async def damage(self) -> str | None:
        """ "the SQLite store is damaged (…)" with SQLite's first complaint about the file
        (``PRAGMA integrity_check``), or None when it finds none: for ``leasekeeper
        fence``, run after a restore, where a store copied over a leftover WAL is damaged
        in ways ``quick_check`` does not look for (the order of a table without rowids).
        It reads the whole file; ``ServiceUnavailable`` when it cannot be read at all.

        First it checkpoints (PASSIVE, as a server's checkpointer does, safe beside
        running servers): a leftover WAL whose pages all lie past the copy's end leaves
        every read intact, but it says the file is longer than the copy, so no
        checkpoint can ever fold it in, and a server's WAL would only grow.
        """
        try:
            real = self.path.resolve()  # the WAL is beside the file, not beside a link to it
            with contextlib.closing(sqlite3.connect(real, timeout=self._timeout)) as conn:
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            with self._read_only() as conn:  # never immutable: servers may be writing
                found = conn.execute("PRAGMA integrity_check(1)").fetchone()
        except sqlite3.DatabaseError as exc:
            if _primary_code(exc) in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
                return f"the SQLite store is damaged ({exc})"
            # Not the file's fault (a read-only directory, a lock held too long): a
            # sound store must not be sent back to a backup.
            why = f"Cannot check the SQLite store at {self.path}: {exc}"
            raise ServiceUnavailable(why) from None
        if found is not None and found[0] == "ok":
            return None
        return f"the SQLite store is damaged ({found[0] if found else ''})"

    def _read_only(self, *, leave_no_files: bool = False) -> contextlib.closing[sqlite3.Connection]:
        """A read-only connection of its own, waiting up to the store's timeout for a lock.

        With ``leave_no_files`` (``exists``, which must leave another program's file as
        it found it) and no WAL beside the file (no process has it open), ``immutable``
        reads it as it is, creating no ``-wal`` or ``-shm``; otherwise ``mode=ro`` reads
        the file as a server would. The WAL is looked for beside the file itself, where
        SQLite keeps it, not beside a symbolic link to it."""
        real = self.path.resolve()
        mode = "mode=ro"
        if leave_no_files and not Path(f"{real}-wal").exists():
            mode += "&immutable=1"
        uri = f"{real.as_uri()}?{mode}"
        return contextlib.closing(sqlite3.connect(uri, uri=True, timeout=self._timeout))

    async def ping(self) -> None:
        """The thread answers a query, and no write was refused lately (``Refusals``)."""
        self._refusals.check()

        def run(conn: sqlite3.Connection) -> None:
            if self._refuse_moved():
                raise _not_durable()
            conn.execute("SELECT 1").fetchone()

        await self._submit(None, run)

    async def count_live(self) -> int:
        """Leases held now, counted on a reader connection of its own (WAL readers do not
        wait for the writer, nor it for them); a scan, so read it every few seconds at most."""
        now = self._clock.now_ms()

        def count() -> int:
            with self._read_only() as conn:
                (live,) = conn.execute(_COUNT_LIVE, (now,)).fetchone()
                return int(live)

        try:
            return await asyncio.to_thread(count)
        except sqlite3.Error as exc:
            raise ServiceUnavailable("The lease store could not be read") from exc

    def fencing_counter(self) -> int:
        """The counter's committed value, read on a separate connection (tests, tools)."""
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            row = conn.execute(_READ_FENCE).fetchone()
            return int(row[0])

    # -- the connection's two sides ---------------------------------------------------------

    async def _submit(self, command: Command | None, task: _Task | None) -> Any:
        loop = asyncio.get_running_loop()
        if self._thread is None or self._loop is None:
            raise ServiceUnavailable("The lease store is not open")
        if self._failed is not None:
            raise _not_durable()
        if loop is not self._loop:  # a caller on another event loop (thread): forward
            if not self._loop.is_running():
                raise ServiceUnavailable("The lease store's event loop is not running")
            forwarded = asyncio.run_coroutine_threadsafe(self._submit(command, task), self._loop)
            return await asyncio.wrap_future(forwarded)
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append(_Op(command, task, future))
        if not self._busy:
            self._busy = True
            self._idle.clear()
            # On the next turn of the loop: what arrives meanwhile joins the batch.
            loop.call_soon(self._next)
        self._deadlines.watch(future)
        return await future

    def _next(self) -> None:
        """On the event loop: start the next batch, or leave the connection idle.

        Consecutive lease commands (up to ``max_batch``) are decided here, inside a
        ``BEGIN IMMEDIATE`` taken without waiting, and the thread commits them. A task,
        or commands that found another connection holding the write lock, go to the
        thread whole, which waits for the lock there, never on the loop.
        """
        pending = self._pending
        while pending and pending[0].future.done():  # timed out while queued
            pending.popleft()
        if self._failed is not None:  # nothing more is written: see the module's docstring
            while pending:
                settle(pending.popleft().future, _not_durable())
        if not pending:
            self._busy = False
            self._idle.set()
            return
        checkpointer = self._checkpointer
        if checkpointer is not None and checkpointer.behind:  # catch_up clears it
            self._jobs.put((_CATCH_UP, []))
            return
        if pending[0].command is None:
            self._jobs.put((_WHOLE, [pending.popleft()]))
            return
        batch: list[_Op] = []
        while pending and len(batch) < self._max_batch and pending[0].command is not None:
            batch.append(pending.popleft())
        conn = self._conn
        assert conn is not None
        try:
            conn.execute("BEGIN IMMEDIATE")  # busy_timeout is 0 on this connection
        except sqlite3.Error:
            self._jobs.put((_WHOLE, batch))
            return
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
                error: LeaseError = _write_failed()
            elif isinstance(exc, Exception):  # a bug: its waiters must not hang
                log.exception("SQLite batch of %d operations failed", len(batch))
                error = InternalError()
            else:
                raise
            for op in batch:
                settle(op.future, error)
        else:
            self._make_durable(results)
        # The connection is free again: what arrived meanwhile is the next batch (on the
        # next turn of the loop, not by recursion).
        asyncio.get_running_loop().call_soon(self._next)

    def _answer(self, results: _Results) -> None:
        """On the event loop: answer batches the thread has made durable."""
        for op, outcome in results:
            settle(op.future, outcome)

    def _finished(self, results: _Results) -> None:
        """On the event loop: the thread is done with the connection; what it ran whole
        is answered once it is durable."""
        if results:
            self._make_durable(results)
        self._next()

    def _make_durable(self, results: _Results) -> None:
        """On the event loop: have the syncer fsync the WAL, then answer ``results``
        (a batch just committed: one fsync covers every COMMIT made before it)."""
        self._unsynced.append(results)
        if self._failed is not None or self._syncer is None:
            self._fail_unsynced()
        else:
            self._syncer.request()

    def _synced(self, batches: int) -> None:
        """On the event loop: the syncer made the oldest ``batches`` batches durable."""
        for _ in range(batches):
            self._answer(self._unsynced.popleft())
        if self._checkpointer is not None:
            self._checkpointer.poke()

    def _sync_failed(self, error: Exception, kind: str) -> None:
        """On the event loop: the syncer could not make the WAL durable (``kind``: the
        files were moved, the fsync failed, the syncer ended); refuse what waits for it
        and, from now on, everything (``_failed``), and say so once."""
        if self._failed is None:
            self._failed = error
            if kind == _syncer.MOVED.decode():
                _log_moved(str(error))
            elif kind == _syncer.FSYNC_FAILED.decode():
                log.critical(
                    "fsync of the SQLite WAL failed (%s): the lease store refuses every "
                    "request until leasekeeper is restarted; check the disk first",
                    error,
                )
            else:
                log.critical(
                    "the SQLite store's fsync %s: the lease store refuses every request "
                    "until leasekeeper is restarted",
                    error,
                )
        self._fail_unsynced()

    def _fail_unsynced(self) -> None:
        while self._unsynced:
            for op, _ in self._unsynced.popleft():
                settle(op.future, _not_durable())

    def _sync_thread(
        self, loop: asyncio.AbstractEventLoop, ready: asyncio.Future[sqlite3.Connection]
    ) -> None:
        """The thread: opens the connection, then COMMITs and runs whole batches."""
        try:
            conn = self._connect()
        except (sqlite3.Error, OSError, RuntimeError, ValueError) as exc:  # ValueError: a NUL
            error = ServiceUnavailable(f"Cannot open the SQLite store at {self.path}: {exc}")
            loop.call_soon_threadsafe(settle, ready, error)
            return
        checkpointer = _Checkpointer(self.path, self._timeout)
        if not checkpointer.start():
            # SQLite's own, in the COMMITs: the loop's, which then wait for each checkpoint.
            conn.execute("PRAGMA wal_autocheckpoint = 1000")
        self._checkpointer = checkpointer
        loop.call_soon_threadsafe(settle, ready, conn)
        try:
            while (job := self._jobs.get()) is not None:
                kind, batch = job
                results: _Results = []
                if kind == _WHOLE:
                    try:
                        results = self._run_batch(conn, batch)
                    except Exception:  # never let the thread die: its waiters would hang
                        log.exception("SQLite writer failed a batch of %d operations", len(batch))
                        results = [(op, InternalError()) for op in batch]
                        with contextlib.suppress(sqlite3.Error):
                            if conn.in_transaction:  # nothing of the batch is kept
                                conn.execute("ROLLBACK")
                else:
                    checkpointer.catch_up(conn)
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    # The loop may use the connection again; it has the results fsynced.
                    loop.call_soon_threadsafe(self._finished, results)
        finally:
            checkpointer.stop()
            conn.close()
            os.close(self._wal_fd)

    def _connect(self) -> sqlite3.Connection:
        if sqlite3.sqlite_version_info < _OLDEST_SQLITE:
            # Refused before any file is made: every batch's upsert would fail instead.
            oldest = ".".join(map(str, _OLDEST_SQLITE))
            raise RuntimeError(
                f"this Python's SQLite is {sqlite3.sqlite_version}; leasekeeper needs "
                f"{oldest} or later (for its upserts): use a Python built with a newer SQLite"
            )
        conn = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, cached_statements=64
        )
        try:
            self._set_up(conn)
        except BaseException:  # a file that is no database, a lock not taken: not left to the GC
            conn.close()
            raise
        return conn

    def _set_up(self, conn: sqlite3.Connection) -> None:
        """Make ``conn`` the writer's: WAL mode, the schema, the WAL's file descriptor."""
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute(f"PRAGMA cache_size = {_CACHE_KIB}")
        # Checkpoints run on a thread of their own (_Checkpointer), never inside a COMMIT.
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute(f"PRAGMA journal_size_limit = {_WAL_KEEP_BYTES}")
        conn.execute(f"PRAGMA busy_timeout = {int(self._timeout * 1000)}")
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            created = conn.execute(
                "INSERT OR IGNORE INTO meta (name, value) VALUES ('schema_version', ?)",
                (SCHEMA_VERSION,),
            ).rowcount
            (version,) = conn.execute(
                "SELECT value FROM meta WHERE name = 'schema_version'"
            ).fetchone()
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.path} has schema version {version}; this leasekeeper "
                    f"knows up to {SCHEMA_VERSION}: upgrade leasekeeper"
                )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if created:  # a server started in another directory than usual shows here
            log.info("created a new, empty store at %s", self.path.resolve())
        # The event loop takes the write lock without waiting (SqliteStore._next); the
        # thread sets the timeout around its own BEGIN (_run_batch).
        conn.execute("PRAGMA busy_timeout = 0")
        # From here a COMMIT writes the WAL without an fsync, and the syncer fsyncs it
        # before any answer (_make_durable). NORMAL still syncs the WAL's header when the WAL
        # starts over, and both files around each checkpoint, as FULL does.
        conn.execute("PRAGMA synchronous = NORMAL")
        # The WAL exists from the first read in WAL mode on, for as long as we are open.
        # The file's identity first: once the WAL's descriptor is open nothing may fail.
        database = str(self.path.resolve())
        found = os.stat(database)
        self._wal_fd = os.open(f"{database}-wal", os.O_RDONLY)
        wal = os.fstat(self._wal_fd)
        self._files = [
            (database, (found.st_dev, found.st_ino)),
            (f"{database}-wal", (wal.st_dev, wal.st_ino)),
        ]

    def _refuse_moved(self) -> bool:
        """On the thread (a ping): if the files were deleted or replaced, refuse
        everything from now on (``_failed``, as after a failed fsync) and say so once;
        whether they were. The syncer checks the same before every fsync."""
        if self._failed is not None:
            return True
        moved = _syncer.moved(self._wal_fd, self._files)
        if moved is None:
            return False
        self._failed = RuntimeError(moved)
        _log_moved(moved)
        return True

    def _run_batch(self, conn: sqlite3.Connection, batch: list[_Op]) -> _Results:
        """On the thread: one whole transaction, waiting up to the timeout for the lock."""
        results: _Results = []
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._timeout * 1000)}")
            try:
                conn.execute("BEGIN IMMEDIATE")
            finally:
                conn.execute("PRAGMA busy_timeout = 0")
            try:
                if batch[0].command is None:
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
            results = [(op, error) for op in batch]
        return results

    def _refused(self, exc: sqlite3.Error) -> None:
        """Note a refusal for readiness when ``exc`` says the file cannot be written at
        all (no room, a failing device, a read-only or damaged file), not when it is one
        transaction's trouble (a lock held too long)."""
        if _primary_code(exc) in _REFUSING:
            self._refusals.refused(str(exc))

    def _decide_in_transaction(
        self, conn: sqlite3.Connection, batch: list[_Op], results: _Results
    ) -> None:
        """Decide ``batch`` (lease commands) and write the fencing counter they moved."""
        (start,) = conn.execute(_READ_FENCE).fetchone()
        fence = start

        def next_fence() -> int:
            nonlocal fence
            fence += 1
            return int(fence)

        self._decide_all(conn, batch, next_fence, results)
        if fence != start:
            conn.execute("UPDATE meta SET value = ? WHERE name = 'fence'", (fence,))

    def _decide_all(
        self,
        conn: sqlite3.Connection,
        ops: list[_Op],
        next_fence: Callable[[], int],
        results: list[tuple[_Op, Any]],
    ) -> None:
        """Decide ``ops`` (lease commands) in order, as if each ran alone.

        Their records are read with one statement; each decision sees the records as
        the ones before it left them (two commands on one key decide in turn), and
        the last state of every changed record is written with one statement.
        """
        live = [op for op in ops if op.command is not None and not op.future.done()]
        commands = [op.command for op in live if op.command is not None]  # (all of them)
        keys = list(dict.fromkeys(command.key_id for command in commands))
        records: dict[bytes, LeaseRecord] = {}
        for at in range(0, len(keys), _SELECT_CHUNK):
            chunk = keys[at : at + _SELECT_CHUNK]
            blobs = [bytearray(key) for key in chunk]  # not bytes: see _upsert
            for row in conn.execute(_select_many(len(chunk)), blobs):
                records[row[0]] = LeaseRecord(*row)
        outcomes, writes = decide_in_turn(commands, records, self._clock.now_ms, next_fence)
        results.extend(zip(live, outcomes, strict=True))
        rows: dict[_Nulls, list[list[object]]] = {}
        for record in writes.values():  # one record per key: their order does not matter
            nulls, params = _params(record)
            rows.setdefault(nulls, []).append(params)
        for nulls, same in rows.items():
            conn.executemany(_upsert(nulls), same)

    @staticmethod
    def _run_task(
        conn: sqlite3.Connection,
        op: _Op,
        results: list[tuple[_Op, Any]],
    ) -> None:
        if op.future.done() or op.task is None:
            return
        try:
            results.append((op, op.task(conn)))
        except sqlite3.Error:
            raise
        except LeaseError as exc:
            results.append((op, exc))
        except Exception:
            log.exception("SQLite task failed")
            results.append((op, InternalError()))


class _Checkpointer:
    """Copies the WAL into the database file, on a thread and connection of its own.

    SQLite's automatic checkpoint runs inside the COMMIT that takes the WAL past 1,000
    pages: that batch of requests waits while pages are copied and the database file
    is fsynced, tens of milliseconds that made most of the p99 under load. Instead the
    writer's thread pokes this one after every fsync of the WAL, and it runs a PASSIVE
    checkpoint (which never waits for, nor blocks, the writer) at most every
    ``interval`` seconds.

    A WAL starts over only when a write begins while every frame is checkpointed, which
    a busy writer never allows, so the WAL would grow without end. Once it holds more
    than ``_WAL_RESTART_FRAMES`` pages, the writer itself copies, between two batches,
    the few frames committed while this thread's pass ran (``catch_up``), and its next
    write starts the WAL over. Every checkpoint syncs the WAL before copying and the
    database file after (at ``synchronous=NORMAL`` as at ``FULL``), so a crash at any
    point loses nothing acknowledged.

    The writer waits for its catch-up, so it must stay short: it copies what was
    committed during this thread's last pass, and a pass is shorter the more often
    passes run. With a million records and passes every 0.1 s, each catch-up took
    about 45 ms and acquires had a p99 of 43 ms; every 0.02 s, about 5 ms and 11 ms.
    """

    def __init__(self, path: Path, timeout: float, interval: float = 0.02) -> None:
        self._path = path
        self._timeout = timeout
        self._interval = interval
        self._wake = threading.Event()
        self._stopping = threading.Event()
        #: The WAL is long and a pass has just copied all but its newest frames: the
        #: writer should copy those itself, between two batches (``catch_up``).
        self.behind = False
        self._thread = threading.Thread(
            target=self._run, name="leasekeeper-sqlite-checkpoint", daemon=True
        )

    def start(self) -> bool:
        """Connect and start the thread; False (and logged) when it cannot connect."""
        conn: sqlite3.Connection | None = None
        try:
            conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute(f"PRAGMA busy_timeout = {int(self._timeout * 1000)}")
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            log.warning("SQLite checkpoints stay in the writer's commits: %s", exc)
            return False
        self._conn = conn
        self._thread.start()
        return True

    def poke(self) -> None:
        """Something was committed: checkpoint soon."""
        self._wake.set()

    def catch_up(self, conn: sqlite3.Connection) -> None:
        """On the writer's connection, between batches: finish the checkpoint so that the
        next write starts the WAL over."""
        if not self.behind:
            return
        self.behind = False
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as exc:
            log.warning("SQLite checkpoint failed: %s", exc)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        conn = self._conn
        try:
            while True:
                self._wake.wait()
                if self._stopping.is_set():
                    return
                self._wake.clear()
                try:
                    _, frames, _ = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    self.behind = frames > _WAL_RESTART_FRAMES
                except sqlite3.Error as exc:
                    log.warning("SQLite checkpoint failed: %s", exc)
                if self._stopping.wait(self._interval):
                    return
        finally:
            conn.close()


class _Syncer:
    """The event loop's end of the WAL's fsync (``_syncer``: why, and the protocol).

    The fsync runs in a process of its own (``python -I -S _syncer.py``), or, where
    none can be started, on a thread of this one (logged). ``request()`` asks for an
    fsync that covers a batch just committed; fsyncs are answered in order, by
    ``durable(count)`` for the oldest ``count`` batches asked for, or else once by
    ``failed(error, kind)`` (``kind``: ``"M"`` for moved files, ``"F"`` for a failed
    fsync, ``""`` for a syncer that ended first), after which nothing is answered.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        durable: Callable[[int], None],
        failed: Callable[[Exception, str], None],
    ) -> None:
        self._loop = loop
        self._durable = durable
        self._failed = failed
        self._process: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._requests = self._replies = -1
        #: Batches asked for that did not fit in the pipe yet (``request``).
        self._owed = 0
        #: What came after the last ``.``: a failure's line, perhaps not whole yet.
        self._tail = b""
        self._closing = False
        #: ``_readable`` is called when answers come (``_connect`` got that far).
        self._reading = False
        self._ended: asyncio.Future[None] = loop.create_future()

    @classmethod
    async def start(
        cls,
        loop: asyncio.AbstractEventLoop,
        wal: int,
        files: list[tuple[str, tuple[int, int]]],
        durable: Callable[[int], None],
        failed: Callable[[Exception, str], None],
        *,
        process: bool,
        first_fsync_within: float,
    ) -> _Syncer:
        """A syncer for the WAL open as ``wal``, whose first fsync has been answered: one
        that cannot fsync refuses the store's start (``ServiceUnavailable``), not its
        first request. A process that cannot be started, or that ends or says nothing
        for ``first_fsync_within`` seconds before its first fsync (no working Python),
        leaves the fsync to a thread, with a warning."""

        async def greeted(in_process: bool) -> _Syncer:
            syncer = cls(loop, durable, failed)
            await syncer._greet(wal, files, in_process, first_fsync_within)
            return syncer

        if process:
            try:
                return await greeted(True)
            except _NoProcess as exc:
                log.warning("the SQLite WAL is fsynced on a thread: %s", exc)
        return await greeted(False)

    async def _greet(
        self, wal: int, files: list[tuple[str, tuple[int, int]]], process: bool, within: float
    ) -> None:
        """Connect, and wait for the first fsync; the callbacks are the store's after."""
        durable, failed = self._durable, self._failed
        first: asyncio.Future[tuple[Exception, str] | None] = self._loop.create_future()

        def greeted(count: int) -> None:
            if not first.done():
                first.set_result(None)

        def refused(error: Exception, kind: str) -> None:
            if not first.done():
                first.set_result((error, kind))

        self._durable, self._failed = greeted, refused
        try:
            self._connect(wal, files, process)
            self.request()
            refusal = await asyncio.wait_for(asyncio.shield(first), within)
        except TimeoutError:
            await self.close(kill=True)
            if process:
                raise _NoProcess(f"its process said nothing within {within:g} s") from None
            raise ServiceUnavailable(
                f"Cannot fsync the SQLite store's WAL: no fsync within {within:g} s"
            ) from None
        except (OSError, RuntimeError) as exc:  # no descriptors for its pipes, no threads
            await self.close(kill=True)
            raise ServiceUnavailable(f"Cannot start the SQLite store's fsync: {exc}") from None
        except BaseException:
            await self.close(kill=True)
            raise
        if refusal is not None:
            error, kind = refusal
            await self.close()
            if process and not kind:
                raise _NoProcess(f"its process ended before its first fsync ({error})")
            raise ServiceUnavailable(f"Cannot fsync the SQLite store's WAL: {error}")
        self._durable, self._failed = durable, failed

    def _connect(self, wal: int, files: list[tuple[str, tuple[int, int]]], process: bool) -> None:
        """The pipes, then the process or thread at their other end, then our reader;
        whatever fails on the way leaves nothing of its own open (``close`` the rest)."""
        theirs: list[int] = []
        try:
            requests, self._requests = os.pipe()
            theirs.append(requests)
            self._replies, replies = os.pipe()
            theirs.append(replies)
            if process:
                self._process = self._spawn(requests, replies, wal, files)
            else:
                theirs.append(os.dup(wal))
                thread = threading.Thread(
                    target=_serve_on_thread,
                    args=(requests, replies, theirs[-1], files),
                    name="leasekeeper-sqlite-fsync",
                    daemon=True,
                )
                thread.start()
                self._thread, theirs = thread, []  # it closes them when it ends
            os.set_blocking(self._requests, False)
            os.set_blocking(self._replies, False)
            self._loop.add_reader(self._replies, self._readable)
            self._reading = True
        finally:
            for fd in theirs:
                os.close(fd)

    @staticmethod
    def _spawn(
        requests: int, replies: int, wal: int, files: list[tuple[str, tuple[int, int]]]
    ) -> subprocess.Popen[bytes]:
        script = _syncer.__file__
        if not sys.executable or not script or not script.endswith(".py"):
            raise _NoProcess(f"no Python to run {script}")
        argv = [sys.executable, "-I", "-S", script, *_syncer.arguments(wal, files)]
        try:
            # argv: this Python, our own script, numbers and the store's paths: no shell
            return subprocess.Popen(argv, stdin=requests, stdout=replies, pass_fds=(wal,))  # noqa: S603
        except OSError as exc:
            raise _NoProcess(f"no process started ({exc})") from None

    @property
    def pid(self) -> int | None:
        """The syncer's process, if it is one."""
        return None if self._process is None else self._process.pid

    def request(self) -> None:
        """Ask for an fsync covering every COMMIT so far (answered by ``durable``)."""
        if self._requests < 0:
            return  # closed: close() answers nothing more, the store refuses what waits
        if self._owed:
            self._owed += 1
            return
        try:
            os.write(self._requests, _syncer.BATCH)
        except BlockingIOError:  # the pipe holds 64 KiB of batches: sent with the next answer
            self._owed = 1
        except OSError:  # BrokenPipeError: the syncer has gone
            self._end(RuntimeError(self._how_it_ended()))

    def _readable(self) -> None:
        try:
            data = os.read(self._replies, _syncer.READ_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            self._end(RuntimeError(f"pipe failed ({exc.strerror})"))
            return
        if not data:
            self._end(RuntimeError(self._how_it_ended()))
            return
        if not self._tail:
            synced = len(data) - len(data.lstrip(_syncer.BATCH))
            data = data[synced:]
            if synced:
                self._answer(synced)
        self._tail += data
        if b"\n" in self._tail:
            self._report(self._tail)

    def _answer(self, synced: int) -> None:
        if self._owed:
            owed, self._owed = self._owed, 0
            while owed:  # (answers come only while no failure line has begun)
                try:
                    owed -= os.write(self._requests, _syncer.BATCH * owed)
                except BlockingIOError:
                    break
                except OSError:
                    break  # the syncer has gone: its end of file follows
            self._owed = owed
            if self._closing and not owed:
                self._close_requests()  # close() waited for the owed to be sent
        self._durable(synced)

    def _report(self, line: bytes) -> None:
        """The syncer's line before it ends: a failure to report, once."""
        kind, text = line[:1], line[1:].partition(b"\n")[0]
        if kind == _syncer.FSYNC_FAILED:
            number, _, message = text.partition(b" ")
            error: Exception = OSError(
                int(number) if number.isdigit() else 0, message.decode("utf-8", "replace")
            )
        elif kind == _syncer.MOVED:
            error = RuntimeError(text.decode("utf-8", "surrogateescape"))
        else:
            error = RuntimeError(f"process said {line[:200]!r}")
        self._end(error, kind.decode("ascii", "replace"))

    def _how_it_ended(self) -> str:
        """For the log: the process's exit status tells a crash from a kill (-9: the
        OOM killer, say). Its pipe closes just before it can be reaped, so this waits
        for that a moment (on the loop, but only once: the syncer has gone)."""
        if self._process is None:
            return "thread ended"
        with contextlib.suppress(subprocess.TimeoutExpired):
            return f"process ended (exit status {self._process.wait(0.1)})"
        return "process ended"

    def _end(self, error: Exception, kind: str = "") -> None:
        """No more answers: tell the store why, unless the store itself closed us."""
        if self._ended.done():
            return
        with contextlib.suppress(RuntimeError, ValueError, OSError):  # a loop already closed
            self._loop.remove_reader(self._replies)
        self._ended.set_result(None)
        if not self._closing or kind:
            self._failed(error, kind)

    def _close_requests(self) -> None:
        if self._requests >= 0:
            os.close(self._requests)
            self._requests = -1

    async def close(self, *, kill: bool = False) -> None:
        """End the syncer once it has answered what it was asked (batches still owed
        are sent first), and wait for its process or thread; with ``kill``, at once."""
        self._closing = True
        on_loop = asyncio.get_running_loop() is self._loop
        if kill or not self._owed or not on_loop:
            self._close_requests()  # else _answer closes it once the owed are sent
        if self._process is not None and kill:
            self._process.kill()
        if on_loop and self._reading and not kill and not self._ended.done():
            await asyncio.shield(self._ended)
        else:  # killed, never started, or not on the loop that reads: nobody waits
            self._end(RuntimeError("closed"))
        self._close_requests()
        if self._process is not None:
            # Killed, it may still be in an fsync that waits for a hung disk, where no
            # signal reaches it: not waited for long (subprocess reaps it later).
            wait = functools.partial(self._process.wait, _KILLED_WAIT if kill else None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.get_running_loop().run_in_executor(None, wait)
        if self._thread is not None and not kill:  # (killed: it may be stuck in an fsync)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        if self._replies >= 0:
            os.close(self._replies)
            self._replies = -1


#: How long ``_Syncer.close(kill=True)`` waits for its killed process, in seconds.
_KILLED_WAIT = 1.0


class _NoProcess(Exception):
    """The syncer's process could not be started, or did not work: use a thread."""


def _serve_on_thread(
    requests: int, replies: int, wal: int, files: list[tuple[str, tuple[int, int]]]
) -> None:
    """``_syncer.serve`` on a thread, with descriptors of its own that it closes."""
    try:
        _syncer.serve(requests, replies, wal, files)
    except Exception:  # the store hears of it as the end of the replies
        log.exception("the SQLite WAL's fsync thread failed")
    finally:
        for fd in (requests, replies, wal):
            os.close(fd)
