"""What the client's calls return: small frozen records read from response bodies.

Times are aware UTC ``datetime`` values (``*_timestamp``: the service's Unix seconds);
``body`` keeps the JSON for tools that print it (the CLI); no ``repr`` shows the token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from leasekeeper._errors import InternalError

__all__ = [
    "Completed",
    "Lease",
    "Released",
    "parse_acquire",
    "parse_completed",
    "parse_lease",
    "parse_namespace",
    "parse_released",
]


@dataclass(frozen=True, slots=True)
class Lease:
    """A lease this caller holds: the answer to an acquire (201) or a renew. ``ttl_seconds``
    is the time granted, rounded down (shorter than asked near the end of the key's
    lifecycle); ``lease_expires_at`` is never later than the real expiry."""

    owner_token: str = field(repr=False)
    fencing_token: int
    ttl_seconds: int
    lease_expires_at: datetime
    lease_expires_at_timestamp: int
    absolute_expires_at: datetime
    absolute_expires_at_timestamp: int
    body: dict[str, Any] = field(repr=False, compare=False, hash=False)


@dataclass(frozen=True, slots=True)
class Completed:
    """The key's work is done: the stored (redacted) ``result``, as JSON values."""

    result: Any
    fencing_token: int
    completed_at: datetime
    absolute_expires_at: datetime
    body: dict[str, Any] = field(repr=False, compare=False, hash=False)


@dataclass(frozen=True, slots=True)
class Released:
    """The lease was released; the key can be acquired at once."""

    fencing_token: int
    body: dict[str, Any] = field(repr=False, compare=False, hash=False)


def _invalid(name: str) -> InternalError:
    return InternalError(f"The service's response lacks a valid {name!r}")


def _from_timestamp(name: str, seconds: int) -> datetime:
    try:
        return datetime.fromtimestamp(seconds, UTC)
    except (OverflowError, OSError, ValueError):  # no datetime has that second
        raise _invalid(name) from None


def _iso_field(body: dict[str, Any], name: str) -> datetime:
    # The service writes YYYY-MM-DDTHH:MM:SSZ; fromisoformat reads the Z since 3.11. A
    # time without its zone would be read as this machine's local time: refused.
    try:
        parsed = datetime.fromisoformat(_field(body, name, str))
        if parsed.tzinfo is None:
            raise ValueError(name)
        return parsed.astimezone(UTC)
    except (OverflowError, ValueError):
        raise _invalid(name) from None


def _field(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _invalid(name)
    return value


def _ttl(body: dict[str, Any]) -> int:
    seconds: int = _field(body, "ttl_seconds", int)
    if seconds < 0:
        raise _invalid("ttl_seconds")
    return seconds


def _fence(body: dict[str, Any]) -> int:
    """The fencing token: an integer from 1 to 2**63 - 1, as the service hands out."""
    token: int = _field(body, "fencing_token", int)
    if not 0 < token < 2**63:
        raise _invalid("fencing_token")
    return token


def parse_lease(body: dict[str, Any], owner_token: str | None = None) -> Lease:
    """A ``Lease`` from a held body; a renew body has no token, so the caller passes it."""
    token = owner_token if owner_token is not None else _field(body, "owner_token", str)
    lease_ts = _field(body, "lease_expires_at_timestamp", int)
    absolute_ts = _field(body, "absolute_expires_at_timestamp", int)
    return Lease(
        owner_token=token,
        fencing_token=_fence(body),
        ttl_seconds=_ttl(body),
        lease_expires_at=_from_timestamp("lease_expires_at_timestamp", lease_ts),
        lease_expires_at_timestamp=lease_ts,
        absolute_expires_at=_from_timestamp("absolute_expires_at_timestamp", absolute_ts),
        absolute_expires_at_timestamp=absolute_ts,
        body=body,
    )


def parse_completed(body: dict[str, Any]) -> Completed:
    """A ``Completed`` from a completed body."""
    if "result" not in body:
        raise InternalError("The service's response lacks 'result'")
    return Completed(
        result=body["result"],
        fencing_token=_fence(body),
        completed_at=_iso_field(body, "completed_at"),
        absolute_expires_at=_iso_field(body, "absolute_expires_at"),
        body=body,
    )


def parse_acquire(body: dict[str, Any]) -> Lease | Completed:
    """An acquire's answer: a new ``Lease`` (held) or the stored ``Completed`` result."""
    status = body.get("status")
    if status == "held":
        return parse_lease(body)
    if status == "completed":
        return parse_completed(body)
    raise InternalError("The service's acquire response has an unknown status")


def parse_namespace(body: dict[str, Any]) -> str:
    """The minted namespace from a mint's body."""
    return str(_field(body, "namespace", str))


def parse_released(body: dict[str, Any]) -> Released:
    """A ``Released`` from a release body."""
    return Released(fencing_token=_fence(body), body=body)
