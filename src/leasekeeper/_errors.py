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
    │   ├── NotFound                404 not_found: no such route
    │   ├── MethodNotAllowed        405 method_not_allowed
    │   ├── RequestTimeout          408 timeout: headers or body not sent in time (slow client)
    │   └── RateLimited             429 rate_limited; .retry_after_seconds
    ├── LeaseConflict               409: the key's state refuses the request
    │   ├── LeaseHeld               409 held: another owner holds a live lease;
    │   │                           .retry_after_seconds, .fencing_token, expiries
    │   ├── FingerprintConflict     409 conflict: the key is bound to another fingerprint
    │   └── LeaseLost               409 lost: the caller is not the live owner (any more)
    └── ServerError                 the service is at fault (5xx)
        ├── ServiceUnavailable      503 unavailable; .retry_after_seconds
        └── InternalError           500 internal, never with details

Messages never contain a request's values: a namespace, key, token or fingerprint
is a secret, and an error body may end up in a log.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "FingerprintConflict",
    "InternalError",
    "InvalidRequest",
    "LeaseConflict",
    "LeaseError",
    "LeaseHeld",
    "LeaseLost",
    "MethodNotAllowed",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "RequestError",
    "RequestTimeout",
    "ServerError",
    "ServiceUnavailable",
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


class NotFound(RequestError):
    """No route at this path."""

    status = "not_found"
    default_message = "Not found"


class MethodNotAllowed(RequestError):
    """The route exists but not for this HTTP method."""

    status = "method_not_allowed"
    default_message = "Method not allowed"


class RequestTimeout(RequestError):
    """The client took too long to send its request's headers or body.

    A slow or stalled client would otherwise hold one of the server's connections
    for as long as it likes; the connection is closed after this answer.
    """

    status = "timeout"
    default_message = "The request was not received in time"


class RateLimited(RequestError):
    """Too many requests from this address or for this namespace; wait and retry."""

    status = "rate_limited"
    default_message = "Too many requests"

    def __init__(self, error: str | None = None, *, retry_after_seconds: int = 1) -> None:
        super().__init__(error)
        self.retry_after_seconds = retry_after_seconds

    @property
    def retry_after(self) -> int:
        return self.retry_after_seconds

    def body(self) -> dict[str, Any]:
        return {**super().body(), "retry_after_seconds": self.retry_after_seconds}


class LeaseConflict(LeaseError):
    """The key's current state refuses this request (HTTP 409)."""


class LeaseHeld(LeaseConflict):
    """Another owner holds a live lease on the key.

    Wait ``retry_after_seconds`` (never shorter than the real wait) and try again,
    or do other work. The owner's token is never revealed.
    """

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

    def body(self) -> dict[str, Any]:
        return {
            **super().body(),
            "retry_after_seconds": self.retry_after_seconds,
            "fencing_token": self.fencing_token,
            "lease_expires_at": self.lease_expires_at,
            "absolute_expires_at": self.absolute_expires_at,
        }


class FingerprintConflict(LeaseConflict):
    """The key is bound to a different fingerprint in its current lifecycle.

    This is idempotency-key reuse for different input; nothing of the stored
    result is revealed. Use a new key, or wait for ``absolute_expires_at``.
    """

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
    """The caller is not the live owner: wrong token, expired, released or completed.

    Stop the work: somebody else may own the key now. The message says which.
    """

    status = "lost"
    default_message = "You do not hold this lease"


class ServerError(LeaseError):
    """The service is at fault; the same request may succeed later."""


class ServiceUnavailable(ServerError):
    """The store cannot be reached or is overloaded; retry after ``retry_after_seconds``."""

    status = "unavailable"
    default_message = "The lease store is unavailable; retry shortly"

    def __init__(self, error: str | None = None, *, retry_after_seconds: int = 1) -> None:
        super().__init__(error)
        self.retry_after_seconds = retry_after_seconds

    @property
    def retry_after(self) -> int:
        return self.retry_after_seconds

    def body(self) -> dict[str, Any]:
        return {**super().body(), "retry_after_seconds": self.retry_after_seconds}


class InternalError(ServerError):
    """An unexpected fault in the service; details go to the server log, not the body."""

    status = "internal"
    default_message = "Internal error"
