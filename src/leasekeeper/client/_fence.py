"""``FenceGuard``: the protected system's half of fencing, kept in the caller's own database.

A lease alone cannot stop a paused worker that wakes after its ownership ended: the
system it writes to must refuse older fencing tokens. ``FenceGuard`` does it with one
upsert that only raises the fence (``check_sql``), run in the *same transaction* as the
guarded write: no row back means a newer owner has written (``StaleFence``; roll back).

It is atomic because the upsert locks the resource's row (PostgreSQL) or the database
(SQLite) until commit, so once a write with fence 185 has committed, no write with
fence 184 can commit after it::

    worker A (fence 184)         worker B (fence 185)
    pauses ...                   BEGIN; upsert 185 -> row; write; COMMIT
    BEGIN; upsert 184 -> no row: StaleFence; ROLLBACK
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from leasekeeper._errors import StaleFence

if TYPE_CHECKING:
    import psycopg

__all__ = ["FenceGuard"]

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
_MAX_FENCE = 2**63 - 1


class FenceGuard:
    """Keeps the highest fencing token per resource in a SQLite or PostgreSQL database.

    ``connection``: a ``sqlite3.Connection`` or a ``psycopg.Connection``; ``table``: an
    identifier, optionally ``schema.table``. The guard never commits or rolls back: the
    transaction is the caller's, so the check and the guarded write go together::

        guard = FenceGuard(conn)
        with conn:                                   # sqlite3: one transaction
            guard.check("invoice:42", lease.fencing_token)   # StaleFence if older
            conn.execute("UPDATE invoices SET ... WHERE id = 42")
    """

    def __init__(
        self,
        connection: sqlite3.Connection | psycopg.Connection[Any],
        *,
        table: str = "leasekeeper_fences",
    ) -> None:
        if not _IDENTIFIER.match(table):
            raise ValueError("table must be an SQL identifier, optionally schema.table")
        self.connection = connection
        self.table = table
        self._sqlite = isinstance(connection, sqlite3.Connection)
        mark = "?" if self._sqlite else "%s"
        self.create_sql = (
            f"CREATE TABLE IF NOT EXISTS {table} (resource TEXT PRIMARY KEY, fence BIGINT NOT NULL)"
        )
        self.check_sql = (
            f"INSERT INTO {table} (resource, fence) VALUES ({mark}, {mark}) "  # noqa: S608 - table is a checked identifier
            "ON CONFLICT (resource) DO UPDATE SET fence = excluded.fence "
            f"WHERE {table}.fence <= excluded.fence "
            "RETURNING fence"
        )
        self.current_sql = f"SELECT fence FROM {table} WHERE resource = {mark}"  # noqa: S608

    def create_table(self) -> None:
        """Create the fences table if it is missing (commit afterwards if your driver needs it)."""
        self.connection.execute(self.create_sql)

    def check(self, resource: str, fencing_token: int) -> None:
        """Record ``fencing_token`` for ``resource``, or raise ``StaleFence`` if a newer one exists.

        Call it inside the guarded write's transaction, before the write; outside one
        (an autocommitting connection) it raises ``RuntimeError``.
        """
        if not isinstance(resource, str) or not resource:
            raise ValueError("resource must be a non-empty string")
        if (
            not isinstance(fencing_token, int)
            or isinstance(fencing_token, bool)
            or not 0 < fencing_token <= _MAX_FENCE
        ):
            raise ValueError("fencing_token must be a positive integer below 2**63")
        if self._autocommits():
            raise _outside_a_transaction()
        row = self.connection.execute(self.check_sql, (resource, fencing_token)).fetchone()
        if not self._in_transaction():
            raise _outside_a_transaction()
        if row is None:
            current = self.current(resource)
            raise StaleFence(
                resource=resource,
                fencing_token=fencing_token,
                current_fence=current if current is not None else fencing_token,
            )

    def current(self, resource: str) -> int | None:
        """The highest fencing token recorded for ``resource``, or None."""
        row = self.connection.execute(self.current_sql, (resource,)).fetchone()
        if row is None:
            return None
        # A row as the connection makes them: a tuple, or a dict (psycopg's dict_row).
        value = next(iter(row.values())) if isinstance(row, Mapping) else row[0]
        return int(value)

    def _autocommits(self) -> bool:
        """Whether the next statement would commit on its own (no transaction begins)."""
        connection = self.connection
        if self._in_transaction():
            return False
        if isinstance(connection, sqlite3.Connection):
            # Python 3.12's autocommit attribute, where set, rules; else isolation_level.
            autocommit = getattr(connection, "autocommit", None)
            if isinstance(autocommit, bool):
                return autocommit
            return connection.isolation_level is None
        return bool(connection.autocommit)

    def _in_transaction(self) -> bool:
        connection = self.connection
        if isinstance(connection, sqlite3.Connection):
            return connection.in_transaction
        from psycopg import pq

        return connection.info.transaction_status == pq.TransactionStatus.INTRANS


def _outside_a_transaction() -> RuntimeError:
    return RuntimeError(
        "FenceGuard.check ran outside a transaction: run it and the guarded write "
        "in one transaction (sqlite3: `with conn:`; psycopg: `with conn.transaction():`)"
    )
