"""The SQLite writer decides a batch of queued commands together: as if one by one.

Commands submitted together (``asyncio.gather``) reach the writer thread in
submission order and, usually, in one batch: one read of their records, the rules
run for each in turn, one write of every changed record, one commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from leasekeeper import FakeClock, InternalError, OutcomeUnknown, ServiceUnavailable
from leasekeeper._core.model import (
    Acquire,
    Complete,
    CompletedOutcome,
    Granted,
    Held,
    LeaseRecord,
    Release,
    Released,
    Renew,
    Renewed,
)
from leasekeeper.store import _syncer
from leasekeeper.store._sqlite import SqliteStore
from leasekeeper.store._sqlite_sql import SCHEMA, SELECT_CHUNK, params, select_many, upsert
from tests.conftest import not_ready_until_the_hold_ends

TTL = 60_000
LIFECYCLE = 86_400_000


def new_id() -> bytes:
    return secrets.token_bytes(32)


def queue_acquire(store: SqliteStore) -> asyncio.Future[Any]:
    """An acquire of a new key on ``store``, queued now, answered later."""
    return asyncio.ensure_future(store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE)))


def test_commands_on_one_key_in_one_batch_see_each_other(tmp_path: Path) -> None:
    """acquire, renew, complete, then a replay: each decided on the record the previous left."""
    clock = FakeClock()

    async def main() -> None:
        store = SqliteStore(tmp_path / "b.db", clock)
        await store.open()
        key, owner, fingerprint = new_id(), new_id(), new_id()
        decisions = await asyncio.gather(
            store.apply(Acquire(key, fingerprint, TTL, owner, LIFECYCLE)),
            store.apply(Renew(key, owner, 2 * TTL)),
            store.apply(Complete(key, owner, '{"n":1}')),
            store.apply(Acquire(key, fingerprint, TTL, new_id(), LIFECYCLE)),
            store.ping(),
        )
        granted, renewed, completed, replay = (d.outcome for d in decisions[:4])
        assert isinstance(granted, Granted)
        assert isinstance(renewed, Renewed)
        assert renewed.record.lease_expires_ms == granted.now_ms + 2 * TTL
        assert isinstance(completed, CompletedOutcome)
        assert isinstance(replay, CompletedOutcome)
        assert replay.record.result == '{"n":1}'
        assert replay.record.fencing_token == granted.record.fencing_token
        await store.close()

        reopened = SqliteStore(tmp_path / "b.db", clock)  # what was committed
        await reopened.open()
        again = await reopened.apply(Acquire(key, fingerprint, TTL, new_id(), LIFECYCLE))
        assert isinstance(again.outcome, CompletedOutcome)
        assert again.outcome.record == completed.record
        await reopened.close()

    asyncio.run(main())


def test_a_batch_reads_records_written_by_earlier_batches(tmp_path: Path) -> None:
    """Keys held from before, with and without a command of another key in between."""
    clock = FakeClock()

    async def main() -> None:
        store = SqliteStore(tmp_path / "r.db", clock)
        await store.open()
        keys, owners = [new_id() for _ in range(3)], [new_id() for _ in range(3)]
        for key, owner in zip(keys, owners, strict=True):
            decision = await store.apply(Acquire(key, None, TTL, owner, LIFECYCLE))
            assert isinstance(decision.outcome, Granted)
        decisions = await asyncio.gather(
            store.apply(Release(keys[0], owners[0])),
            store.apply(Acquire(keys[1], None, TTL, new_id(), LIFECYCLE)),
            store.purge(100),
            store.apply(Renew(keys[2], owners[2], TTL)),
            store.apply(Acquire(keys[0], None, TTL, new_id(), LIFECYCLE)),
        )
        assert isinstance(decisions[0].outcome, Released)
        assert isinstance(decisions[1].outcome, Held)
        assert decisions[2] == (0, None)  # nothing finished, and the walk is over
        assert isinstance(decisions[3].outcome, Renewed)
        regranted = decisions[4].outcome
        assert isinstance(regranted, Granted)
        assert regranted.record.fencing_token == 4  # three grants before it, one counter
        assert store.fencing_counter() == 4
        await store.close()

    asyncio.run(main())


def test_a_batch_of_more_keys_than_one_read_takes_finds_every_record(tmp_path: Path) -> None:
    """A batch's records are read ``SELECT_CHUNK`` keys at a time: in a batch of more
    keys than that, every key's record is found, the ones at the chunks' edges too, so
    no live lease is taken for a new lifecycle (a second owner) under load."""
    clock = FakeClock()
    count = SELECT_CHUNK + 10

    async def main() -> None:
        store = SqliteStore(tmp_path / "k.db", clock, max_batch=2 * SELECT_CHUNK)
        await store.open()
        keys = [new_id() for _ in range(count)]
        first = await asyncio.gather(
            *(store.apply(Acquire(key, None, TTL, new_id(), LIFECYCLE)) for key in keys)
        )
        assert all(isinstance(d.outcome, Granted) for d in first)
        again = await asyncio.gather(  # one batch: all of them queued in one turn
            *(store.apply(Acquire(key, None, TTL, new_id(), LIFECYCLE)) for key in keys)
        )
        held = [i for i, d in enumerate(again) if isinstance(d.outcome, Held)]
        assert held == list(range(count))
        assert [d.outcome.record for d in again] == [d.outcome.record for d in first]
        assert store.fencing_counter() == count
        await store.close()

    asyncio.run(main())


@pytest.mark.parametrize("lock_elsewhere", [False, True], ids=["on the loop", "on the thread"])
def test_a_request_whose_caller_is_gone_is_left_out_of_its_batch(
    tmp_path: Path, lock_elsewhere: bool
) -> None:
    """A queued request whose caller gave up (cancelled here; a deadline passed does the
    same) before its batch was decided gets no decision: no lease is granted whose
    token nobody holds, no fence is drawn for it, and the requests around it in the
    batch get their own decisions. Decided on the loop, or on the thread when another
    connection holds the write lock."""
    path = tmp_path / "g.db"
    clock = FakeClock()

    async def main() -> None:
        store = SqliteStore(path, clock)
        await store.open()
        keys = [new_id() for _ in range(3)]
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
            if lock_elsewhere:
                other.execute("BEGIN IMMEDIATE")
            calls = [
                asyncio.ensure_future(store.apply(Acquire(key, None, TTL, new_id(), LIFECYCLE)))
                for key in keys
            ]
            await asyncio.sleep(0)  # all three are queued, and none is decided yet
            assert len(store._batcher.pending) == 3 and not any(call.done() for call in calls)
            calls[1].cancel()
            if lock_elsewhere:
                await asyncio.sleep(0)  # the batch goes to the thread, to wait for the lock
                assert not store._batcher.pending and not calls[0].done()
                other.execute("COMMIT")
            first, third = await calls[0], await calls[2]
        with pytest.raises(asyncio.CancelledError):
            await calls[1]
        for decision, key in ((first, keys[0]), (third, keys[2])):
            assert isinstance(decision.outcome, Granted)
            assert decision.outcome.record.key_id == key
        assert store.fencing_counter() == 2
        retried = await store.apply(Acquire(keys[1], None, TTL, new_id(), LIFECYCLE))
        assert isinstance(retried.outcome, Granted)  # the key was never taken
        assert retried.outcome.record.fencing_token == 3
        await store.close()

    asyncio.run(main())


def test_checkpoints_copy_the_wal_into_the_database_file_off_the_writer(tmp_path: Path) -> None:
    """The writer never checkpoints by itself (no COMMIT waits for one); the checkpoint
    thread copies committed pages into the database file soon after they are written."""
    clock = FakeClock()
    path = tmp_path / "c.db"

    def rows_in_database_file() -> int:
        # immutable=1 reads the database file alone, ignoring the WAL, and without
        # locks: caught in the middle of a checkpoint it may see a half-copied file
        # ("malformed"), which only means "not yet"; the file is checked whole below.
        uri = f"{path.resolve().as_uri()}?immutable=1"
        try:
            with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
                (count,) = conn.execute("SELECT count(*) FROM leases").fetchone()
                return int(count)
        except sqlite3.DatabaseError:
            return -1

    async def main() -> None:
        store = SqliteStore(path, clock)
        await store.open()
        for _ in range(50):
            decision = await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
            assert isinstance(decision.outcome, Granted)
        deadline = time.monotonic() + 10
        while rows_in_database_file() < 50:  # a real thread: wait for it, within bounds
            assert time.monotonic() < deadline, "no checkpoint within 10 s"
            await asyncio.sleep(0.02)
        await store.close()

    asyncio.run(main())
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert conn.execute("SELECT count(*) FROM leases").fetchone() == (50,)


def test_an_unforeseen_failure_of_a_batch_is_internal_and_the_writer_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug inside the writer's batch answers its requests 500 internal (nothing is
    left waiting) and the writer serves the next batch."""
    clock = FakeClock()
    real = SqliteStore._decide_all
    calls = 0

    def fails_once(self: SqliteStore, *args: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug")
        real(self, *args)

    monkeypatch.setattr(SqliteStore, "_decide_all", fails_once)

    async def main() -> None:
        store = SqliteStore(tmp_path / "f.db", clock)
        await store.open()
        with pytest.raises(InternalError):
            await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        decision = await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        assert isinstance(decision.outcome, Granted)
        await store.close()

    asyncio.run(main())


def test_without_the_checkpoint_thread_sqlite_checkpoints_in_its_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the checkpoint connection cannot be set up, it is closed, and the writer
    switches SQLite's own checkpoints back on: the WAL still reaches the database file."""
    from leasekeeper.store import _sqlite

    closed: list[bool] = []
    connect = sqlite3.connect

    class Refusing:
        """The checkpointer's connection: its first PRAGMA fails."""

        def execute(self, *args: Any) -> Any:
            raise sqlite3.OperationalError("disk I/O error")

        def close(self) -> None:
            closed.append(True)

    def connecting(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("check_same_thread") is False and "cached_statements" not in kwargs:
            return Refusing()  # the checkpointer's connect; the writer passes cached_statements
        return connect(*args, **kwargs)

    monkeypatch.setattr(_sqlite.sqlite3, "connect", connecting)
    path = tmp_path / "a.db"
    clock = FakeClock()

    async def main() -> None:
        store = SqliteStore(path, clock)
        await store.open()
        # SQLite checkpoints when a COMMIT takes the WAL past 1,000 pages.
        for _ in range(600):
            decision = await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
            assert isinstance(decision.outcome, Granted)
        monkeypatch.setattr(_sqlite.sqlite3, "connect", connect)
        uri = f"{path.resolve().as_uri()}?immutable=1"  # the database file alone
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
            (in_file,) = conn.execute("SELECT count(*) FROM leases").fetchone()
        assert in_file > 0
        await store.close()

    asyncio.run(main())
    assert closed == [True]


def test_a_write_lock_held_elsewhere_is_waited_for_on_the_thread_not_the_loop(
    tmp_path: Path,
) -> None:
    """Another connection (a cleanup in another process, say) holds the write lock: the
    batch waits for it on the thread while the event loop goes on serving, and is
    decided once the lock is free; held past the timeout, the request gets 503."""
    path = tmp_path / "l.db"
    clock = FakeClock()

    async def main() -> None:
        store = SqliteStore(path, clock, timeout_seconds=2.0)
        await store.open()
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            waiting = queue_acquire(store)
            # The loop is not blocked: 20 turns of 5 ms each take about 100 ms, not 2 s.
            started = time.monotonic()
            for _ in range(20):
                await asyncio.sleep(0.005)
            assert time.monotonic() - started < 1.0
            assert not waiting.done()
            other.execute("COMMIT")
        decision = await waiting
        assert isinstance(decision.outcome, Granted)
        await store.close()

        short = SqliteStore(path, clock, timeout_seconds=0.2)
        await short.open()
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(ServiceUnavailable):
                await short.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
            other.execute("ROLLBACK")
        decision = await short.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        assert isinstance(decision.outcome, Granted)
        await short.close()

    asyncio.run(main())


def test_closing_answers_every_queued_request_and_refuses_new_ones(tmp_path: Path) -> None:
    clock = FakeClock()

    async def main() -> None:
        store = SqliteStore(tmp_path / "c.db", clock)
        await store.open()
        queued = [queue_acquire(store) for _ in range(50)]
        await asyncio.sleep(0)  # each request is queued
        await store.close()
        assert all(isinstance(f.result().outcome, Granted) for f in queued)
        assert store.fencing_counter() == 50
        with pytest.raises(ServiceUnavailable):
            await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))

    asyncio.run(main())


