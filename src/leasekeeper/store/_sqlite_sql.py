"""The SQLite store's schema and statements: the writer's connection, and the reads
apart from it (run beside servers and by operator commands: none creates a store or
waits for a writer). Statements are built from constants and ``?`` marks only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sqlite3
from pathlib import Path

from leasekeeper._core.model import LeaseRecord
from leasekeeper._errors import ServiceUnavailable
from leasekeeper.store._base import Purged, not_ours

log = logging.getLogger("leasekeeper.store.sqlite")

SCHEMA_VERSION = 1
#: The oldest SQLite library that runs the store's statements (upserts: 3.24.0).
_OLDEST_SQLITE = (3, 24, 0)
#: Page cache of the writer connection, in KiB when negative (SQLite default: 2 MiB).
_CACHE_KIB = -65_536
#: The WAL file is truncated to this size when it starts over.
_WAL_KEEP_BYTES = 64 * 1024 * 1024

SCHEMA = """
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
-- Stores made by earlier versions have this index. Purges walk the table in key order.
DROP INDEX IF EXISTS leases_lifecycle_end;
"""

_SELECT_MANY = (
    "SELECT key_id, fingerprint, absolute_expires_ms, fencing_token, owner, "
    "lease_expires_ms, completed_ms, result, updated_ms FROM leases WHERE key_id IN "
)
#: Keys per SELECT: far below SQLite's limit on bound parameters (32,766).
SELECT_CHUNK = 500
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
#: result) are NULL: an upsert statement of its own for each (``upsert``).
_Nulls = tuple[bool, bool, bool, bool]

READ_FENCE = "SELECT value FROM meta WHERE name = 'fence'"
_WRITE_FENCE = "UPDATE meta SET value = ? WHERE name = 'fence'"
_RAISE_FENCE = "UPDATE meta SET value = max(value, ?) WHERE name = 'fence'"
STORE_TABLES = (
    "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name IN ('leases', 'meta')"
)
READ_VERSION = "SELECT value FROM meta WHERE name = 'schema_version'"
#: A table's columns as ``SCHEMA`` declares them: name, type, NOT NULL, place in the key.
_TABLE_COLUMNS = 'SELECT name, upper(type), "notnull", pk FROM pragma_table_info(?) ORDER BY cid'
COUNT_LIVE = "SELECT count(*) FROM leases WHERE owner IS NOT NULL AND lease_expires_ms > ?"
#: A purge step walks the table in key order (its deletes share neighbouring pages): the
#: next ``limit`` keys past the last step's, then the finished records among them.
_PURGE_SPAN = (
    "SELECT count(*), max(key_id) FROM "
    "(SELECT key_id FROM leases WHERE key_id > ? ORDER BY key_id LIMIT ?)"
)
_PURGE = "DELETE FROM leases WHERE key_id > ? AND key_id <= ? AND absolute_expires_ms <= ?"

#: SQLite's primary result codes that say the store cannot take writes at all.
REFUSING = frozenset(
    {
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_READONLY,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_CORRUPT,
        sqlite3.SQLITE_NOTADB,
    }
)


def primary_code(exc: sqlite3.Error) -> int:
    """SQLite's primary result code of ``exc``; 0 for the sqlite3 module's own errors."""
    return (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF


@functools.lru_cache(maxsize=16)
def upsert(nulls: _Nulls) -> str:
    """The upsert of a record whose nullable columns are NULL as ``nulls`` says. NULL is
    written into the statement and blobs bound as ``bytearray`` (``params``): Python
    3.11's sqlite3 builds and drops an exception for each ``None`` or ``bytes`` bound."""
    null = dict(zip(("fingerprint", "owner", "completed_ms", "result"), nulls, strict=True))
    values = ", ".join("NULL" if null.get(column) else "?" for column in _COLUMNS)
    return _UPSERT_INTO + "(" + values + ")" + _UPSERT_SET  # only NULL and ? marks put in


def params(record: LeaseRecord) -> tuple[_Nulls, list[object]]:
    """Which nullable columns of ``record`` are NULL, and the rest's values in
    ``upsert``'s order."""
    fingerprint, owner = record.fingerprint, record.owner
    completed_ms, result = record.completed_ms, record.result
    bound: list[object] = [bytearray(record.key_id)]
    if fingerprint is not None:
        bound.append(bytearray(fingerprint))
    bound += (record.absolute_expires_ms, record.fencing_token)
    if owner is not None:
        bound.append(bytearray(owner))
    bound.append(record.lease_expires_ms)
    if completed_ms is not None:
        bound.append(completed_ms)
    if result is not None:
        bound.append(result)
    bound.append(record.updated_ms)
    nulls = (fingerprint is None, owner is None, completed_ms is None, result is None)
    return nulls, bound


