"""What the PostgreSQL store says to the database: its session (the connection string
and the schema it pins), its statements, and its migration.

Every statement is a constant or built from constants only; the store reads this
module as a namespace (``sql.LOCK_ROWS``). A URL may hold a password: no message here
repeats it, nor libpq's words about it.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from typing import Any, Final

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import TupleRow

from leasekeeper._core.model import LeaseRecord
from leasekeeper._errors import ServiceUnavailable
from leasekeeper.store._base import not_ours

log = logging.getLogger("leasekeeper.store.postgres")

Connection = psycopg.AsyncConnection[TupleRow]

SCHEMA_VERSION: Final = 1

# The fencing counter is a SEQUENCE: strictly increasing across sessions, durable once
# a transaction that used it commits, and no lock held until COMMIT. CACHE must stay 1
# (with blocks per session, an older block would grant lower tokens after a newer
# one). Rolled-back draws leave gaps, which the contract allows.
_SEQUENCE: Final = """
    CREATE SEQUENCE IF NOT EXISTS leasekeeper_fence
        AS bigint MINVALUE 1 MAXVALUE 9223372036854775807 START 1 CACHE 1 NO CYCLE
    """

#: The tables, each column as (name, type, NOT NULL), the first the primary key: created
#: and checked from this. ``result`` is text, not jsonb, so it comes back exactly as stored.
TABLES: Final = {
    "leasekeeper_meta": (("name", "text", True), ("value", "bigint", True)),
    "leasekeeper_leases": (
        ("key_id", "bytea", True),
        ("fingerprint", "bytea", False),
        ("absolute_expires_ms", "bigint", True),
        ("fencing_token", "bigint", True),
        ("owner", "bytea", False),
        ("lease_expires_ms", "bigint", True),
        ("completed_ms", "bigint", False),
        ("result", "text", False),
        ("updated_ms", "bigint", True),
    ),
}


def _create_table(name: str) -> str:
    columns = TABLES[name]
    listed = ", ".join(f"{c} {kind}{' NOT NULL' * required}" for c, kind, required in columns)
    return f"CREATE TABLE IF NOT EXISTS {name} ({listed}, PRIMARY KEY ({columns[0][0]}))"


_DDL: Final = (
    _create_table("leasekeeper_meta"),
    _SEQUENCE,
    _create_table("leasekeeper_leases"),
    """
    CREATE INDEX IF NOT EXISTS leasekeeper_leases_lifecycle_end
        ON leasekeeper_leases (absolute_expires_ms)
    """,
)

# The store's tables' columns in its schema: name, type, NOT NULL, in the primary key.
_TABLE_COLUMNS: Final = (
    "SELECT c.relname::text, a.attname::text, format_type(a.atttypid, a.atttypmod), "
    "a.attnotnull, EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid "
    "AND i.indisprimary AND a.attnum = ANY (i.indkey)) "
    "FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
    "JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p') "
    "AND c.relname IN ('leasekeeper_meta', 'leasekeeper_leases') "
    "AND a.attnum > 0 AND NOT a.attisdropped ORDER BY c.relname, a.attnum"
)
_READ_VERSION: Final = "SELECT value FROM leasekeeper_meta WHERE name = 'schema_version'"

# Serializes schema changes between instances starting at once, per schema (CREATE …
# IF NOT EXISTS is not safe against a concurrent CREATE).
_MIGRATION_LOCK: Final = (
    "SELECT pg_advisory_xact_lock(1818977131, hashtext(coalesce(%s::text, current_schema(), '')))"
)

# The database server's clock in ms (every instance reads it); now() would be frozen.
_DB_NOW_MS: Final = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
# The clock and the batch's transaction id (assigned once FOR UPDATE locked a row):
# after a cut-off COMMIT, txid_status() on another connection says whether it committed.
READ_CLOCK_AND_TXID: Final = f"SELECT {_DB_NOW_MS}, txid_current_if_assigned()"
TXID_STATUS: Final = "SELECT txid_status(%s)"

# Whether a relation is in current_schema(), not merely somewhere on the search_path.
_IN_OWN_SCHEMA: Final = (
    "EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = current_schema() AND c.relname = "
)
_FENCE_IN_OWN_SCHEMA: Final = _IN_OWN_SCHEMA + "'leasekeeper_fence')"
STORE_EXISTS: Final = "SELECT " + _IN_OWN_SCHEMA + "'leasekeeper_meta')"
_FENCE_EXISTS: Final = "SELECT " + _FENCE_IN_OWN_SCHEMA

# The schema the store would be in, and the search_path's schemas holding a store.
WHERE_THE_STORE_IS: Final = (
    "SELECT current_schema(), ARRAY(SELECT n.nspname::text FROM pg_class c "
    "JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.relname = 'leasekeeper_meta' AND n.nspname = ANY (current_schemas(false)) "
    "ORDER BY array_position(current_schemas(false), n.nspname))"
)

BEGIN: Final = "BEGIN ISOLATION LEVEL READ COMMITTED"
# Locked in key order, so batches sharing keys queue instead of deadlocking.
LOCK_ROWS: Final = (
    "SELECT key_id, fingerprint, absolute_expires_ms, fencing_token, owner, "
    "lease_expires_ms, completed_ms, result, updated_ms FROM leasekeeper_leases "
    "WHERE key_id = ANY(%s) ORDER BY key_id FOR UPDATE"
)
NEXT_FENCES: Final = "SELECT nextval('leasekeeper_fence') FROM generate_series(1, %s)"
#: Every instance hears of releases and completions on the channel leasekeeper_keys
#: (the key id's hex digest, never a secret), delivered when the transaction commits.
NOTIFY_CHANGED: Final = "SELECT pg_notify('leasekeeper_keys', k) FROM unnest(%s::text[]) AS k"
LISTEN: Final = "LISTEN leasekeeper_keys"
# The nine columns of a list of records, as arrays (``columns``), as rows ``v``.
_UNNEST: Final = (
    "FROM unnest(%s::bytea[], %s::bytea[], %s::bigint[], %s::bigint[], %s::bytea[], "
    "%s::bigint[], %s::bigint[], %s::text[], %s::bigint[]) AS v (key_id, fingerprint, "
    "absolute_expires_ms, fencing_token, owner, lease_expires_ms, completed_ms, result, "
    "updated_ms) "
)
UPDATE_MANY: Final = (
    "UPDATE leasekeeper_leases AS l SET fingerprint = v.fingerprint, "  # noqa: S608 - module constants only
    "absolute_expires_ms = v.absolute_expires_ms, fencing_token = v.fencing_token, "
    "owner = v.owner, lease_expires_ms = v.lease_expires_ms, "
    "completed_ms = v.completed_ms, result = v.result, updated_ms = v.updated_ms "
    + _UNNEST
    + "WHERE l.key_id = v.key_id"
)
INSERT_MANY: Final = (
    "INSERT INTO leasekeeper_leases (key_id, fingerprint, absolute_expires_ms, "
    "fencing_token, owner, lease_expires_ms, completed_ms, result, updated_ms) "
    "SELECT * " + _UNNEST + "ORDER BY key_id ON CONFLICT (key_id) DO NOTHING RETURNING key_id"
)
# SKIP LOCKED: a row a decision holds is left for the next step. Oldest lifecycle end
# first, by its index; the clock is read once in a subquery (volatile in the WHERE, it
# could not bound the index scan); rows are deleted by the ctid their lock holds still.
PURGE_AT_DB_NOW: Final = (
    "DELETE FROM leasekeeper_leases WHERE ctid = ANY(ARRAY(SELECT ctid FROM leasekeeper_leases "  # noqa: S608 - module constants only
    f"WHERE absolute_expires_ms <= (SELECT {_DB_NOW_MS}) "
    "ORDER BY absolute_expires_ms LIMIT %s FOR UPDATE SKIP LOCKED))"
)
PURGE_AT: Final = (
    "DELETE FROM leasekeeper_leases WHERE ctid = ANY(ARRAY(SELECT ctid FROM leasekeeper_leases "
    "WHERE absolute_expires_ms <= %s ORDER BY absolute_expires_ms LIMIT %s "
    "FOR UPDATE SKIP LOCKED))"
)
PING: Final = "SELECT 1 FROM leasekeeper_leases LIMIT 0"
# What a write needs besides the table: a writable session and the fencing sequence.
CAN_WRITE: Final = (
    "SELECT current_setting('transaction_read_only') = 'off', " + _FENCE_IN_OWN_SCHEMA
)
# ``raise_fence``: ALTER SEQUENCE locks the sequence until COMMIT, so no nextval() runs
# between the read and the setval (which alone could take a drawn value back).
LOCK_FENCE: Final = "ALTER SEQUENCE leasekeeper_fence CACHE 1"
# The counter: the last value drawn, or 0 before the first (last_value is then START).
READ_FENCE: Final = (
    "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM leasekeeper_fence"
)
SET_FENCE: Final = "SELECT setval('leasekeeper_fence', %s)"
# Leases held now: a plain SELECT neither delays a decision nor waits for one.
COUNT_LIVE_AT_DB_NOW: Final = (
    "SELECT count(*) FROM leasekeeper_leases WHERE owner IS NOT NULL AND lease_expires_ms > "  # noqa: S608 - module constants only
    f"(SELECT {_DB_NOW_MS})"
)
COUNT_LIVE_AT: Final = (
    "SELECT count(*) FROM leasekeeper_leases WHERE owner IS NOT NULL AND lease_expires_ms > %s"
)


def columns(records: list[LeaseRecord]) -> tuple[list[Any], ...]:
    """``records`` as the nine column arrays that ``_UNNEST`` reads."""
    return (
        [r.key_id for r in records],
        [r.fingerprint for r in records],
        [r.absolute_expires_ms for r in records],
        [r.fencing_token for r in records],
        [r.owner for r in records],
        [r.lease_expires_ms for r in records],
        [r.completed_ms for r in records],
        [r.result for r in records],
        [r.updated_ms for r in records],
    )


def records(rows: Iterable[TupleRow]) -> dict[bytes, LeaseRecord]:
    """Rows of ``LOCK_ROWS``, by key id."""
    return {bytes(row[0]): LeaseRecord(bytes(row[0]), *row[1:]) for row in rows}


def first_int(row: TupleRow | None) -> int:
    if row is None or row[0] is None:
        raise ServiceUnavailable("The lease store returned no value")
    return int(row[0])


async def migrate(conn: Connection, schema: str | None) -> None:
    """Create or upgrade the schema, in one transaction, one instance at a time."""
    new_in = None
    async with conn.transaction():
        await conn.execute(_MIGRATION_LOCK, (schema,))
        if schema is not None:
            await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        encoding = await (await conn.execute("SHOW server_encoding")).fetchone()
        if encoding is None or encoding[0] != "UTF8":
            raise ServiceUnavailable(
                "The PostgreSQL database must use the UTF8 encoding so that results "
                "round-trip exactly"
            )
        # Before anything is created: tables of these names that are not leasekeeper's.
        problem = _columns_problem(await (await conn.execute(_TABLE_COLUMNS)).fetchall())
        if problem is not None:
            raise ServiceUnavailable(f"Cannot open the PostgreSQL store: {problem}")
        sequence = await conn.execute(_FENCE_EXISTS)
        sequence_was_missing = await sequence.fetchone() == (False,)
        for statement in _DDL:
            await conn.execute(statement)
        if sequence_was_missing:
            await _restart_fence_above_the_table(conn)
        created = await conn.execute(
            "INSERT INTO leasekeeper_meta (name, value) VALUES ('schema_version', %s) "
            "ON CONFLICT (name) DO NOTHING RETURNING current_schema()",
            (SCHEMA_VERSION,),
        )
        new_in = await created.fetchone()
        found = await conn.execute(_READ_VERSION)
        version = first_int(await found.fetchone())
        if version > SCHEMA_VERSION:
            raise ServiceUnavailable(
                f"The PostgreSQL schema has version {version}; this leasekeeper knows up "
                f"to {SCHEMA_VERSION}: upgrade leasekeeper"
            )
        problem = await schema_problem(conn)
        if problem is not None:
            raise ServiceUnavailable(f"Cannot open the PostgreSQL store: {problem}")
        cached = await conn.execute(
            "SELECT cache_size FROM pg_sequences "
            "WHERE schemaname = current_schema() AND sequencename = 'leasekeeper_fence'"
        )
        row = await cached.fetchone()
        if row is not None and row[0] != 1:
            log.warning("the fencing sequence had CACHE %s; setting CACHE 1", row[0])
            await conn.execute("ALTER SEQUENCE leasekeeper_fence CACHE 1")
    if new_in is not None:  # committed: said only of a store that now exists
        log.info("created a new, empty store in the schema %s", new_in[0])


def _columns_problem(rows: Iterable[TupleRow], *, all_there: bool = False) -> str | None:
    """What makes the tables found (rows of ``_TABLE_COLUMNS``) other than ``TABLES``
    says, or None; with ``all_there``, a table missing is a problem too."""
    found: dict[str, list[tuple[Any, ...]]] = {}
    for row in rows:
        found.setdefault(row[0], []).append(tuple(row[1:]))
    for table, columns in TABLES.items():
        if table not in found:
            if all_there:
                return f"it has no table {table}"
            continue
        wanted = [(*column, at == 0) for at, column in enumerate(columns)]
        problem = not_ours(table, found[table], wanted)
        if problem is not None:
            return problem
    return None


async def schema_problem(conn: Connection) -> str | None:
    """What keeps the store from deciding (its tables, columns, schema version or
    fencing counter not as this leasekeeper makes them), or None."""
    rows = await (await conn.execute(_TABLE_COLUMNS)).fetchall()
    problem = _columns_problem(rows, all_there=True)
    if problem is not None:
        return problem
    if await (await conn.execute(_FENCE_EXISTS)).fetchone() != (True,):
        return "the fencing sequence leasekeeper_fence is missing"
    version = await (await conn.execute(_READ_VERSION)).fetchone()
    if version is None or version[0] != SCHEMA_VERSION:
        found = "none" if version is None else str(version[0])
        return f"its schema version is {found}, and this leasekeeper's is {SCHEMA_VERSION}"
    fence = await (await conn.execute(READ_FENCE)).fetchone()
    if fence is None or fence[0] is None or int(fence[0]) < 0:
        return "its fencing counter cannot be read"
    return None


async def _restart_fence_above_the_table(conn: Connection) -> None:
    """Start a just-created fencing sequence above the highest token already stored
    (it was dropped, or left out of a restore)."""
    found = await conn.execute("SELECT max(fencing_token), count(*) FROM leasekeeper_leases")
    row = await found.fetchone()
    if row is None or row[0] is None:
        return
    highest, stored = int(row[0]), int(row[1])
    await conn.execute(SET_FENCE, (highest,))
    log.warning(
        "the fencing sequence was missing beside %d stored records; it was created to "
        "continue above the highest of their tokens (%d). If higher tokens were handed "
        "out before (a restore from a backup), raise it with `leasekeeper fence`",
        stored,
        highest,
    )


#: What ``schema=`` may be: a lower-case identifier that needs no quoting.
SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}\Z")

#: libpq's refusal of a query parameter it does not know: the name is no secret.
_UNKNOWN_PARAMETER = re.compile(r'invalid URI query parameter: "([A-Za-z0-9_]{1,64})"')


def conninfo(url: str, timeout: float, schema: str | None, application_name: str | None) -> str:
    """The connection string: the URL's parameters, with the store's session settings in
    the startup ``options`` (the timeouts first, so the URL can override them;
    ``synchronous_commit=on`` last, so it cannot). The client encoding is always UTF-8.
    """
    _check_userinfo(url)
    try:
        params: dict[str, Any] = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        # Only the name of a query parameter libpq does not know (``?schema=``, say).
        unknown = _UNKNOWN_PARAMETER.match(str(exc))
        if unknown:
            raise ValueError(
                f"malformed PostgreSQL URL: libpq knows no parameter {unknown[1]!r} "
                "(a schema is chosen with ?options=-csearch_path%3Dname)"
            ) from None
        raise ValueError("malformed PostgreSQL URL") from None
    ms = math.ceil(timeout * 1000)
    ours = [
        f"-c statement_timeout={ms}",
        # A session frozen inside a transaction must not hold a key's row lock for long.
        f"-c idle_in_transaction_session_timeout={max(2 * ms, 5000)}",
        "-c lock_timeout=0",
    ]
    given = params.get("options")
    if given:
        ours.append(str(given))
    ours.append("-c synchronous_commit=on")
    if schema is not None:
        ours.append(f"-c search_path={schema}")
    params["options"] = " ".join(ours)
    params["client_encoding"] = "UTF8"
    if application_name is not None:
        params["application_name"] = application_name
    params.setdefault("application_name", "leasekeeper")
    params.setdefault("connect_timeout", str(max(2, math.ceil(timeout))))
    # With several hosts listed (failover), write only to the primary.
    params.setdefault("target_session_attrs", "read-write")
    # Notice a vanished server within seconds instead of the kernel's minutes.
    params.setdefault("keepalives", "1")
    params.setdefault("keepalives_idle", str(max(1, math.ceil(timeout))))
    params.setdefault("keepalives_interval", "1")
    params.setdefault("keepalives_count", "3")
    params.setdefault("tcp_user_timeout", str(ms))
    return make_conninfo("", **params)


def pinned(given: str, current: str | None, holding: list[str]) -> str:
    """``given`` with the search_path pinned to ``current``, so the store's schema stays
    put if one is created ahead of it. Refused when a store stands only further on
    the path (``holding``): a new, empty one would start beside it.
    """
    if current is None:  # no schema to create the tables in: the migration says so
        return given
    if holding and current not in holding:
        raise ServiceUnavailable(
            f'Cannot open the PostgreSQL store: the first schema of the search_path, "'
            f'{current}", holds no leasekeeper store, but "{holding[0]}", later on it, '
            "does; name the schema to use in the URL's options (-c search_path=NAME)"
        )
    params = conninfo_to_dict(given)
    value = _option_value('"' + current.replace('"', '""') + '"')
    params["options"] = f"{params.get('options') or ''} -c search_path={value}".strip()
    return make_conninfo("", **params)


def _check_userinfo(url: str) -> None:
    """``ValueError`` for a user or password holding ``@``, ``/`` or ``#`` unencoded:
    libpq would split it elsewhere than meant and log part of the password. The
    checks follow libpq's own reading of the userinfo."""
    rest = url.partition("://")[2]
    before_path = rest.partition("/")[0]
    if "@" in before_path:
        userinfo, _, after = rest.partition("@")
        split = "@" in after.partition("?")[0] or "#" in userinfo
    else:
        after_slash = rest[len(before_path) + 1 :]
        split = "@" in rest.partition("?")[0] or ("?" in before_path and "@" in after_slash)
    if split:
        raise ValueError(
            "the user name or password holds @, / or # as it is; "
            "percent-encode them (%40, %2F, %23)"
        )


def _option_value(value: str) -> str:
    """``value`` as one word of libpq's ``options``, which splits on whitespace and
    takes a backslash as an escape."""
    return re.sub(r"([\\\s])", r"\\\1", value)