def test_a_request_from_another_event_loop_is_decided_on_the_stores_loop(
    tmp_path: Path,
) -> None:
    """The store decides on the loop that opened it; a caller on another thread's loop
    is forwarded there and gets its answer back, and may close the store from there."""
    clock = FakeClock()
    answers: list[object] = []

    async def main() -> None:
        store = SqliteStore(tmp_path / "t.db", clock, timeout_seconds=1.0)
        await store.open()

        async def apply_and_close() -> None:
            decision = await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
            answers.append(decision.outcome)
            await store.close()

        queued = [queue_acquire(store) for _ in range(20)]
        thread = threading.Thread(target=asyncio.run, args=(apply_and_close(),))
        thread.start()
        await asyncio.get_running_loop().run_in_executor(None, thread.join)
        outcomes = [(await f).outcome for f in queued]
        assert all(isinstance(outcome, Granted) for outcome in outcomes)
        with pytest.raises(ServiceUnavailable):
            await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        assert store.fencing_counter() == 21

    asyncio.run(main())
    assert len(answers) == 1 and isinstance(answers[0], Granted)


def test_a_close_from_another_event_loop_waits_for_the_batches_in_flight(
    tmp_path: Path,
) -> None:
    """Closed from another thread's loop while one batch waits on the thread for a write
    lock held elsewhere and another is queued behind it: the close is carried out on the
    store's own loop, so both batches are decided and committed before the connection
    closes. (Closed where it was called, the thread would stop after the first batch
    and the second would meet a closed connection.)"""
    path = tmp_path / "f.db"
    clock = FakeClock()

    async def main() -> None:
        store = SqliteStore(path, clock, timeout_seconds=5.0)
        await store.open()
        with contextlib.closing(
            sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        ) as other:
            other.execute("BEGIN IMMEDIATE")
            first = [queue_acquire(store) for _ in range(20)]
            for _ in range(3):  # the requests queue, then the batch goes to the thread
                await asyncio.sleep(0)
            assert not store._batcher.pending  # the first batch is on the thread, waiting
            second = [queue_acquire(store) for _ in range(20)]
            await asyncio.sleep(0)
            assert len(store._batcher.pending) == 20  # queued behind it

            async def close_then_free_the_lock() -> None:
                closing = asyncio.ensure_future(store.close())
                await asyncio.sleep(0)  # the close has begun
                other.execute("ROLLBACK")
                await closing

            thread = threading.Thread(target=asyncio.run, args=(close_then_free_the_lock(),))
            thread.start()
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
        outcomes = [(await f).outcome for f in first + second]
        assert all(isinstance(outcome, Granted) for outcome in outcomes)
        assert store.fencing_counter() == 40
        with pytest.raises(ServiceUnavailable):
            await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))

    asyncio.run(main())


