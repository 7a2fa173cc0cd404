"""The bench's SQLite pre-fill leaves its records on the disk, not in the page cache."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import pytest
from bench import _stores
from bench._stores import SqliteTarget


def test_the_sqlite_prefill_is_fsynced_after_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Filled at ``synchronous=OFF``, the records would reach the disk only when the
    kernel writes them back, about 30 s later, in the middle of the measured runs."""
    target = SqliteTarget(tmp_path)
    url = target.fresh()
    database = tmp_path / "store-1.db"
    synced: list[tuple[Path, int]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        wal = Path(f"{path}-wal")
        synced.append((path, wal.stat().st_size if wal.exists() else 0))
        real_fsync(fd)

    monkeypatch.setattr(_stores.os, "fsync", fsync)
    target.prefill(url, 1_000, expired=False)

    # The database file, once the checkpoint had copied every row into it (WAL empty).
    assert synced == [(database.resolve(), 0)]
    with contextlib.closing(sqlite3.connect(database)) as conn:
        assert conn.execute("SELECT count(*) FROM leases").fetchone() == (1_000,)
    assert target.expired(url) == 0