@functools.lru_cache(maxsize=64)
def select_many(count: int) -> str:
    """The batch read for ``count`` key ids (only ``?`` marks are put into the text)."""
    return _SELECT_MANY + "(" + ", ".join("?" * count) + ")"


def read_records(conn: sqlite3.Connection, keys: list[bytes]) -> dict[bytes, LeaseRecord]:
    """The stored records of ``keys`` (distinct), ``SELECT_CHUNK`` keys a statement."""
    records: dict[bytes, LeaseRecord] = {}
    for at in range(0, len(keys), SELECT_CHUNK):
        chunk = keys[at : at + SELECT_CHUNK]
        blobs = [bytearray(key) for key in chunk]  # not bytes: see upsert
        for row in conn.execute(select_many(len(chunk)), blobs):
            records[row[0]] = LeaseRecord(*row)
    return records


def write_records(conn: sqlite3.Connection, records: list[LeaseRecord]) -> None:
    """Insert or overwrite ``records`` (one per key): one statement per shape of NULLs."""
    rows: dict[_Nulls, list[list[object]]] = {}
    for record in records:
        nulls, bound = params(record)
        rows.setdefault(nulls, []).append(bound)
    for nulls, same in rows.items():
        conn.executemany(upsert(nulls), same)


def write_fence(conn: sqlite3.Connection, value: int) -> None:
    conn.execute(_WRITE_FENCE, (value,))


def raise_fence(conn: sqlite3.Connection, at_least: int) -> int:
    """Raise the fencing counter to ``at_least`` unless it is higher; the counter."""
    conn.execute(_RAISE_FENCE, (at_least,))
    (value,) = conn.execute(READ_FENCE).fetchone()
    return int(value)


def purge_step(conn: sqlite3.Connection, after: bytes, limit: int, now_ms: int) -> Purged:
    """Look at the next ``limit`` keys past ``after`` and delete the finished ones."""
    seen, last = conn.execute(_PURGE_SPAN, (after, limit)).fetchone()
    if not seen:
        return Purged(0, None)
    deleted = conn.execute(_PURGE, (after, last, now_ms)).rowcount
    return Purged(deleted, bytes(last) if seen == limit else None)


_TABLES = ("leases", "meta")


@functools.cache
def _expected_columns() -> dict[str, list[tuple[str, str, int, int]]]:
    """Each table's columns as ``SCHEMA`` makes them (``_TABLE_COLUMNS``)."""
    with contextlib.closing(sqlite3.connect(":memory:")) as conn:
        conn.executescript(SCHEMA)
        return {table: conn.execute(_TABLE_COLUMNS, (table,)).fetchall() for table in _TABLES}


def foreign_tables(conn: sqlite3.Connection) -> str | None:
    """Why a table named as one of ours is not ours, or None (a missing one is fine)."""
    for table, expected in _expected_columns().items():
        found = conn.execute(_TABLE_COLUMNS, (table,)).fetchall()
        if found and (problem := not_ours(table, found, expected)) is not None:
            return problem
    return None


def schema_problem(conn: sqlite3.Connection) -> str | None:
    """What keeps the store from deciding (its tables, columns, schema version or
    fencing counter not as this leasekeeper makes them), or None."""
    for table in _TABLES:
        if not conn.execute(_TABLE_COLUMNS, (table,)).fetchone():
            return f"it has no table {table}"
    problem = foreign_tables(conn)
    if problem is not None:
        return problem
    version = conn.execute(READ_VERSION).fetchone()
    if version is None or version[0] != SCHEMA_VERSION:
        found = "none" if version is None else repr(version[0])
        return f"its schema version is {found}, and this leasekeeper's is {SCHEMA_VERSION}"
    fence = conn.execute(READ_FENCE).fetchone()
    if fence is None or type(fence[0]) is not int or fence[0] < 0:
        return "its fencing counter cannot be read"
    return None


def connect_writer(path: Path, timeout: float) -> sqlite3.Connection:
    """The writer's connection to ``path``: WAL mode, the schema created or checked, and
    ``synchronous=NORMAL`` (the syncer fsyncs the WAL before any answer)."""
    if sqlite3.sqlite_version_info < _OLDEST_SQLITE:
        # Refused before any file is made: every batch's upsert would fail instead.
        oldest = ".".join(map(str, _OLDEST_SQLITE))
        raise RuntimeError(
            f"this Python's SQLite is {sqlite3.sqlite_version}; leasekeeper needs "
            f"{oldest} or later (for its upserts): use a Python built with a newer SQLite"
        )
    conn = sqlite3.connect(
        path, isolation_level=None, check_same_thread=False, cached_statements=64
    )
    try:
        _set_up(conn, path, timeout)
    except BaseException:  # a file that is no database, a lock not taken: not left to the GC
        conn.close()
        raise
    return conn


