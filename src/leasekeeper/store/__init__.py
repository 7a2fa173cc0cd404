"""Lease stores, chosen by URL scheme in ``open_store`` and nowhere else.

=================================  ===========================================
``sqlite:///relative/path.db``     embedded SQLite file (the default,
``sqlite:////absolute/path.db``    ``sqlite:///./leasekeeper.db``)
``postgresql://user@host/db``      PostgreSQL, for several service instances
``postgres://user@host/db``        (the same); needs ``leasekeeper[postgres]``
``memory://``                      in-process dict; nothing survives a restart
=================================  ===========================================
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from leasekeeper._clock import Clock
from leasekeeper.store._base import (
    MAX_FENCING_TOKEN,
    MAX_RAISED_FENCE,
    ChangeFeed,
    Durable,
    LiveCounter,
    Purged,
    Store,
    decide_with_fence,
)
from leasekeeper.store._memory import MemoryStore
from leasekeeper.store._sqlite import SqliteStore

__all__ = [
    "MAX_FENCING_TOKEN",
    "MAX_RAISED_FENCE",
    "ChangeFeed",
    "Durable",
    "LiveCounter",
    "MemoryStore",
    "Purged",
    "SqliteStore",
    "Store",
    "StoreURLError",
    "decide_with_fence",
    "describe_store",
    "open_store",
]


class StoreURLError(ValueError):
    """The store URL names no backend this leasekeeper has, or is malformed."""


def open_store(
    url: str,
    *,
    clock: Clock | None = None,
    timeout_seconds: float = 5.0,
    pool_size: int | None = None,
) -> Store:
    """The store for ``url``, not yet opened (``await store.open()``).

    ``clock`` replaces the store's time source (tests); ``timeout_seconds`` bounds how
    long a request waits for the store; ``pool_size`` is the most connections a
    PostgreSQL store opens (``None``: its default; the other stores have no pool)."""
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme == "sqlite":
        return SqliteStore(_sqlite_path(url), clock, timeout_seconds=timeout_seconds)
    if scheme == "memory":
        if rest:  # a path or a host would suggest a file that is not written
            raise StoreURLError("a memory store's URL is memory:// alone (nothing is kept)")
        return MemoryStore(clock)
    if scheme in ("postgresql", "postgres"):
        return _postgres_store(url, clock, timeout_seconds, pool_size)
    raise StoreURLError(
        "unknown store URL scheme; use sqlite:///path.db, postgresql://… or memory://"
    )


def describe_store(store: Store) -> str:
    """The store in use, for the line a server logs at every start (``Durable.described``);
    never a password or a user name."""
    if isinstance(store, Durable):
        return store.described
    return "memory (nothing is kept after the process ends)"


def _sqlite_path(url: str) -> str:
    """The file a ``sqlite:`` URL names; ``StoreURLError`` for one that would open another:
    ``sqlite://data/x.db`` names a host (``data``) that would be dropped, opening
    ``./x.db``, a new store whose tokens start again at 1; a query or a fragment would
    be ignored; a NUL cannot be in a path."""
    shape = "sqlite:///relative/path.db or sqlite:////absolute.db"
    parts = urlsplit(url)
    if parts.netloc:
        raise StoreURLError(f"a SQLite store URL has no host; write {shape}")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise StoreURLError(f"a SQLite store URL takes no ?query or #fragment; write {shape}")
    path = unquote(parts.path)
    if not path.startswith("/") or len(path) < 2:
        raise StoreURLError(f"SQLite store URLs look like {shape}")
    if "\x00" in path:
        raise StoreURLError("a SQLite store path cannot hold a NUL character (%00)")
    return path[1:]


def _postgres_store(
    url: str, clock: Clock | None, timeout_seconds: float, pool_size: int | None
) -> Store:
    # Imported here: psycopg is an optional dependency (``leasekeeper[postgres]``).
    try:
        from leasekeeper.store._postgres import DEFAULT_POOL_SIZE, PostgresStore
    except ImportError as exc:
        raise StoreURLError(
            "the PostgreSQL store needs psycopg and psycopg-pool: "
            "pip install 'leasekeeper[postgres]'"
        ) from exc
    # libpq knows the scheme only in lower case.
    url = "postgresql" + url[url.index("://") :]
    max_size = DEFAULT_POOL_SIZE if pool_size is None else pool_size
    try:
        return PostgresStore(url, clock=clock, timeout_seconds=timeout_seconds, max_size=max_size)
    except ValueError as exc:
        raise StoreURLError(f"PostgreSQL store: {exc}") from None