@pytest.mark.parametrize("nulls", list(itertools.product((False, True), repeat=4)))
def test_every_shape_of_record_is_written_as_it_is_and_overwrites_any_other(
    nulls: tuple[bool, bool, bool, bool], request: pytest.FixtureRequest
) -> None:
    """Each combination of NULL columns has its own statement (``upsert``): a record
    of each shape reads back equal, whether new or over a record of the opposite shape."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    request.addfinalizer(conn.close)  # Python 3.13's sqlite3 warns of one left to the GC
    conn.executescript(SCHEMA)
    select = select_many(1)

    def record(nulls: tuple[bool, ...], key: bytes) -> LeaseRecord:
        fingerprint, owner, completed, result = nulls
        return LeaseRecord(
            key,
            None if fingerprint else new_id(),
            1_000,
            7,
            None if owner else new_id(),
            500,
            None if completed else 900,
            None if result else '{"n":1}',
            400,
        )

    for before in (None, tuple(not null for null in nulls)):
        key = new_id()
        if before is not None:
            conn.execute(upsert(params(record(before, key))[0]), params(record(before, key))[1])
        wanted = record(nulls, key)
        shape, bound = params(wanted)
        assert shape == nulls
        conn.execute(upsert(shape), bound)
        assert [LeaseRecord(*row) for row in conn.execute(select, (key,))] == [wanted]


def test_the_writer_binds_no_bytes_and_no_none(tmp_path: Path) -> None:
    """Python 3.11's sqlite3 looks for an adapter (and formats an AttributeError) for
    each bound ``bytes`` or ``None``: a batch binds neither (``upsert``)."""
    bound: list[object] = []

    class Recording(sqlite3.Connection):
        def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
            bound.extend(parameters)
            return super().execute(sql, parameters)

        def executemany(self, sql: str, rows: Any, /) -> sqlite3.Cursor:
            rows = list(rows)
            for row in rows:
                bound.extend(row)
            return super().executemany(sql, rows)

    async def main() -> None:
        store = SqliteStore(tmp_path / "b.db", FakeClock())
        connect = sqlite3.connect

        def recording_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            return connect(*args, **kwargs, factory=Recording)

        with mock.patch.object(sqlite3, "connect", recording_connect):
            await store.open()
        try:
            key, owner = new_id(), new_id()
            await store.apply(Acquire(key, None, TTL, owner, LIFECYCLE))
            await store.apply(Acquire(new_id(), new_id(), TTL, new_id(), LIFECYCLE))
            await store.apply(Complete(key, owner, '{"n":1}'))
            await store.apply(Acquire(key, None, TTL, new_id(), LIFECYCLE))
        finally:
            await store.close()

    asyncio.run(main())
    assert bound  # the recording saw the batches' parameters
    assert [value for value in bound if value is None or isinstance(value, bytes)] == []


class GatedFsync:
    """Stands in for the WAL's fsync (``_syncer.sync_data``) of a store made with
    ``fsync_process=False``, whose syncer runs on a thread of the test's process. Once
    ``armed`` (after the store's open, which has an fsync of its own), each call counts,
    sets ``entered``, waits until the test sets ``release``, then does ``then`` (the
    real fsync unless told otherwise) and counts as ``done``."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, then: Callable[[int], None] | None = None
    ) -> None:
        self.entered, self.release, self.armed = (threading.Event() for _ in range(3))
        self.calls = self.done = 0
        self._real = _syncer.sync_data
        self._then = then or self._real
        monkeypatch.setattr(_syncer, "sync_data", self.sync)

    def sync(self, fd: int) -> None:
        if not self.armed.is_set():
            self._real(fd)
            return
        self.calls += 1
        self.entered.set()
        assert self.release.wait(10), "the test never released the fsync"
        self._then(fd)
        self.done += 1


def test_no_answer_before_the_fsync_of_the_wal_and_the_next_batch_does_not_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch is committed on the loop without an fsync (``synchronous=NORMAL``) and
    answered only after the syncer's fsync of the WAL; meanwhile the loop decides and
    commits the next batch, on what the first one wrote, and answers it (a 409
    included) only after an fsync that began after its COMMIT."""
    path = tmp_path / "d.db"
    gate = GatedFsync(monkeypatch)

    def committed() -> int:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            (count,) = conn.execute("SELECT count(*) FROM leases").fetchone()
            return int(count)

    async def main() -> None:
        store = SqliteStore(path, FakeClock(), fsync_process=False)
        await store.open()
        gate.armed.set()
        key = new_id()
        syncs_at_answer: dict[str, int] = {}

        def queue(name: str, command: Any) -> asyncio.Future[Any]:
            future = asyncio.ensure_future(store.apply(command))
            future.add_done_callback(lambda _: syncs_at_answer.setdefault(name, gate.done))
            return future

        first = queue("first", Acquire(key, None, TTL, new_id(), LIFECYCLE))
        assert await asyncio.to_thread(gate.entered.wait, 10)  # the syncer is in its fsync
        assert committed() == 1 and not first.done()
        held = queue("held", Acquire(key, None, TTL, new_id(), LIFECYCLE))
        other = queue("other", Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        deadline = time.monotonic() + 10
        while committed() < 2:  # the loop commits the next batch while the fsync waits
            assert time.monotonic() < deadline, "the second batch was never committed"
            await asyncio.sleep(0.01)
        assert not (first.done() or held.done() or other.done())
        gate.release.set()
        assert isinstance((await first).outcome, Granted)
        assert isinstance((await held).outcome, Held)
        assert isinstance((await other).outcome, Granted)
        await store.close()
        assert syncs_at_answer["first"] >= 1
        assert syncs_at_answer["held"] >= 2 and syncs_at_answer["other"] >= 2

    asyncio.run(main())


def test_a_batch_that_writes_nothing_waits_for_no_fsync_unless_one_before_it_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal (a key held) writes nothing: with every earlier batch fsynced, it is
    answered with no fsync of its own. Behind a batch still waiting for its fsync it
    waits for that fsync, since what it read may not be durable yet."""
    gate = GatedFsync(monkeypatch)

    async def main() -> None:
        store = SqliteStore(tmp_path / "r.db", FakeClock(), fsync_process=False)
        await store.open()
        key = new_id()
        assert isinstance(
            (await store.apply(Acquire(key, None, TTL, new_id(), LIFECYCLE))).outcome, Granted
        )
        gate.armed.set()  # from now on every fsync waits for the test
        refused = await asyncio.wait_for(
            store.apply(Acquire(key, None, TTL, new_id(), LIFECYCLE)), 10
        )
        assert isinstance(refused.outcome, Held) and gate.calls == 0
        written = queue_acquire(store)
        assert await asyncio.to_thread(gate.entered.wait, 10)
        behind = asyncio.ensure_future(store.apply(Acquire(key, None, TTL, new_id(), LIFECYCLE)))
        for _ in range(50):  # the batch is decided on the loop, a few turns on
            await asyncio.sleep(0)
        assert not behind.done() and not written.done()
        gate.release.set()
        assert isinstance((await behind).outcome, Held)
        assert isinstance((await written).outcome, Granted) and gate.done >= 1
        await store.close()

    asyncio.run(main())


