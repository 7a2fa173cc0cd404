"""Settings: read once from an environment mapping at start, then passed down.

Every variable is optional: ``LEASEKEEPER_`` + the field's name in capitals; a bad
value is an error naming it, at start. The docs' settings table is rendered from the
fields' docstrings and defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Settings", "SettingsError", "unknown_variables"]

_PREFIX = "LEASEKEEPER_"
T = TypeVar("T")


#: The longest lifecycle: 10 years, so that every expiry stays a four-digit-year time.
MAX_LIFECYCLE_SECONDS = 315_360_000
#: The longest store timeout: Linux's largest TCP keepalive idle time, which it sets.
MAX_STORE_TIMEOUT_SECONDS = 32_767
#: The most records one cleanup step deletes: far more than a step needs, far below
#: the 64-bit integers SQLite and PostgreSQL bind.
MAX_CLEANUP_BATCH = 100_000
#: LEASEKEEPER_* names that are not server settings: the client's, and the test suite's.
_NOT_SETTINGS = frozenset(
    {
        "LEASEKEEPER_URL",
        "LEASEKEEPER_NAMESPACE",
        "LEASEKEEPER_OWNER_TOKEN",
        "LEASEKEEPER_FENCING_TOKEN",
        "LEASEKEEPER_TEST_POSTGRES_URL",
        "LEASEKEEPER_SOAK",
    }
)


class SettingsError(ValueError):
    """A setting has a value leasekeeper cannot use; the message names the environment
    variable, or the command's flag when the value came from one."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything configurable, with the spec's defaults."""

    store: str = "sqlite:///./leasekeeper.db"
    """Where leases are kept: ``sqlite:///relative.db``, ``sqlite:////absolute.db``,
    ``postgresql://…`` (or ``postgres://``) for several instances on one database, or
    ``memory://``, which writes nothing down (for tests and trials). Refused: a SQLite URL with
    a host (``sqlite://data/x.db``), a query or a fragment; anything after ``memory://``; a
    PostgreSQL user name or password holding ``@``, ``/`` or ``#`` unencoded."""
    host: str = "127.0.0.1"
    """The address ``serve`` listens on; ``0.0.0.0`` for every interface (an empty value is
    refused)."""
    port: int = 8787
    """The TCP port ``serve`` listens on, 1 to 65535."""
    lifecycle_seconds: int = 86_400
    """Length of a key's lifecycle from its first acquire: its fingerprint binding and its result
    last this long. At most 315360000 (10 years)."""
    cleanup_interval_seconds: float = 3600.0
    """Pause between two cleanups of finished records in ``serve`` and ``mcp``; the first runs at
    a random point of the first interval."""
    cleanup_batch: int = 200
    """Records per cleanup batch: deleted at most (on SQLite: looked at). At most 100000."""
    store_timeout_seconds: float = 5.0
    """Longest wait for the store (a connection, a statement, opening it) before a request is
    answered 503. At most 32767."""
    postgres_pool_size: int = 10
    """The most connections one instance opens to PostgreSQL; SQLite and memory ignore it."""
    max_body_bytes: int = 65_536
    """Largest request body, on the API and ``/mcp`` (and the longest line ``leasekeeper mcp``
    reads); past it 413."""
    max_connections: int = 1000
    """Concurrent connections, and so requests in flight; past it a new request gets a JSON 503."""
    request_timeout_seconds: float = 10.0
    """Time a client has to send a request's headers, and again its body; past it 408 and the
    connection is closed."""
    keep_alive_seconds: int = 30
    """Idle time before a kept-alive connection is closed."""
    namespace_rate: float = 10.0
    """Namespace mints per second per client address, over HTTP and ``/mcp`` together (0 = off)."""
    namespace_burst: int = 100
    """Mints one client address may make at once before ``LEASEKEEPER_NAMESPACE_RATE`` applies."""
    address_rate: float = 0.0
    """Requests per second per client address, API routes and ``/mcp`` tool calls together (0 =
    off)."""
    address_burst: int = 1000
    """Requests one client address may make at once before ``LEASEKEEPER_ADDRESS_RATE`` applies."""
    namespace_request_rate: float = 0.0
    """Requests per second per namespace, API routes and ``/mcp`` tool calls together (0 = off)."""
    namespace_request_burst: int = 1000
    """Requests one namespace may take at once before
    ``LEASEKEEPER_NAMESPACE_REQUEST_RATE`` applies."""
    live_leases_interval_seconds: float = 15.0
    """How often the store counts live leases for the ``leasekeeper_live_leases`` metric (0 =
    never)."""
    log_level: str = "INFO"
    """``DEBUG``, ``INFO``, ``WARNING``, ``ERROR`` or ``CRITICAL``."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``environ`` (default ``os.environ``); ``overrides`` win (CLI flags)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            name = _PREFIX + field.name.upper()
            raw = env.get(name)
            if raw is None or not raw.strip():  # set but empty (or spaces): the default
                continue
            values[field.name] = _cast(name, raw, _CASTS[field.name])
        flags = {k for k, v in overrides.items() if v is not None}
        values.update({k: overrides[k] for k in flags})
        settings = cls(**values)
        settings._check(flags)
        return settings

    def _check(self, flags: set[str]) -> None:
        """Refuse values the server cannot run with, naming where each came from: the
        ``LEASEKEEPER_*`` variable, or the command's flag for those in ``flags``."""

        def name(field: str) -> str:
            if field in flags:
                return "--" + field.replace("_", "-")
            return _PREFIX + field.upper()

        positive = (
            "lifecycle_seconds cleanup_interval_seconds cleanup_batch store_timeout_seconds "
            "postgres_pool_size max_body_bytes max_connections request_timeout_seconds "
            "keep_alive_seconds namespace_burst address_burst namespace_request_burst"
        )
        for field in positive.split():
            if getattr(self, field) <= 0:
                raise SettingsError(f"{name(field)} must be greater than 0")
        rates = "live_leases_interval_seconds namespace_rate address_rate namespace_request_rate"
        for field in rates.split():
            if getattr(self, field) < 0:
                raise SettingsError(f"{name(field)} must be 0 (off) or a positive number")
        if self.lifecycle_seconds > MAX_LIFECYCLE_SECONDS:
            raise SettingsError(
                f"{name('lifecycle_seconds')} must be at most {MAX_LIFECYCLE_SECONDS} (10 years)"
            )
        if self.store_timeout_seconds > MAX_STORE_TIMEOUT_SECONDS:
            raise SettingsError(
                f"{name('store_timeout_seconds')} must be at most {MAX_STORE_TIMEOUT_SECONDS}"
            )
        if self.cleanup_batch > MAX_CLEANUP_BATCH:
            raise SettingsError(f"{name('cleanup_batch')} must be at most {MAX_CLEANUP_BATCH}")
        if not self.host.strip():  # uvicorn would listen on every interface
            raise SettingsError(
                f"{name('host')} must be an address to listen on "
                "(127.0.0.1 by default; 0.0.0.0 for every interface)"
            )
        if not 0 < self.port < 65536:
            raise SettingsError(f"{name('port')} must be a TCP port from 1 to 65535")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise SettingsError(
                f"{name('log_level')} must be DEBUG, INFO, WARNING, ERROR or CRITICAL"
            )


def _cast(name: str, raw: str, cast: Callable[[str], T]) -> T:
    try:
        value = cast(raw.strip())
    except ValueError:
        kinds: dict[object, str] = {int: "a whole number", float: "a number", str: "text"}
        kind = kinds.get(cast, "a value")
        raise SettingsError(f"{name} must be {kind}") from None
    # float() takes "nan" and "inf", which every comparison in _check lets through
    # (a mint rate of NaN would be no limit at all).
    if isinstance(value, float) and not math.isfinite(value):
        raise SettingsError(f"{name} must be a finite number")
    return value


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """The ``LEASEKEEPER_*`` names in ``environ`` (default ``os.environ``) that nothing
    reads, a misspelling say, sorted, each with the setting's name it is closest to (or
    None): the server warns of them at start, by name alone (a value may be a secret)."""
    env = os.environ if environ is None else environ
    known = {_PREFIX + field.name.upper() for field in dataclasses.fields(Settings)}
    return [
        (name, next(iter(difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)), None))
        for name in sorted(env)
        if name.startswith(_PREFIX) and name not in known and name not in _NOT_SETTINGS
    ]


_CASTS: dict[str, Callable[[str], Any]] = {
    field.name: {"int": int, "float": float, "str": str}[str(field.type)]
    for field in dataclasses.fields(Settings)
}
