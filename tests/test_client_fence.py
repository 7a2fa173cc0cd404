"""FenceGuard keeps the highest fencing token per resource and refuses older writes."""

from __future__ import annotations

import secrets
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from leasekeeper import LeaseLost, StaleFence
from leasekeeper.client import FenceGuard
from tests.conftest import postgres_url


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(tmp_path / "app.db")
    conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, status TEXT)")
    conn.execute("INSERT INTO invoices VALUES (42, 'open')")
    conn.commit()
    yield conn
    conn.close()


def write(conn: sqlite3.Connection, guard: FenceGuard, fence: int, status: str) -> None:
    with conn:
        guard.check("invoice:42", fence)
        conn.execute("UPDATE invoices SET status = ? WHERE id = 42", (status,))


def test_sqlite_refuses_an_older_fence_and_rolls_the_write_back(
    sqlite_db: sqlite3.Connection,
) -> None:
    """Worker B (185) writes; worker A (184) wakes up later and is refused, its write undone."""
    guard = FenceGuard(sqlite_db)
    guard.create_table()
    write(sqlite_db, guard, 184, "charging")  # A before its pause
    write(sqlite_db, guard, 185, "charged by B")
    write(sqlite_db, guard, 185, "B again")  # the same owner may write again
    with pytest.raises(StaleFence) as stale:
        write(sqlite_db, guard, 184, "charged by A")
    assert isinstance(stale.value, LeaseLost)
    assert (stale.value.fencing_token, stale.value.current_fence) == (184, 185)
    assert stale.value.resource == "invoice:42"
    assert sqlite_db.execute("SELECT status FROM invoices").fetchone() == ("B again",)
    assert guard.current("invoice:42") == 185
    assert guard.current("invoice:43") is None


def test_fences_are_per_resource(sqlite_db: sqlite3.Connection) -> None:
    """A high fence on one resource does not block another."""
    guard = FenceGuard(sqlite_db)
    guard.create_table()
    with sqlite_db:
        guard.check("a", 900)
        guard.check("b", 5)
    assert (guard.current("a"), guard.current("b")) == (900, 5)


def test_check_outside_a_transaction_is_refused(tmp_path: Path) -> None:
    """In autocommit mode the check cannot share the write's transaction: RuntimeError,
    and nothing is recorded."""
    conn = sqlite3.connect(tmp_path / "auto.db", isolation_level=None)
    guard = FenceGuard(conn)
    guard.create_table()
    with pytest.raises(RuntimeError, match="transaction"):
        guard.check("r", 1)
    assert guard.current("r") is None
    conn.execute("BEGIN")
    guard.check("r", 2)
    conn.execute("COMMIT")
    conn.close()


def test_arguments_are_checked(sqlite_db: sqlite3.Connection) -> None:
    """Tokens are positive integers below 2**63; table names are identifiers."""
    guard = FenceGuard(sqlite_db)
    for bad in (0, -1, 2**63, True, "5"):
        with pytest.raises(ValueError, match="fencing_token"):
            guard.check("r", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="resource"):
        guard.check("", 1)
    with pytest.raises(ValueError, match="identifier"):
        FenceGuard(sqlite_db, table="fences; DROP TABLE invoices")
    assert "excluded.fence" in guard.check_sql


@pytest.fixture
def pg_schema() -> Iterator[tuple[str, str]]:
    """A schema of our own on the test PostgreSQL, dropped afterwards."""
    url = postgres_url()
    if not url:
        pytest.skip("LEASEKEEPER_TEST_POSTGRES_URL is not set")
    import psycopg

    schema = f"lk_fence_{secrets.token_hex(4)}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
        try:
            yield url, schema
        finally:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.mark.postgres
def test_postgres_serializes_writers_and_refuses_the_older_one(pg_schema: tuple[str, str]) -> None:
    """On PostgreSQL a writer with 184 waits for 185's transaction, then is refused."""
    import psycopg

    url, schema = pg_schema
    table = f"{schema}.fences"
    with psycopg.connect(url) as b, psycopg.connect(url) as a:
        guard_b = FenceGuard(b, table=table)
        guard_b.create_table()
        b.execute(f"CREATE TABLE {schema}.invoices (id INT PRIMARY KEY, status TEXT)")
        b.execute(f"INSERT INTO {schema}.invoices VALUES (42, 'open')")
        b.commit()
        guard_a = FenceGuard(a, table=table)
        with a.transaction():
            guard_a.check("invoice:42", 184)
        # B holds the row lock in an open transaction; A's check must wait for it.
        guard_b.check("invoice:42", 185)
        b.execute(f"UPDATE {schema}.invoices SET status = 'B' WHERE id = 42")
        outcome: list[Any] = []

        def worker_a() -> None:
            try:
                with a.transaction():
                    guard_a.check("invoice:42", 184)
                    a.execute(f"UPDATE {schema}.invoices SET status = 'A' WHERE id = 42")
            except StaleFence as error:
                outcome.append(error)

        thread = threading.Thread(target=worker_a)
        thread.start()
        thread.join(0.3)
        assert thread.is_alive()  # blocked on B's row lock
        b.commit()
        thread.join(5)
        assert len(outcome) == 1
        assert outcome[0].current_fence == 185
        status = b.execute(f"SELECT status FROM {schema}.invoices").fetchone()
        assert status == ("B",)
        assert guard_b.current("invoice:42") == 185


@pytest.mark.postgres
def test_postgres_autocommit_outside_a_transaction_is_refused(pg_schema: tuple[str, str]) -> None:
    """psycopg in autocommit mode without conn.transaction() is refused with RuntimeError,
    and nothing is recorded."""
    import psycopg

    url, schema = pg_schema
    with psycopg.connect(url, autocommit=True) as conn:
        guard = FenceGuard(conn, table=f"{schema}.fences")
        guard.create_table()
        with pytest.raises(RuntimeError, match="transaction"):
            guard.check("r", 1)
        assert guard.current("r") is None  # refused before anything was recorded
        with conn.transaction():
            guard.check("r", 2)
        assert guard.current("r") == 2


def test_sqlite_rows_as_dicts_are_read_too(tmp_path: Path) -> None:
    """A connection whose rows are dicts (the sqlite3 documentation's dict_factory): a stale
    fence is still StaleFence, with the current fence, and current() reads it."""

    def dict_factory(cursor: sqlite3.Cursor, row: tuple[Any, ...]) -> dict[str, Any]:
        return {column[0]: value for column, value in zip(cursor.description, row, strict=True)}

    db = sqlite3.connect(tmp_path / "app.db")
    db.row_factory = dict_factory
    guard = FenceGuard(db)
    guard.create_table()
    with db:
        guard.check("invoice:42", 185)
    assert guard.current("invoice:42") == 185
    with pytest.raises(StaleFence) as raised, db:
        guard.check("invoice:42", 184)
    assert raised.value.current_fence == 185
    db.close()


@pytest.mark.postgres
def test_postgres_rows_as_dicts_are_read_too(pg_schema: tuple[str, str]) -> None:
    """psycopg's dict_row: a stale fence is StaleFence, not a KeyError."""
    import psycopg
    from psycopg.rows import dict_row

    url, schema = pg_schema
    with psycopg.connect(url, row_factory=dict_row) as conn:
        guard = FenceGuard(conn, table=f"{schema}.fences")
        guard.create_table()
        conn.commit()
        with conn.transaction():
            guard.check("invoice:42", 185)
        with pytest.raises(StaleFence) as raised, conn.transaction():
            guard.check("invoice:42", 184)
        assert raised.value.current_fence == 185
        assert guard.current("invoice:42") == 185