def test_a_batch_whose_fsync_hangs_has_an_unknown_outcome_a_timeout_after_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch committed and waiting for an fsync that does not come (a disk that hangs)
    is not answered 503 at its deadline, as if nothing were written: its write is in the
    file. A timeout later its caller is told the outcome is unknown."""
    gate = GatedFsync(monkeypatch)

    async def main() -> None:
        store = SqliteStore(
            tmp_path / "h.db", FakeClock(), fsync_process=False, timeout_seconds=0.3
        )
        await store.open()
        try:
            gate.armed.set()
            started = time.monotonic()
            waiting = queue_acquire(store)
            assert await asyncio.to_thread(gate.entered.wait, 10)
            with pytest.raises(OutcomeUnknown):
                await waiting
            assert 0.55 < time.monotonic() - started < 2
        finally:
            gate.release.set()
            await store.close()

    asyncio.run(main())


def test_a_batch_that_gets_the_lock_at_its_deadline_is_answered_with_its_decisions(
    tmp_path: Path,
) -> None:
    """The writer's thread waits for a lock held elsewhere until the batch's deadline at
    most; a batch that gets it just before commits and is answered with its grants once
    fsynced, even a little after its deadline (nobody else answers a claimed call)."""
    path = tmp_path / "edge.db"

    async def main() -> None:
        store = SqliteStore(path, FakeClock(), timeout_seconds=0.18)
        await store.open()
        try:
            with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
                other.execute("BEGIN EXCLUSIVE")
                calls = [queue_acquire(store) for _ in range(5)]
                # SQLite's busy handler looks again 178 ms after the lock was found taken.
                await asyncio.sleep(0.15)
                other.execute("COMMIT")
            outcomes = [(await call).outcome for call in calls]
            assert all(isinstance(outcome, Granted) for outcome in outcomes)
        finally:
            await store.close()

    asyncio.run(main())


def test_the_fsync_is_of_the_wal_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the syncer fsyncs before answering is the WAL, where a COMMIT writes: once
    as the store opens (a store that cannot fsync does not open), then for each batch,
    and for each task the thread ran whole."""
    synced: list[str] = []
    fdatasync = os.fdatasync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fdatasync(fd)

    monkeypatch.setattr(_syncer.os, "fdatasync", recording)
    wal = str((tmp_path / "w.db").resolve()) + "-wal"

    async def main() -> None:
        store = SqliteStore(tmp_path / "w.db", FakeClock(), fsync_process=False)
        await store.open()
        assert synced == [wal]
        decision = await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        assert isinstance(decision.outcome, Granted)
        assert synced == [wal, wal]
        await store.purge(100)  # a task runs whole on the thread, and is synced too
        assert synced == [wal, wal, wal]
        await store.close()

    asyncio.run(main())


def test_where_python_has_no_fdatasync_the_wal_is_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python has no ``os.fdatasync`` on macOS (nor on Windows): there the WAL is
    fsynced instead, and requests are answered, not refused as if the disk had failed."""
    synced: list[str] = []
    fsync = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.delattr(_syncer.os, "fdatasync")
    monkeypatch.setattr(_syncer.os, "fsync", recording)

    async def main() -> None:
        store = SqliteStore(tmp_path / "w.db", FakeClock(), fsync_process=False)
        await store.open()
        decision = await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        assert isinstance(decision.outcome, Granted)
        assert synced == [str((tmp_path / "w.db").resolve()) + "-wal"] * 2  # open, acquire
        await store.close()

    asyncio.run(main())


def test_the_fsync_that_answers_a_batch_began_after_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The syncer is asked to make a batch durable only once its COMMIT has written the
    WAL: an fsync that ran while the COMMIT was still being written would not cover
    it, and the batch would be answered before it is on the disk. A slow COMMIT (here,
    0.2 s) gives such an fsync (on a thread, here) every chance to run first."""
    events: list[str] = []
    slow = threading.Event()

    class SlowCommit(sqlite3.Connection):
        def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
            if sql != "COMMIT" or not slow.is_set():
                return super().execute(sql, parameters)
            time.sleep(0.2)  # the GIL is free: the thread may run meanwhile
            cursor = super().execute(sql, parameters)
            events.append("commit")
            return cursor

    sync_data = _syncer.sync_data

    def recording(fd: int) -> None:
        events.append("fsync")
        sync_data(fd)

    monkeypatch.setattr(_syncer, "sync_data", recording)
    connect = sqlite3.connect

    def writer_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        if "cached_statements" in kwargs:  # the writer's connection, not the checkpointer's
            kwargs["factory"] = SlowCommit
        return connect(*args, **kwargs)

    async def main() -> None:
        store = SqliteStore(tmp_path / "s.db", FakeClock(), fsync_process=False)
        with mock.patch.object(sqlite3, "connect", writer_connect):
            await store.open()
        slow.set()
        for _ in range(3):
            events.clear()
            decision = await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
            assert isinstance(decision.outcome, Granted)
            assert events == ["commit", "fsync"]
        await store.close()

    asyncio.run(main())


def test_a_failed_fsync_refuses_its_batches_and_everything_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After a failed fsync the kernel may have dropped the pages it could not write,
    so a later fsync proves nothing: the batches it covered and the batch committed
    while it ran get 503 with an unknown outcome (committed, they may survive or not),
    every later call a plain 503 (nothing written), and no fsync is tried again."""

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    gate = GatedFsync(monkeypatch, then=failing)

    async def main() -> None:
        store = SqliteStore(tmp_path / "e.db", FakeClock(), fsync_process=False)
        await store.open()
        gate.armed.set()
        first = queue_acquire(store)
        assert await asyncio.to_thread(gate.entered.wait, 10)
        second = queue_acquire(store)  # committed on the loop while the fsync runs
        for _ in range(5):
            await asyncio.sleep(0)
        gate.release.set()
        for future in (first, second):
            with pytest.raises(OutcomeUnknown, match="durable"):
                await future
        with pytest.raises(ServiceUnavailable, match="durable") as refused:
            await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        assert not isinstance(refused.value, OutcomeUnknown)
        with pytest.raises(ServiceUnavailable):
            await store.ping()
        await store.close()

    with caplog.at_level(logging.CRITICAL, logger="leasekeeper.store.sqlite"):
        asyncio.run(main())
    assert gate.calls == 1
    assert [r.levelname for r in caplog.records if "fsync" in r.getMessage()] == ["CRITICAL"]


def _break_files(path: Path, how: str) -> None:
    """Delete the store's database or -wal file, or put another database in its place."""
    if how == "database deleted":
        path.unlink()
    elif how == "wal deleted":
        Path(f"{path}-wal").unlink()
    else:
        other = path.with_name("other.db")
        sqlite3.connect(other).close()
        other.replace(path)


