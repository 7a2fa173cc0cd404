"""Fresh stores for the benchmark, and pre-filling them fast with a million records.

Pre-filling writes rows straight into the store's table, in the store's own format
(the same columns ``SqliteStore`` and ``PostgresStore`` use): digests are random
bytes, so no key in the workloads ever meets a pre-filled one, but every write
lands in a table, and an index, of that size. The fencing counter is raised past
every pre-filled token.

The order rows are written in is the order a store would have seen them:

* SQLite keeps its table in key order whatever the order of the writes, so rows go
  in key order (fast), with key ids spread evenly over the whole key space (a
  counter in the first four bytes, scaled to 2**32, then random bytes), so new
  random keys still land everywhere in the tree.
* PostgreSQL appends rows to its heap in the order they are written, and a real
  store's records were created one after another over the day: rows go in order of
  creation, which is also the order their lifecycles end in, with random key ids.
  (Writing them in key order would leave a heap sorted by HMAC digest, which no
  running store has.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from leasekeeper._core.model import LeaseRecord
from leasekeeper.store import StoreURLError, open_store

#: The leases table's columns: ``LeaseRecord``'s fields, in their order.
COLUMNS = LeaseRecord.__struct_fields__
_RESULT = '{"charge":"ch_3MtwBwLkdIwHu7ix28a3tqPa","amount":4200,"currency":"EUR"}'
_CHUNK = 50_000


class Unavailable(Exception):
    """This store cannot be benchmarked here; the message says why and what to do."""


class StoreTarget(Protocol):
    name: str

    def fresh(self) -> str:
        """The URL of a new, empty store with its schema created."""
        ...

    def prefill(self, url: str, count: int, *, expired: bool) -> None:
        """Add ``count`` records; ``expired``: their lifecycle is over (for cleanup)."""
        ...

    def expired(self, url: str) -> int:
        """How many records whose lifecycle is over the store still holds."""
        ...

    def discard(self, url: str) -> None:
        """Delete the store made by ``fresh``."""
        ...


def rows(
    count: int, *, expired: bool, by_time: bool = False, seed: int = 6
) -> Iterator[list[tuple[Any, ...]]]:
    """``count`` records in chunks, a third each held, released, completed: in key order,
    or with ``by_time`` in the order they were created (see the module docstring)."""
    rng = random.Random(seed)
    now = time.time_ns() // 1_000_000
    day = 86_400_000
    step = 2**32 / count
    span = day - 60_000
    chunk: list[tuple[Any, ...]] = []
    for i in range(count):
        if by_time:  # the later a record was created, the later its lifecycle ends
            key_id = rng.randbytes(32)
            offset = span * i // count
        else:
            key_id = int(i * step).to_bytes(4, "big") + rng.randbytes(28)
            offset = rng.randrange(span)
        fingerprint = rng.randbytes(32) if i % 2 else None
        if expired:  # the lifecycle ended between a day and a minute ago
            absolute = now - day + offset
        else:  # it ends between a minute and a day from now
            absolute = now + 60_000 + offset
        updated = absolute - day - rng.randrange(0, 60_000)  # its last decision
        owner: bytes | None = None
        lease_expires, completed, result = updated, None, None
        if i % 3 == 0:  # held (or expired: it was a 60 s lease)
            owner, lease_expires = rng.randbytes(32), updated + 60_000
        elif i % 3 == 2:  # completed; the rest are released
            completed, result = updated, _RESULT
        chunk.append(
            (key_id, fingerprint, absolute, i + 1, owner, lease_expires, completed, result, updated)
        )
        if len(chunk) == _CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _create(url: str) -> None:
    """Open and close the store once: it creates its schema as the server would."""

    async def run() -> None:
        store = open_store(url)
        await store.open()
        await store.close()

    asyncio.run(run())


class SqliteTarget:
    """SQLite files in the run's temporary directory."""

    name = "sqlite"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._count = 0

    def fresh(self) -> str:
        self._count += 1
        url = f"sqlite:///{self.workdir / f'store-{self._count}.db'}"
        _create(url)
        return url

    @staticmethod
    def _path(url: str) -> Path:
        return Path(url.removeprefix("sqlite:///"))

    def prefill(self, url: str, count: int, *, expired: bool) -> None:
        with contextlib.closing(sqlite3.connect(self._path(url), isolation_level=None)) as conn:
            columns = tuple(row[1] for row in conn.execute("PRAGMA table_info(leases)"))
            if columns != COLUMNS:
                raise Unavailable(f"the SQLite store's table has other columns: {columns}")
            conn.execute("PRAGMA synchronous = OFF")
            conn.execute("PRAGMA cache_size = -262144")
            conn.execute("BEGIN")
            for chunk in rows(count, expired=expired):
                conn.executemany("INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", chunk)
            conn.execute("UPDATE meta SET value = max(value, ?) WHERE name = 'fence'", (count,))
            conn.execute("COMMIT")
            conn.execute("ANALYZE")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        # At synchronous=OFF the checkpoint left the fill in the kernel's page cache, and
        # the kernel would write it back some 30 s later (vm.dirty_expire_centisecs), in
        # the middle of the measured runs: in run O, 134 MB in 3 s while idempotency ran,
        # which measured 0.77 of the empty store. Written out now, as PostgreSQL's is.
        fd = os.open(self._path(url), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def expired(self, url: str) -> int:
        with contextlib.closing(sqlite3.connect(self._path(url))) as conn:
            now = time.time_ns() // 1_000_000
            query = "SELECT count(*) FROM leases WHERE absolute_expires_ms <= ?"
            return int(conn.execute(query, (now,)).fetchone()[0])

    def discard(self, url: str) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self._path(url)}{suffix}").unlink(missing_ok=True)


