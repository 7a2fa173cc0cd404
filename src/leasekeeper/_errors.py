"""leasekeeper's one exception tree.

Every outcome that is not a success is one of these. The service raises them,
the HTTP and MCP adapters turn them into the same JSON body (``error.body()``)
with the status code from one table (``leasekeeper.http._errors``), and the
client SDK raises the very same classes when it reads such a body back.

::

    LeaseError                      every leasekeeper error; .status, .error, .body()
    ├── RequestError                the request itself is at fault (4xx)
    │   ├── InvalidRequest          400 invalid: bad JSON, wrong type, broken rule
    │   ├── PayloadTooLarge         413 too_large: body over 64 KiB, result over 32 KiB
    │   │   └── HeadersTooLarge     431 too_large: a request's head over 64 KiB (server only)
    │   ├── NotFound                404 not_found: no such route
    │   ├── MethodNotAllowed        405 method_not_allowed
    │   ├── RequestTimeout          408 timeout: headers or body not sent in time (slow client)
    │   └── RateLimited             429 rate_limited; .retry_after_seconds
    ├── LeaseConflict               409: the key's state refuses the request
    │   ├── LeaseHeld               409 held: another owner holds a live lease;
    │   │                           .retry_after_seconds, .fencing_token, expiries
    │   ├── FingerprintConflict     409 conflict: the key is bound to another fingerprint
    │   └── LeaseLost               409 lost: the caller is not the live owner (any more)
    │       └── StaleFence          client only: a protected system refused an older
    │                               fencing token (``leasekeeper.client.FenceGuard``)
    └── ServerError                 the service is at fault (5xx)
        ├── ServiceUnavailable      503 unavailable; .retry_after_seconds; nothing was
        │   │                       written, and the request is never applied later
        │   ├── OutcomeUnknown      503 unavailable, "outcome": "unknown": the store lost
        │   │                       its commit's answer; the write may have taken effect
        │   └── ServiceUnreachable  client only: no answer at all (connection refused or
        │                           reset, timeout); the request may or may not have landed
        └── InternalError           500 internal, never with details

The client reads an error back with ``error_from_body``, the inverse of ``body()``.
Messages never contain a request's values: they are secrets, and bodies reach logs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

__all__ = [
    "MAX_RETRY_AFTER",
    "FingerprintConflict",
    "HeadersTooLarge",
    "InternalError",
    "InvalidRequest",
    "LeaseConflict",
    "LeaseError",
    "LeaseHeld",
    "LeaseLost",
    "MethodNotAllowed",
    "NotFound",
    "OutcomeUnknown",
    "PayloadTooLarge",
    "RateLimited",
    "RequestError",
    "RequestTimeout",
    "ServerError",
    "ServiceUnavailable",
    "ServiceUnreachable",
    "StaleFence",
    "error_from_body",
]


class LeaseError(Exception):
    """Base of every leasekeeper error; ``status`` is the body's word."""

    status: ClassVar[str] = "error"
    default_message: ClassVar[str] = "Request failed"

    def __init__(self, error: str | None = None) -> None:
        self.error = error or self.default_message
        super().__init__(self.error)

    def body(self) -> dict[str, Any]:
        """The JSON object that HTTP and MCP return for this error."""
        return {"ok": False, "status": self.status, "error": self.error}

    @property
    def retry_after(self) -> int | None:
        """Seconds for a ``Retry-After`` header, or None when waiting will not help."""
        return None


class _RetryLater(LeaseError):
    """An error that says how long to wait: ``retry_after_seconds`` in the body and header."""

    def __init__(self, error: str | None = None, *, retry_after_seconds: int = 1) -> None:
        super().__init__(error)
        self.retry_after_seconds = retry_after_seconds

    @property
    def retry_after(self) -> int:
        return self.retry_after_seconds

    def body(self) -> dict[str, Any]:
        return {**super().body(), "retry_after_seconds": self.retry_after_seconds}


class RequestError(LeaseError):
    """The request itself is at fault; sending it again unchanged will fail again."""


class InvalidRequest(RequestError):
    """The body is not valid JSON, or a field breaks its rule (the message names which)."""

    status = "invalid"
    default_message = "Invalid request"


class PayloadTooLarge(RequestError):
    """The request body is over the limit, or a result is over 32,768 bytes."""

    status = "too_large"
    default_message = "Request body is too large"


class HeadersTooLarge(PayloadTooLarge):
    """The request's head is over the limit (server only; a client reads ``PayloadTooLarge``)."""