def _set_up(conn: sqlite3.Connection, path: Path, timeout: float) -> None:
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute(f"PRAGMA cache_size = {_CACHE_KIB}")
    # Checkpoints run on a thread of their own (Checkpointer), never inside a COMMIT.
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.execute(f"PRAGMA journal_size_limit = {_WAL_KEEP_BYTES}")
    conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
    conn.execute("BEGIN IMMEDIATE")
    try:
        # Before anything is written: another program's tables of the same names.
        if (problem := foreign_tables(conn)) is not None:
            raise RuntimeError(f"{problem}: use another file")
        for statement in SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        created = conn.execute(
            "INSERT OR IGNORE INTO meta (name, value) VALUES ('schema_version', ?)",
            (SCHEMA_VERSION,),
        ).rowcount
        (version,) = conn.execute(READ_VERSION).fetchone()
        if isinstance(version, int) and version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{path} has schema version {version}; this leasekeeper "
                f"knows up to {SCHEMA_VERSION}: upgrade leasekeeper"
            )
        if (problem := schema_problem(conn)) is not None:
            raise RuntimeError(problem)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    if created:  # a server started in another directory than usual shows here
        log.info("created a new, empty store at %s", path.resolve())
    # The event loop takes the write lock without waiting; the writer's thread sets
    # the timeout around its own BEGIN.
    conn.execute("PRAGMA busy_timeout = 0")
    # From here a COMMIT does not fsync the WAL: the syncer does, before any answer.
    conn.execute("PRAGMA synchronous = NORMAL")


def exists(path: Path, timeout: float) -> bool:
    """Whether a file holding leasekeeper's tables is at ``path``, read without changing
    anything. A damaged store is there; another read failure raises ``sqlite3.Error``."""
    if not path.is_file():
        return False
    try:
        with _read_only(path, timeout, leave_no_files=True) as conn:
            tables = conn.execute(STORE_TABLES).fetchone()
            if tables is None or tables[0] != 2:
                return False
            version = conn.execute(READ_VERSION).fetchone()
    except sqlite3.DatabaseError as exc:
        code = primary_code(exc)
        if code == sqlite3.SQLITE_NOTADB:
            return False  # not a database at all: no store of ours
        if code == sqlite3.SQLITE_CORRUPT:
            return True  # a damaged one: whose it was cannot be read; not "none here"
        raise
    return version is not None


def damage(path: Path, timeout: float) -> str | None:
    """What ``integrity_check`` finds wrong, or None; ``ServiceUnavailable`` when the
    file cannot be read. A PASSIVE checkpoint first, so a leftover WAL is checked too."""
    try:
        real = path.resolve()  # the WAL is beside the file, not beside a link to it
        with contextlib.closing(sqlite3.connect(real, timeout=timeout)) as conn:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        with _read_only(path, timeout) as conn:  # never immutable: servers may be writing
            found = conn.execute("PRAGMA integrity_check(1)").fetchone()
    except sqlite3.DatabaseError as exc:
        if primary_code(exc) in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
            return f"the SQLite store is damaged ({exc})"
        # Not the file's fault: a sound store must not be sent back to a backup.
        raise ServiceUnavailable(f"Cannot check the SQLite store at {path}: {exc}") from None
    if found is not None and found[0] == "ok":
        return None
    return f"the SQLite store is damaged ({found[0] if found else ''})"


def count_live(path: Path, timeout: float, now_ms: int) -> int:
    """Leases held at ``now_ms``: a scan on a reader connection (WAL readers do not wait
    for the writer, nor it for them)."""
    with _read_only(path, timeout) as conn:
        (live,) = conn.execute(COUNT_LIVE, (now_ms,)).fetchone()
        return int(live)


def fencing_counter(path: Path) -> int:
    """The counter's committed value."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        row = conn.execute(READ_FENCE).fetchone()
        return int(row[0])


def _read_only(
    path: Path, timeout: float, *, leave_no_files: bool = False
) -> contextlib.closing[sqlite3.Connection]:
    """A read-only connection; ``immutable`` with ``leave_no_files`` and no WAL beside
    the real file (so no ``-wal`` or ``-shm`` is created)."""
    real = path.resolve()
    mode = "mode=ro"
    if leave_no_files and not Path(f"{real}-wal").exists():
        mode += "&immutable=1"
    uri = f"{real.as_uri()}?{mode}"
    return contextlib.closing(sqlite3.connect(uri, uri=True, timeout=timeout))