async def _refuses_everything(store: SqliteStore) -> None:
    """Every request and the readiness check get 503 (the first and a later request)."""
    with pytest.raises(ServiceUnavailable):
        await store.ping()
    for _ in range(2):
        with pytest.raises(ServiceUnavailable, match="durable"):
            await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))


def _the_one_critical(caplog: pytest.LogCaptureFixture) -> str:
    critical = [r.getMessage() for r in caplog.records if r.levelname == "CRITICAL"]
    assert len(critical) == 1, critical
    return critical[0]


@pytest.mark.parametrize("how", ["database deleted", "wal deleted", "database replaced"])
def test_a_store_whose_files_were_deleted_or_replaced_refuses_everything(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Writes to a store file deleted or replaced under the server would not survive it,
    and after a restart the fencing counter would start again: every request and the
    readiness check get 503 from the next batch on (or the next check, when idle), with
    one CRITICAL saying what to do, until restarted. They had gone on being granted."""
    path = tmp_path / "gone.db"

    async def main() -> None:
        store = SqliteStore(path, FakeClock())
        await store.open()
        first = await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        assert isinstance(first.outcome, Granted)
        _break_files(path, how)
        await _refuses_everything(store)  # idle: found first by the readiness check
        await store.close()

    with caplog.at_level(logging.CRITICAL, logger="leasekeeper.store.sqlite"):
        asyncio.run(main())
    critical = _the_one_critical(caplog)
    assert "deleted or replaced" in critical and "fence --raise-to" in critical


@pytest.mark.parametrize("how", ["database deleted", "wal deleted"])
def test_a_batch_committed_into_deleted_files_is_not_answered_as_done(
    tmp_path: Path, how: str
) -> None:
    """The check runs before a batch is answered: one committed after the file went is
    refused (503), not granted."""
    path = tmp_path / "gone.db"

    async def main() -> None:
        store = SqliteStore(path, FakeClock())
        await store.open()
        await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        _break_files(path, how)
        with pytest.raises(ServiceUnavailable, match="durable"):
            await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        await store.close()

    asyncio.run(main())


def test_a_catch_up_runs_on_the_thread_between_two_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the checkpointer falls behind (a long WAL), the writer's connection copies
    the rest itself: on the thread, before the next batch, which the loop decides
    only after it, and the WAL can start over."""
    from leasekeeper.store._sqlite_sync import Checkpointer

    seen: list[tuple[str, bool, bool]] = []
    catch_up = Checkpointer.catch_up

    def recording(self: Any, conn: sqlite3.Connection) -> None:
        seen.append((threading.current_thread().name, conn.in_transaction, self.behind))
        catch_up(self, conn)

    monkeypatch.setattr(Checkpointer, "catch_up", recording)
    # No passes of the checkpointer's own: one still running when the flag is set below
    # would clear it as it ends (the first acquire's fsync pokes it).
    monkeypatch.setattr(Checkpointer, "poke", lambda self: None)
    path = tmp_path / "r.db"

    async def main() -> None:
        store = SqliteStore(path, FakeClock())
        await store.open()
        await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        assert store._checkpointer is not None
        store._checkpointer.behind = True  # as a pass over a long WAL leaves it
        decisions = await asyncio.gather(*(queue_acquire(store) for _ in range(20)))
        assert all(isinstance(d.outcome, Granted) for d in decisions)
        assert seen == [("leasekeeper-sqlite", False, True)]
        assert not store._checkpointer.behind
        await store.close()

    asyncio.run(main())
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT count(*) FROM leases").fetchone() == (21,)
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_closing_waits_for_the_fsync_of_every_committed_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close while batches are committed but not yet durable answers them once their
    fsync is done, not before, and then stops the syncer and the thread."""
    gate = GatedFsync(monkeypatch)

    async def main() -> None:
        store = SqliteStore(tmp_path / "z.db", FakeClock(), fsync_process=False)
        await store.open()
        gate.armed.set()
        queued = [queue_acquire(store) for _ in range(10)]
        assert await asyncio.to_thread(gate.entered.wait, 10)
        closing = asyncio.ensure_future(store.close())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not closing.done() and not any(f.done() for f in queued)
        gate.release.set()
        await closing
        assert all(isinstance(f.result().outcome, Granted) for f in queued)
        assert store.fencing_counter() == 10

    asyncio.run(main())


def test_failing_batches_are_logged_at_most_once_a_second(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a full disk every batch fails: each caller gets its 503, but the log gets one
    line a second, then one that counts the batches it did not mention."""
    clock = FakeClock()
    caplog.set_level(logging.ERROR, logger="leasekeeper.store")

    async def main() -> None:
        store = SqliteStore(tmp_path / "full.db", clock)
        await store.open()
        try:
            full = sqlite3.OperationalError("database or disk is full")
            with mock.patch.object(store, "_decide_in_transaction", side_effect=full):
                for _ in range(20):  # one batch each
                    with pytest.raises(ServiceUnavailable):
                        await queue_acquire(store)
                clock.advance(1_000)
                with pytest.raises(ServiceUnavailable):
                    await queue_acquire(store)
        finally:
            await store.close()

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "batch failed" in r.getMessage()]
    assert lines == [
        "SQLite batch failed, 1 operations refused: database or disk is full",
        "SQLite batch failed, 1 operations refused: database or disk is full "
        "(and 19 more since the last such line)",
    ]


def test_readiness_fails_while_the_disk_refuses_writes(tmp_path: Path) -> None:
    """A full disk (here SQLite's page limit, which refuses a write the same way:
    SQLITE_FULL) fails ping (``/readyz``) although the store can still be read, until
    10 s after the last refusal, so that a server taken out of rotation is tried again.
    A write that succeeds meanwhile (a renewal, rewriting its row in place) does not end
    it: readiness would flap while every new key is refused."""
    clock = FakeClock()

    async def main() -> None:
        store = SqliteStore(tmp_path / "full.db", clock)
        await store.open()
        try:
            held = Acquire(new_id(), None, TTL, new_id(), LIFECYCLE)
            assert isinstance((await store.apply(held)).outcome, Granted)
            await store.ping()
            conn = store._conn
            assert conn is not None
            (pages,) = conn.execute("PRAGMA page_count").fetchone()
            conn.execute(f"PRAGMA max_page_count = {pages}")  # no room for one more page
            for _ in range(10_000):
                try:
                    await queue_acquire(store)
                except ServiceUnavailable:
                    break
            else:
                pytest.fail("the store never filled up")
            full = r"refusing writes \(database or disk is full\)"
            with pytest.raises(ServiceUnavailable, match=full):
                await store.ping()
            renewed = await store.apply(Renew(held.key_id, held.owner, TTL))
            assert isinstance(renewed.outcome, Renewed)  # in place: it fits
            await not_ready_until_the_hold_ends(store, clock, full)

            with pytest.raises(ServiceUnavailable):
                await queue_acquire(store)
            with pytest.raises(ServiceUnavailable, match=full):
                await store.ping()
            conn.execute(f"PRAGMA max_page_count = {pages + 100}")  # room again
            assert isinstance((await queue_acquire(store)).outcome, Granted)
            clock.advance(10)
            await store.ping()
        finally:
            await store.close()

    asyncio.run(main())


