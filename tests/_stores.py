"""Stores for runs against real servers: SQLite and PostgreSQL.

``store_target(kind, tmp_path)`` yields a store URL a server can be started on. The
PostgreSQL variant creates a schema of its own (``?options=-csearch_path%3D…``), names
its connections after it so they can be terminated, and drops it afterwards; without
a PostgreSQL to use it skips locally and fails in CI.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import conftest

STORES = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@dataclass
class Target:
    """A store for a run: its URL, and how to reach it from the test."""

    kind: str
    url: str
    db: Path | None = None
    admin_url: str | None = None
    schema: str | None = None

    def integrity(self) -> str:
        """SQLite's ``PRAGMA integrity_check`` (``ok``); PostgreSQL has no such file to check."""
        if self.db is None:
            return "ok"
        with contextlib.closing(sqlite3.connect(self.db)) as conn:
            return str(conn.execute("PRAGMA integrity_check").fetchone()[0])

    def snapshot(self) -> dict[str, bytes]:
        """What the store holds at rest: SQLite's files (db, -wal, -shm), or a ``pg_dump``
        of this run's schema (plus each table copied out as text) for PostgreSQL."""
        if self.db is not None:
            return {
                p.name: p.read_bytes()
                for p in self.db.parent.iterdir()
                if p.name.startswith(self.db.name)
            }
        import psycopg

        assert self.admin_url is not None and self.schema is not None
        found: dict[str, bytes] = {}
        dump = subprocess.run(
            ["pg_dump", "--schema", self.schema, self.admin_url],
            capture_output=True,
            check=False,
            timeout=60,
        )
        if dump.returncode == 0:
            found["pg_dump"] = dump.stdout
        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as conn:
            tables = conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s", (self.schema,)
            ).fetchall()
            for (table,) in tables:
                chunks = []
                with conn.cursor().copy(f'COPY "{self.schema}"."{table}" TO STDOUT') as copy:
                    for chunk in copy:
                        chunks.append(bytes(chunk))
                found[f"table {table}"] = b"".join(chunks)
        assert found, "nothing to scan"
        return found

    def terminate_backends(self) -> tuple[int, int]:
        """End every PostgreSQL connection of this run's instances; (ended, in a transaction)."""
        import psycopg

        assert self.admin_url is not None
        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid), xact_start IS NOT NULL "
                "FROM pg_stat_activity WHERE application_name = %s AND pid <> pg_backend_pid()",
                (self.schema,),
            ).fetchall()
        return len(rows), sum(1 for _, in_transaction in rows if in_transaction)


@contextlib.contextmanager
def store_target(kind: str, tmp_path: Path) -> Iterator[Target]:
    if kind == "sqlite":
        db = tmp_path / "run.db"
        yield Target("sqlite", f"sqlite:///{db}", db=db)
        return
    base = conftest.postgres_url()
    if base is None:
        pytest.skip("PostgreSQL runs need LEASEKEEPER_TEST_POSTGRES_URL (make test sets it)")
    psycopg = conftest.import_or_skip("psycopg")

    schema = f"lk_prove_{secrets.token_hex(5)}"
    try:
        with psycopg.connect(base, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
    except psycopg.OperationalError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"PostgreSQL is not reachable: {exc}")
    joiner = "&" if "?" in base else "?"
    url = f"{base}{joiner}options=-csearch_path%3D{schema}&application_name={schema}"
    target = Target("postgres", url, admin_url=base, schema=schema)
    try:
        yield target
    finally:
        target.terminate_backends()
        with psycopg.connect(base, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