class MemoryTarget:
    """The same server on the memory store (``memory://``), which writes nothing down.

    Not a store anyone should run: it is the ceiling of the others. Its ratio is what
    the server costs with no durable store under it (HTTP, validation, the tokens'
    HMACs, the rules, the reply), so a store's distance below it is what its
    durability costs. It keeps nothing to pre-fill, so it has no growth or cleanup runs.
    """

    name = "memory"

    def fresh(self) -> str:
        return "memory://"

    def prefill(self, url: str, count: int, *, expired: bool) -> None:
        raise Unavailable("the memory store keeps no records to grow or clean up")

    def expired(self, url: str) -> int:
        return 0

    def discard(self, url: str) -> None:
        return None


class PostgresTarget:
    """A schema of its own per store (``bench_<random>``), dropped afterwards."""

    name = "postgresql"

    def __init__(self, url: str) -> None:
        self.url = url
        self._schemas: dict[str, str] = {}
        try:
            open_store(url)
        except StoreURLError as exc:
            raise Unavailable(f"not available on this branch ({exc})") from None
        try:
            import psycopg

            with psycopg.connect(url, connect_timeout=5) as conn:
                conn.execute("SELECT 1")
        except ImportError:
            raise Unavailable(
                "psycopg is not installed: pip install 'leasekeeper[postgres]'"
            ) from None
        except Exception as exc:
            raise Unavailable(f"PostgreSQL is not reachable at {url}: {exc}") from None

    def _connect(self, url: str | None = None) -> Any:
        import psycopg

        return psycopg.connect(url or self.url, autocommit=True, connect_timeout=5)

    def fresh(self) -> str:
        schema = f"bench_{secrets.token_hex(6)}"
        with self._connect() as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        separator = "&" if "?" in self.url else "?"
        url = f"{self.url}{separator}options={quote(f'-csearch_path={schema}')}"
        self._schemas[url] = schema
        _create(url)
        return url

    def prefill(self, url: str, count: int, *, expired: bool) -> None:
        with self._connect(url) as conn:
            found = conn.execute(
                "SELECT column_name FROM information_schema.columns "
                "WHERE table_schema = %s AND table_name = 'leasekeeper_leases' "
                "ORDER BY ordinal_position",
                (self._schemas[url],),
            ).fetchall()
            columns = tuple(name for (name,) in found)
            if columns != COLUMNS:
                raise Unavailable(f"the PostgreSQL store's table has other columns: {columns}")
            with conn.transaction():
                conn.execute("SET LOCAL synchronous_commit = off")
                statement = f"COPY leasekeeper_leases ({', '.join(COLUMNS)}) FROM STDIN"
                with conn.cursor().copy(statement) as copy:
                    for chunk in rows(count, expired=expired, by_time=True):
                        for row in chunk:
                            copy.write_row(row)
                conn.execute(
                    "SELECT setval('leasekeeper_fence', greatest(%s, "
                    "(SELECT last_value FROM leasekeeper_fence)))",
                    (count,),
                )
            conn.execute("VACUUM ANALYZE leasekeeper_leases")
            # As SQLite's prefill ends with a checkpoint: the bulk load is written out now,
            # not by a checkpoint in the middle of the measured runs.
            conn.execute("CHECKPOINT")

    def expired(self, url: str) -> int:
        with self._connect(url) as conn:
            now = time.time_ns() // 1_000_000
            query = "SELECT count(*) FROM leasekeeper_leases WHERE absolute_expires_ms <= %s"
            return int(conn.execute(query, (now,)).fetchone()[0])

    def discard(self, url: str) -> None:
        schema = self._schemas.pop(url, None)
        if schema is not None:
            with self._connect() as conn:
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")

    def close(self) -> None:
        for url in list(self._schemas):
            with contextlib.suppress(Exception):
                self.discard(url)