def test_readiness_is_not_failed_by_a_write_lock_held_too_long(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch refused because another connection held the write lock past the store
    timeout is that moment's trouble, not the disk's: once the lock is let go, ping
    succeeds at once."""
    caplog.set_level(logging.ERROR, logger="leasekeeper.store")

    async def main() -> None:
        store = SqliteStore(tmp_path / "busy.db", FakeClock(), timeout_seconds=0.2)
        await store.open()
        try:
            other = sqlite3.connect(tmp_path / "busy.db", isolation_level=None)
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(ServiceUnavailable):
                await queue_acquire(store)
            for _ in range(500):  # until the thread gives up waiting for the lock
                if any("transaction failed" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail("the thread never gave up waiting for the lock")
            assert "database is locked" in caplog.records[-1].getMessage()
            other.execute("ROLLBACK")
            other.close()
            await store.ping()
        finally:
            await store.close()

    asyncio.run(main())


def test_a_new_store_says_where_it_was_created_and_an_existing_one_does_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server started in another directory than usual makes a new, empty store (with
    its fencing counter from 1) beside the real one: the log says where, once."""

    async def open_and_close() -> None:
        store = SqliteStore(tmp_path / "leases.db")
        await store.open()
        await store.close()

    with caplog.at_level(logging.INFO, logger="leasekeeper.store.sqlite"):
        asyncio.run(open_and_close())
        asyncio.run(open_and_close())
    created = [r.getMessage() for r in caplog.records if "new, empty store" in r.getMessage()]
    assert created == [f"created a new, empty store at {(tmp_path / 'leases.db').resolve()}"]


def _open_is_refused(path: Path, why: str = "") -> None:
    """Opening a store at ``path`` fails, as a store that cannot be opened does, saying
    ``why`` after that."""

    async def main() -> None:
        store = SqliteStore(path, FakeClock(), timeout_seconds=0.2)
        refusal = re.escape("Cannot open the SQLite store") + ".*" + re.escape(why)
        with pytest.raises(ServiceUnavailable, match=refusal):
            await store.open()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("tables", "why"),
    [
        (
            "CREATE TABLE leases (key_id BLOB PRIMARY KEY, data TEXT);",
            "its table leases is not leasekeeper's (it lacks the columns fingerprint, ",
        ),
        (
            "CREATE TABLE meta (k TEXT, v TEXT);",
            "its table meta is not leasekeeper's (it lacks the columns name, value)",
        ),
        (
            SCHEMA.replace("result              TEXT,", "result              TEXT, extra,"),
            "its table leases is not leasekeeper's (it has columns leasekeeper does not "
            "make: extra)",
        ),
        (
            SCHEMA.replace("value INTEGER NOT NULL", "value TEXT"),
            "its table meta is not leasekeeper's (it has columns of other types",
        ),
        (
            SCHEMA + "INSERT INTO meta VALUES ('schema_version', 0);",
            "its schema version is 0, and this leasekeeper's is 1",
        ),
    ],
    ids=["foreign leases", "foreign meta", "extra column", "other type", "old version"],
)
def test_a_file_whose_tables_are_not_leasekeepers_is_refused_at_open(
    tmp_path: Path, tables: str, why: str
) -> None:
    """A file holding another program's tables named leases or meta (or ours, changed)
    is not taken for a store: opening it fails, saying which table is not as leasekeeper
    makes it, and nothing is written to it."""
    path = tmp_path / "foreign.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.executescript(tables)
        before = list(conn.iterdump())
    _open_is_refused(path, why)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert list(conn.iterdump()) == before


def test_readiness_needs_the_tables_the_schema_version_and_the_fence_counter(
    tmp_path: Path,
) -> None:
    """ping (``/readyz``) fails, saying why, while the running store's file holds another
    table of the name leases, a schema version it does not know, or no fencing counter:
    no decision could be made. Put right, it succeeds at once."""
    path = tmp_path / "changed.db"

    async def main() -> None:
        store = SqliteStore(path, FakeClock(), timeout_seconds=1)
        await store.open()
        try:
            await store.ping()
            with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
                changes = [
                    (
                        "ALTER TABLE leases RENAME TO kept; CREATE TABLE leases (x INTEGER);",
                        "its table leases is not leasekeeper's (it lacks the columns key_id, ",
                        "DROP TABLE leases; ALTER TABLE kept RENAME TO leases;",
                    ),
                    (
                        "ALTER TABLE leases RENAME TO kept;",
                        "it has no table leases",
                        "ALTER TABLE kept RENAME TO leases;",
                    ),
                    (
                        "UPDATE meta SET value = 2 WHERE name = 'schema_version';",
                        "its schema version is 2, and this leasekeeper's is 1",
                        "UPDATE meta SET value = 1 WHERE name = 'schema_version';",
                    ),
                    (
                        "DELETE FROM meta WHERE name = 'fence';",
                        "its fencing counter cannot be read",
                        "INSERT INTO meta VALUES ('fence', 0);",
                    ),
                ]
                for change, why, undo in changes:
                    other.executescript(change)
                    with pytest.raises(ServiceUnavailable) as refused:
                        await store.ping()
                    assert refused.value.error.startswith("The lease store cannot decide: ")
                    assert why in refused.value.error
                    other.executescript(undo)
                    await store.ping()
        finally:
            await store.close()

    asyncio.run(main())


