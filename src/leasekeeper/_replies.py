"""The reply bodies, declared once as types: one per shape the API answers with.

``LeaseService`` builds its replies as these TypedDicts (plain dicts at run time,
checked by mypy); the errors' are ``LeaseError.body()``. The OpenAPI response schemas
derive from them, each class's docstring being its description.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field
from typing_extensions import TypedDict  # pydantic reads only this one on Python 3.11

from leasekeeper._schemas import NamespaceStr, OwnerTokenStr

__all__ = [
    "Alive",
    "Completed",
    "Conflict",
    "Error",
    "Granted",
    "Held",
    "LeaseTimes",
    "Lost",
    "Namespace",
    "Ready",
    "Refused",
    "Released",
    "Renewed",
    "ReplyBody",
    "RetryLater",
]

# int64: generators map a bare integer to int32, and fencing tokens can pass 2^31.
_FencingToken = Annotated[int, Field(ge=1, le=2**63 - 1, json_schema_extra={"format": "int64"})]
_Timestamp = Annotated[
    int, Field(description="Unix seconds, rounded down", json_schema_extra={"format": "int64"})
]
_ISO = "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z$"
_IsoTime = Annotated[str, Field(pattern=_ISO, description="ISO 8601 UTC, YYYY-MM-DDTHH:MM:SSZ")]
_RetryAfter = Annotated[int, Field(ge=1)]


class Namespace(TypedDict):
    """A new namespace. Keep it secret; it cannot be listed or recovered."""

    ok: Literal[True]
    namespace: NamespaceStr
    entropy_bits: Literal[256]


class LeaseTimes(TypedDict):
    """A live lease's times, as granted and renewed."""

    ttl_seconds: Annotated[int, Field(ge=0)]
    fencing_token: _FencingToken
    lease_expires_at_timestamp: _Timestamp
    lease_expires_at: _IsoTime
    absolute_expires_at_timestamp: _Timestamp
    absolute_expires_at: _IsoTime


class Renewed(LeaseTimes):
    """The lease has a new expiry."""

    ok: Literal[True]
    status: Literal["held"]


class Granted(Renewed):
    """You own the lease. Keep owner_token secret; send fencing_token with your writes."""

    owner_token: OwnerTokenStr


class Released(TypedDict):
    """The lease ended; the key can be acquired at once."""

    ok: Literal[True]
    status: Literal["released"]
    fencing_token: _FencingToken


class Completed(TypedDict):
    """The work is done; here is its stored result."""

    ok: Literal[True]
    status: Literal["completed"]
    completed_at: _IsoTime
    result: Annotated[Any, Field(description="The stored JSON value, secret-named fields redacted")]
    fencing_token: _FencingToken
    absolute_expires_at: _IsoTime


#: What ``LeaseService`` replies with.
ReplyBody = Namespace | Granted | Renewed | Released | Completed


class _Refusal(TypedDict):
    ok: Literal[False]
    error: str


class Refused(_Refusal):
    """The request was refused; error says why."""

    status: Literal[
        "invalid", "too_large", "not_found", "method_not_allowed", "timeout", "internal"
    ]


class RetryLater(_Refusal):
    """Too many requests, or the store is unavailable: retry after retry_after_seconds."""

    status: Literal["rate_limited", "unavailable"]
    retry_after_seconds: _RetryAfter


class Held(_Refusal):
    """Another owner holds the lease: retry after retry_after_seconds (the Retry-After header)."""

    status: Literal["held"]
    retry_after_seconds: _RetryAfter
    fencing_token: _FencingToken
    lease_expires_at: _IsoTime
    absolute_expires_at: _IsoTime


class Conflict(_Refusal):
    """The key is bound to another fingerprint until absolute_expires_at."""

    status: Literal["conflict"]
    absolute_expires_at: _IsoTime


class Lost(_Refusal):
    """You are not (or no longer) the live owner."""

    status: Literal["lost"]


#: Any error body, told apart by its ``status``.
Error = Annotated[Refused | RetryLater | Held | Conflict | Lost, Field(discriminator="status")]


class Alive(TypedDict):
    """The process is running."""

    ok: Literal[True]
    status: Literal["alive"]


class Ready(TypedDict):
    """The store can be reached and written."""

    ok: Literal[True]
    status: Literal["ready"]
