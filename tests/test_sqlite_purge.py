"""SQLite purges walk the table in key order, a bounded span of keys per step.

Records are stored in key order (a ``WITHOUT ROWID`` table keyed by the key id), so
a step that deletes the finished records among the next ``limit`` keys rewrites a
few neighbouring pages. These tests pin the walk exactly: which keys each step looks
at, what it deletes, and where it tells the next step to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

from leasekeeper import FakeClock
from leasekeeper._core.model import Acquire, Granted, Held
from leasekeeper.store import Purged
from leasekeeper.store._sqlite import SqliteStore

TTL = 30_000


def key(n: int) -> bytes:
    """Key ids that sort as their numbers do."""
    return bytes([n]) * 32


def test_each_step_looks_at_the_next_limit_keys_and_deletes_the_finished_ones(
    tmp_path: Path,
) -> None:
    """Keys 1..6 with 2, 3 and 5 finished: steps of two keys delete 0, 1, 1, ... in key order."""
    clock = FakeClock()

    async def main() -> None:
        store = SqliteStore(tmp_path / "walk.db", clock)
        await store.open()
        for n in range(1, 7):
            lifecycle = 2_000 if n in (2, 3, 5) else 60_000
            decision = await store.apply(Acquire(key(n), None, TTL, key(100 + n), lifecycle))
            assert isinstance(decision.outcome, Granted)
        clock.advance(2)  # keys 2, 3, 5: their lifecycle is over (exactly at its end)
        assert await store.purge(2) == Purged(1, key(2))  # keys 1, 2
        assert await store.purge(2, key(2)) == Purged(1, key(4))  # keys 3, 4
        assert await store.purge(2, key(4)) == Purged(1, key(6))  # keys 5, 6: two seen, go on
        assert await store.purge(2, key(6)) == Purged(0, None)  # nothing past key 6
        assert await store.purge(10) == Purged(0, None)  # fewer than 10 keys: one step
        for n in (1, 4, 6):
            decision = await store.apply(Acquire(key(n), None, TTL, key(200 + n), 60_000))
            assert isinstance(decision.outcome, Held)
        for n in (2, 3, 5):  # gone: a new lifecycle starts
            decision = await store.apply(Acquire(key(n), None, TTL, key(200 + n), 60_000))
            assert isinstance(decision.outcome, Granted)
        await store.close()

    asyncio.run(main())


def test_the_old_lifecycle_index_is_dropped_on_open(tmp_path: Path) -> None:
    """A file from a version that purged through an index loses it: every write kept it up."""
    path = tmp_path / "old.db"

    async def cycle() -> None:
        store = SqliteStore(path, FakeClock())
        await store.open()
        await store.close()

    asyncio.run(cycle())
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE INDEX leases_lifecycle_end ON leases (absolute_expires_ms)")
        conn.commit()
    asyncio.run(cycle())
    with contextlib.closing(sqlite3.connect(path)) as conn:
        names = [n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")]
    assert "leases_lifecycle_end" not in names