class NotFound(RequestError):
    """No route at this path."""

    status = "not_found"
    default_message = "Not found"


class MethodNotAllowed(RequestError):
    """The route exists but not for this HTTP method."""

    status = "method_not_allowed"
    default_message = "Method not allowed"


class RequestTimeout(RequestError):
    """The client took too long to send its request's headers or body; the connection
    is closed after this answer."""

    status = "timeout"
    default_message = "The request was not received in time"


class RateLimited(RequestError, _RetryLater):
    """Too many requests from this address or for this namespace; wait and retry."""

    status = "rate_limited"
    default_message = "Too many requests"


class LeaseConflict(LeaseError):
    """The key's current state refuses this request (HTTP 409)."""


class LeaseHeld(LeaseConflict):
    """Another owner holds a live lease on the key; ``retry_after_seconds`` is never
    shorter than the real wait. The owner's token is never revealed."""

    status = "held"
    default_message = "Lease is held"

    def __init__(
        self,
        error: str | None = None,
        *,
        retry_after_seconds: int,
        fencing_token: int,
        lease_expires_at: str,
        absolute_expires_at: str,
    ) -> None:
        super().__init__(error)
        self.retry_after_seconds = retry_after_seconds
        self.fencing_token = fencing_token
        self.lease_expires_at = lease_expires_at
        self.absolute_expires_at = absolute_expires_at

    @property
    def retry_after(self) -> int:
        return self.retry_after_seconds

    def __str__(self) -> str:
        """The message with the wait and the holder's fencing token (when known), as
        ``Lease is held; retry after 12 s (fencing token 7)``; the body's ``error``
        stays the message alone."""
        fence = f" (fencing token {self.fencing_token})" if self.fencing_token > 0 else ""
        return f"{self.error}; retry after {self.retry_after_seconds} s{fence}"

    def body(self) -> dict[str, Any]:
        return {
            **super().body(),
            "retry_after_seconds": self.retry_after_seconds,
            "fencing_token": self.fencing_token,
            "lease_expires_at": self.lease_expires_at,
            "absolute_expires_at": self.absolute_expires_at,
        }


class FingerprintConflict(LeaseConflict):
    """The key is bound to a different fingerprint until ``absolute_expires_at``
    (a key reused for different input); nothing of the stored result is revealed."""

    status = "conflict"
    default_message = (
        "This key is bound to a different fingerprint until its lifecycle ends; "
        "use another key for different input"
    )

    def __init__(self, error: str | None = None, *, absolute_expires_at: str) -> None:
        super().__init__(error)
        self.absolute_expires_at = absolute_expires_at

    def body(self) -> dict[str, Any]:
        return {**super().body(), "absolute_expires_at": self.absolute_expires_at}


class LeaseLost(LeaseConflict):
    """The caller is not the live owner (wrong token, expired, released or completed:
    the message says which); stop the work."""

    status = "lost"
    default_message = "You do not hold this lease"


class ServerError(LeaseError):
    """The service is at fault; the same request may succeed later."""


class ServiceUnavailable(ServerError, _RetryLater):
    """The store cannot be reached or is overloaded; retry after ``retry_after_seconds``."""

    status = "unavailable"
    default_message = "The lease store is unavailable; retry shortly"


class OutcomeUnknown(ServiceUnavailable):
    """The store may or may not have applied the write (the body has ``"outcome":
    "unknown"``). An acquire may have granted a lease nobody received the token of
    (held until its TTL ends); a renew, release or complete sent again is answered
    ``lost`` if it had taken effect."""

    default_message = (
        "The outcome of this request is unknown: the lease store may or may not have applied it"
    )

    def body(self) -> dict[str, Any]:
        return {**super().body(), "outcome": "unknown"}


class InternalError(ServerError):
    """An unexpected fault in the service; details go to the server log, not the body."""

    status = "internal"
    default_message = "Internal error"


class ServiceUnreachable(ServiceUnavailable):
    """Client only: no answer (connection refused or reset, a timeout); the request
    may or may not have landed. Retry after ``retry_after_seconds``."""

    status = "unreachable"
    default_message = "Could not reach the lease service; retry shortly"


