"""leasekeeper: leases, fencing tokens and idempotent results over HTTP.

The public API is what ``__all__`` lists; everything in ``_``-prefixed modules
may change without notice.
"""

from typing import TYPE_CHECKING

from leasekeeper._clock import Clock, FakeClock, SystemClock
from leasekeeper._errors import (
    FingerprintConflict,
    InternalError,
    InvalidRequest,
    LeaseConflict,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    MethodNotAllowed,
    NotFound,
    OutcomeUnknown,
    PayloadTooLarge,
    RateLimited,
    RequestError,
    RequestTimeout,
    ServerError,
    ServiceUnavailable,
    ServiceUnreachable,
    StaleFence,
)
from leasekeeper._service import LeaseService, Reply
from leasekeeper._settings import Settings, SettingsError
from leasekeeper.client import AsyncLeaseClient, LeaseClient
from leasekeeper.store import Store, open_store

if TYPE_CHECKING:
    from leasekeeper.web import IdempotencyMiddleware, WSGIIdempotencyMiddleware
else:
    # The middlewares load on first use: a worker that only takes leases does not import
    # leasekeeper.web. Type checkers read the import above instead, so they see no
    # module __getattr__, which would make every unknown name of this package Any.
    def __getattr__(name: str) -> object:
        if name in ("IdempotencyMiddleware", "WSGIIdempotencyMiddleware"):
            import leasekeeper.web

            value = getattr(leasekeeper.web, name)
            globals()[name] = value
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})


__all__ = [
    "AsyncLeaseClient",
    "Clock",
    "FakeClock",
    "FingerprintConflict",
    "IdempotencyMiddleware",
    "InternalError",
    "InvalidRequest",
    "LeaseClient",
    "LeaseConflict",
    "LeaseError",
    "LeaseHeld",
    "LeaseLost",
    "LeaseService",
    "MethodNotAllowed",
    "NotFound",
    "OutcomeUnknown",
    "PayloadTooLarge",
    "RateLimited",
    "Reply",
    "RequestError",
    "RequestTimeout",
    "ServerError",
    "ServiceUnavailable",
    "ServiceUnreachable",
    "Settings",
    "SettingsError",
    "StaleFence",
    "Store",
    "SystemClock",
    "WSGIIdempotencyMiddleware",
    "open_store",
]