@pytest.mark.parametrize("why", ["not a database", "write lock held elsewhere"])
def test_a_store_that_cannot_be_opened_closes_its_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """A failed open() leaves no connection to the garbage collector (which held the file
    open until it ran, and on Python 3.13 warns of it with a ResourceWarning): one whose
    set-up failed (a file that is no database, a write lock it could not take) is closed."""
    from leasekeeper.store import _sqlite

    path = tmp_path / "x.db"
    opened: list[sqlite3.Connection] = []
    connect = sqlite3.connect

    def connecting(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        opened.append(connect(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(_sqlite.sqlite3, "connect", connecting)
    if why == "not a database":
        path.write_bytes(b"not a database\n" * 300)
    else:
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("PRAGMA journal_mode = WAL")
        other.execute("CREATE TABLE other (x)")
        other.execute("BEGIN IMMEDIATE")

    try:
        _open_is_refused(path)
    finally:
        if why != "not a database":
            other.close()
    assert opened
    for conn in opened:
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            conn.execute("SELECT 1")


def test_a_python_whose_sqlite_is_too_old_is_refused_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SQLite library older than 3.24.0 has no upsert, so every batch would fail: the
    store refuses to open instead, says which version it found and which it needs, and
    makes no file."""
    from leasekeeper.store import _sqlite

    monkeypatch.setattr(_sqlite.sqlite3, "sqlite_version_info", (3, 23, 1))
    monkeypatch.setattr(_sqlite.sqlite3, "sqlite_version", "3.23.1")
    _open_is_refused(tmp_path / "x.db", "SQLite is 3.23.1; leasekeeper needs 3.24.0 or later")
    assert list(tmp_path.iterdir()) == []


def test_a_store_whose_file_cannot_be_looked_at_leaves_no_descriptor_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open() that fails while taking the files' identities (a stat refused) leaves
    neither the connection nor the WAL's descriptor open behind it."""
    path = tmp_path / "x.db"
    database = str(path.resolve())
    stat = os.stat

    def refusing(name: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if name == database:
            raise PermissionError(13, "Permission denied", name)
        return stat(name, *args, **kwargs)

    before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "stat", refusing)  # the process's: undone right after the open
    _open_is_refused(path)
    monkeypatch.undo()
    opened = {fd for fd in set(os.listdir("/proc/self/fd")) - before if fd.isdigit()}
    leaked = [
        os.readlink(f"/proc/self/fd/{fd}") for fd in opened if os.path.exists(f"/proc/self/fd/{fd}")
    ]
    assert not [name for name in leaked if name.startswith(database)], leaked


def _syncer_process(store: SqliteStore) -> int:
    assert store._syncer is not None and store._syncer.pid is not None
    return store._syncer.pid


def _state(pid: int) -> str | None:
    """The process's state letter (Z: exited, not yet reaped), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None


def test_the_wal_is_fsynced_by_a_process_of_its_own_that_ends_with_the_store(
    tmp_path: Path,
) -> None:
    """By default the fsync runs in a child process (``_syncer``), which holds the very
    WAL the store writes, answers the store's batches, and exits once the store closes."""
    path = tmp_path / "p.db"

    async def main() -> int:
        store = SqliteStore(path, FakeClock())
        await store.open()
        pid = _syncer_process(store)
        assert "_syncer.py" in await asyncio.to_thread(Path(f"/proc/{pid}/cmdline").read_text)
        held = os.readlink(f"/proc/{pid}/fd/{store._wal_fd}")
        assert held == str(path.resolve()) + "-wal"
        decisions = await asyncio.gather(*(queue_acquire(store) for _ in range(50)))
        assert all(isinstance(d.outcome, Granted) for d in decisions)
        await store.close()
        return pid

    pid = asyncio.run(main())
    assert _state(pid) is None  # exited and reaped: no zombie left behind
    assert SqliteStore(path).fencing_counter() == 50


def test_the_fsync_process_ignores_the_signals_that_stop_a_server(tmp_path: Path) -> None:
    """A Ctrl-C or a service manager's stop reaches every process of the group; the
    server goes on answering its last requests, so its syncer must keep going until
    the store closes."""
    import signal

    async def main() -> None:
        store = SqliteStore(tmp_path / "s.db", FakeClock())
        await store.open()
        pid = _syncer_process(store)
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            os.kill(pid, number)
        await asyncio.sleep(0.2)
        decision = await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        assert isinstance(decision.outcome, Granted)
        assert _state(pid) not in (None, "Z")
        await store.close()

    asyncio.run(main())


def test_a_store_whose_fsync_process_died_refuses_everything(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without its syncer nothing can be made durable: every request and the readiness
    check get 503 until restarted, and one CRITICAL says why."""
    import signal

    async def main() -> None:
        store = SqliteStore(tmp_path / "k.db", FakeClock())
        await store.open()
        os.kill(_syncer_process(store), signal.SIGKILL)
        with pytest.raises(ServiceUnavailable, match="durable"):  # busy: found by a batch
            await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        await _refuses_everything(store)
        await store.close()

    with caplog.at_level(logging.CRITICAL, logger="leasekeeper.store.sqlite"):
        asyncio.run(main())
    assert "the SQLite store's fsync process ended (exit status -9)" in _the_one_critical(caplog)


@pytest.mark.parametrize(
    ("how", "warning"),
    [
        ("cannot start", "no process started ([Errno 11] Resource temporarily unavailable)"),
        (
            "ends at once",  # a Python that cannot run the script, say
            "its process ended before its first fsync (process ended (exit status 3))",
        ),
    ],
)
def test_where_no_syncer_process_works_the_wal_is_fsynced_on_a_thread(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    how: str,
    warning: str,
) -> None:
    """A store is not refused for want of a process (a limit on processes), nor for a
    process that starts but ends before its first fsync: its fsync runs on a thread of
    the server instead, slower under load, and a warning says why."""
    from leasekeeper.store import _sqlite_sync

    if how == "cannot start":

        def refused(*args: Any, **kwargs: Any) -> Any:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

        monkeypatch.setattr(_sqlite_sync.subprocess, "Popen", refused)
    else:
        broken = tmp_path / "broken.py"
        broken.write_text("import sys\nsys.exit(3)\n")
        monkeypatch.setattr(_syncer, "__file__", str(broken))

    async def main() -> None:
        store = SqliteStore(tmp_path / "t.db", FakeClock())
        await store.open()
        assert store._syncer is not None and store._syncer.pid is None
        names = [thread.name for thread in threading.enumerate()]
        assert "leasekeeper-sqlite-fsync" in names
        decision = await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        assert isinstance(decision.outcome, Granted)
        await store.close()
        names = [thread.name for thread in threading.enumerate()]
        assert "leasekeeper-sqlite-fsync" not in names

    with caplog.at_level(logging.WARNING, logger="leasekeeper.store.sqlite"):
        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [f"the SQLite WAL is fsynced on a thread: {warning}"]


def test_a_store_whose_wal_cannot_be_fsynced_does_not_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The syncer fsyncs the WAL once as the store opens: a disk that refuses it
    refuses the start (503), rather than every request after a start that looked well;
    the store's thread and descriptors are not left behind."""

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_syncer, "sync_data", failing)
    before = set(os.listdir("/proc/self/fd"))

    async def main() -> None:
        store = SqliteStore(tmp_path / "f.db", FakeClock(), fsync_process=False)
        with pytest.raises(ServiceUnavailable, match=r"Cannot fsync .*Input/output error"):
            await store.open()

    asyncio.run(main())
    names = [thread.name for thread in threading.enumerate()]
    assert not [name for name in names if name.startswith("leasekeeper-sqlite")], names
    assert set(os.listdir("/proc/self/fd")) <= before


#: More batches than the syncer's read (64 KiB) and the pipe (64 KiB) hold together.
_BEYOND_THE_PIPE = 150_000


@pytest.mark.parametrize("close_while_owed", [False, True])
def test_batches_beyond_what_the_pipe_holds_are_all_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, close_while_owed: bool
) -> None:
    """The store asks for an fsync with one byte a batch; while an fsync waits, more
    batches than the pipe holds (64 KiB) are kept count of and sent as room comes, each
    answered once, none refused: also when the store closes meanwhile (committed
    batches must not be answered 503 for want of room in a pipe)."""
    from leasekeeper.store import _sqlite_sync

    gate = GatedFsync(monkeypatch)
    answered: list[int] = []
    refused: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        wal = os.open(tmp_path / "wal", os.O_RDWR | os.O_CREAT)
        files = [(str(tmp_path / "wal"), (os.fstat(wal).st_dev, os.fstat(wal).st_ino))]

        def failed(error: Exception, kind: str) -> None:
            refused.append(f"{kind}: {error}")

        syncer = await _sqlite_sync.Syncer.start(
            loop, wal, files, answered.append, failed, process=False, first_fsync_within=10
        )
        gate.armed.set()
        for _ in range(_BEYOND_THE_PIPE):  # one read of 64 KiB in the fsync, 64 KiB in the pipe
            syncer.request()
        assert syncer._owed > 0  # the pipe is full: the rest are owed
        closing = asyncio.ensure_future(syncer.close()) if close_while_owed else None
        await asyncio.sleep(0.05)
        gate.release.set()
        deadline = time.monotonic() + 30
        while sum(answered) < _BEYOND_THE_PIPE and not refused:
            assert time.monotonic() < deadline, f"{sum(answered)} answered"
            await asyncio.sleep(0.01)
        await (closing or syncer.close())
        os.close(wal)

    asyncio.run(main())
    assert refused == []
    assert sum(answered) == _BEYOND_THE_PIPE


def test_answers_then_a_failure_in_one_read_or_a_line_in_two_are_each_told_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the syncer writes may arrive in any pieces: batches answered and then its
    failure in one read, the failure's line split over two. The batches are answered,
    then the failure told once, with its errno and message."""
    from leasekeeper.store import _sqlite_sync

    def stand_in(requests: int, replies: int, wal: int, files: Any) -> None:
        os.read(requests, 1)
        os.write(replies, b".")  # the first fsync, as the store opens
        got = b""
        while len(got) < 2:
            got += os.read(requests, 2 - len(got))
        os.write(replies, b"..F5 Inp")
        time.sleep(0.1)
        os.write(replies, b"ut/output error\n")

    monkeypatch.setattr(_syncer, "serve", stand_in)
    told: list[tuple[str, Any]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        wal = os.open(tmp_path / "wal", os.O_RDWR | os.O_CREAT)
        ended = loop.create_future()

        def failed(error: Exception, kind: str) -> None:
            told.append((kind, error))
            ended.set_result(None)

        syncer = await _sqlite_sync.Syncer.start(
            loop,
            wal,
            [],
            lambda count: told.append(("durable", count)),
            failed,
            process=False,
            first_fsync_within=10,
        )
        syncer.request()
        syncer.request()
        await asyncio.wait_for(ended, 10)
        await syncer.close()
        os.close(wal)

    asyncio.run(main())
    assert [kind for kind, _ in told] == ["durable", "F"]
    assert told[0][1] == 2
    error = told[1][1]
    assert isinstance(error, OSError)
    assert (error.errno, error.strerror) == (5, "Input/output error")


def test_the_syncer_ends_when_its_server_is_killed(tmp_path: Path) -> None:
    """A server killed outright (SIGKILL, the OOM killer) cannot close its store: its
    syncer sees the end of its input and exits by itself, rather than outlive it."""
    import signal
    import subprocess
    import sys

    script = (
        "import asyncio, os, sys, time\n"
        "from leasekeeper.store._sqlite import SqliteStore\n"
        "async def main():\n"
        "    store = SqliteStore(sys.argv[1])\n"
        "    await store.open()\n"
        "    print(store._syncer.pid, flush=True)\n"
        "    time.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "k.db")], stdout=subprocess.PIPE
    )
    try:
        assert server.stdout is not None
        syncer = int(server.stdout.readline())
        assert _state(syncer) not in (None, "Z")
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        deadline = time.monotonic() + 10
        while _state(syncer) not in (None, "Z"):  # gone, or ended and not yet reaped
            assert time.monotonic() < deadline, "the syncer outlived its server"
            time.sleep(0.02)
    finally:
        server.kill()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()


def test_a_syncer_that_fails_to_start_leaves_no_process_nor_descriptor(tmp_path: Path) -> None:
    """A syncer whose start fails after its process is running (the loop cannot watch
    its pipe, say) is killed and its pipes closed: the store does not open (503), and
    leaves nothing behind."""
    before = set(os.listdir("/proc/self/fd"))

    def my_children() -> list[str]:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    stat = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
                    if int(stat[1]) == os.getpid() and stat[0] != "Z":
                        found.append(entry)
        return found

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def refusing(*args: Any) -> None:
            raise OSError(errno.EPERM, "Operation not permitted")

        loop.add_reader = refusing  # type: ignore[method-assign]
        store = SqliteStore(tmp_path / "r.db", FakeClock())
        with pytest.raises(ServiceUnavailable, match="Cannot start the SQLite store's fsync"):
            await store.open()

    asyncio.run(main())
    assert my_children() == []
    assert set(os.listdir("/proc/self/fd")) <= before


def test_a_syncer_whose_store_went_away_mid_answer_exits_quietly(tmp_path: Path) -> None:
    """The server killed while its syncer fsyncs: the answer meets a closed pipe. The
    syncer exits with status 0 and writes no traceback to the server's log (stderr)."""
    import subprocess
    import sys

    wal = os.open(tmp_path / "wal", os.O_RDWR | os.O_CREAT)
    replies_read, replies_write = os.pipe()
    os.close(replies_read)  # the store is gone before the answer
    try:
        syncer = subprocess.run(
            [sys.executable, "-I", "-S", _syncer.__file__, str(wal)],
            input=b".",
            stdout=replies_write,
            stderr=subprocess.PIPE,
            pass_fds=(wal,),
            timeout=30,
            check=False,
        )
    finally:
        os.close(replies_write)
        os.close(wal)
    assert (syncer.returncode, syncer.stderr) == (0, b"")


def test_a_syncer_process_that_says_nothing_is_killed_and_a_thread_fsyncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A process that neither answers nor ends (a Python stuck at its start) is given
    the store's timeout for its first fsync, then killed and reaped; the fsync runs on
    a thread, with a warning."""
    silent = tmp_path / "silent.py"
    silent.write_text(
        "import os, sys, time\n"
        "open(os.path.join(os.path.dirname(sys.argv[0]), 'pid'), 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(_syncer, "__file__", str(silent))

    async def main() -> None:
        store = SqliteStore(tmp_path / "q.db", FakeClock(), timeout_seconds=0.5)
        await store.open()
        assert store._syncer is not None and store._syncer.pid is None
        decision = await store.apply(Acquire(new_id(), None, TTL, new_id(), LIFECYCLE))
        assert isinstance(decision.outcome, Granted)
        await store.close()

    with caplog.at_level(logging.WARNING, logger="leasekeeper.store.sqlite"):
        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "the SQLite WAL is fsynced on a thread: its process said nothing within 0.5 s"
    ]
    assert _state(int((tmp_path / "pid").read_text())) is None  # killed, and reaped


def test_no_thread_for_the_fsync_either_is_a_503_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A limit on processes usually limits threads too: with neither, the store does not
    open, with a 503 that says why (not a traceback), and leaves no thread behind."""
    from leasekeeper.store import _sqlite_sync

    def no_process(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    start = threading.Thread.start

    def no_fsync_thread(self: threading.Thread) -> None:
        if self.name == "leasekeeper-sqlite-fsync":
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(_sqlite_sync.subprocess, "Popen", no_process)
    monkeypatch.setattr(threading.Thread, "start", no_fsync_thread)

    async def main() -> None:
        store = SqliteStore(tmp_path / "n.db", FakeClock())
        with pytest.raises(ServiceUnavailable, match="can't start new thread"):
            await store.open()

    asyncio.run(main())
    assert not [t.name for t in threading.enumerate() if t.name.startswith("leasekeeper-sqlite")]


def test_an_open_cancelled_while_it_connects_leaves_no_thread_behind(tmp_path: Path) -> None:
    """A server stopped while it starts cancels the store's open(): the writer's thread,
    still connecting, is stopped once it has, and closes the connection and files."""

    def ours() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("leasekeeper-sqlite")]

    async def main() -> None:
        store = SqliteStore(tmp_path / "c.db", FakeClock())
        opening = asyncio.ensure_future(store.open())
        await asyncio.sleep(0)  # the thread is started and connecting
        assert ours()
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        deadline = time.monotonic() + 10
        while ours():
            assert time.monotonic() < deadline, f"left running: {ours()}"
            await asyncio.sleep(0.01)
        await store.close()

    asyncio.run(main())
