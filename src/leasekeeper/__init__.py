"""leasekeeper: leases, fencing tokens and idempotent results over HTTP.

The public API is what ``__all__`` lists; everything in ``_``-prefixed modules
may change without notice.
"""

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
from leasekeeper.web import IdempotencyMiddleware, WSGIIdempotencyMiddleware

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