class StaleFence(LeaseLost):
    """Client only: ``FenceGuard`` saw a newer fencing token for ``resource`` (which
    stays out of the message): a newer owner has written; stop the work."""

    status = "stale_fence"
    default_message = "A newer fencing token has already been seen for this resource"

    def __init__(
        self,
        error: str | None = None,
        *,
        resource: str,
        fencing_token: int,
        current_fence: int,
    ) -> None:
        super().__init__(
            error
            or f"Fencing token {fencing_token} is older than {current_fence}, "
            "already seen for this resource; a newer owner has written"
        )
        self.resource = resource
        self.fencing_token = fencing_token
        self.current_fence = current_fence

    def body(self) -> dict[str, Any]:
        return {
            **super().body(),
            "fencing_token": self.fencing_token,
            "current_fence": self.current_fence,
        }


# -- reading an error body back (the client's one choke point) ------------------------------


def _int(value: Any, default: int) -> int:
    # bool is an int in Python; a body with `true` here is not ours to trust.
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


#: The longest wait taken from an answer (9 digits); a longer one is ignored as
#: malformed (sleeping it would overflow or never end).
MAX_RETRY_AFTER = 999_999_999


def _wait(body: Mapping[str, Any], retry_after: int | None) -> int:
    """``retry_after_seconds`` from the body, else the header, else 1 (at least 1)."""
    seconds = _int(body.get("retry_after_seconds"), 0)
    if not 1 <= seconds <= MAX_RETRY_AFTER:
        seconds = retry_after or 1
    return max(1, seconds)


_Builder = Callable[[str | None, Mapping[str, Any], int | None], LeaseError]

#: Status word of a service error body -> how to rebuild the exception.
_FROM_STATUS: dict[str, _Builder] = {
    InvalidRequest.status: lambda e, b, r: InvalidRequest(e),
    PayloadTooLarge.status: lambda e, b, r: PayloadTooLarge(e),
    NotFound.status: lambda e, b, r: NotFound(e),
    MethodNotAllowed.status: lambda e, b, r: MethodNotAllowed(e),
    RequestTimeout.status: lambda e, b, r: RequestTimeout(e),
    RateLimited.status: lambda e, b, r: RateLimited(e, retry_after_seconds=_wait(b, r)),
    LeaseHeld.status: lambda e, b, r: LeaseHeld(
        e,
        retry_after_seconds=_wait(b, r),
        fencing_token=_int(b.get("fencing_token"), 0),
        lease_expires_at=_str(b.get("lease_expires_at")),
        absolute_expires_at=_str(b.get("absolute_expires_at")),
    ),
    FingerprintConflict.status: lambda e, b, r: FingerprintConflict(
        e, absolute_expires_at=_str(b.get("absolute_expires_at"))
    ),
    LeaseLost.status: lambda e, b, r: LeaseLost(e),
    ServiceUnavailable.status: lambda e, b, r: (
        OutcomeUnknown if b.get("outcome") == "unknown" else ServiceUnavailable
    )(e, retry_after_seconds=_wait(b, r)),
    InternalError.status: lambda e, b, r: InternalError(e),
}

#: HTTP status code -> class, for bodies that carry no status word of ours.
_FROM_HTTP_STATUS: dict[int, _Builder] = {
    400: _FROM_STATUS["invalid"],
    404: _FROM_STATUS["not_found"],
    405: _FROM_STATUS["method_not_allowed"],
    408: _FROM_STATUS["timeout"],
    413: _FROM_STATUS["too_large"],
    429: _FROM_STATUS["rate_limited"],
    502: _FROM_STATUS["unavailable"],
    503: _FROM_STATUS["unavailable"],
    504: _FROM_STATUS["unavailable"],
}


def error_from_body(
    body: Mapping[str, Any] | None,
    *,
    http_status: int | None = None,
    retry_after: int | None = None,
) -> LeaseError:
    """The exception a non-2xx response describes: the inverse of ``LeaseError.body()``.

    ``body`` (None when not JSON): its ``status`` word picks the class; without one,
    ``http_status`` does (an unlisted 4xx is ``InvalidRequest``, else ``InternalError``).
    ``retry_after`` (the header) is used when the body has no ``retry_after_seconds``.
    """
    body = body if body is not None else {}
    message = body.get("error")
    error = message if isinstance(message, str) and message else None
    build = _FROM_STATUS.get(_str(body.get("status")))
    if build is not None:
        return build(error, body, retry_after)
    if http_status is not None:
        build = _FROM_HTTP_STATUS.get(http_status)
        if build is not None:
            return build(error, body, retry_after)
        if http_status == 409:
            return LeaseConflict(error or "The key's state refuses this request")
        if 400 <= http_status < 500:
            return InvalidRequest(f"Unexpected HTTP {http_status} response from the service")
    return InternalError(
        f"Unexpected HTTP {http_status} response from the service"
        if http_status is not None
        else None
    )
