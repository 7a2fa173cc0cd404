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
from leasekeeper.client import AsyncLeaseClient, LeaseClient

if TYPE_CHECKING:
    from leasekeeper._service import LeaseService, Reply
    from leasekeeper._settings import Settings, SettingsError
    from leasekeeper.store import Store, open_store
    from leasekeeper.web import IdempotencyMiddleware, WSGIIdempotencyMiddleware
else:
    from leasekeeper._extras import import_server as _import_server

    # These names load on first use. The middlewares: a worker that only takes leases does
    # not import leasekeeper.web. The server's: ``pip install leasekeeper`` installs the
    # client alone, and a name whose module needs a package of ``leasekeeper[server]`` that
    # is missing is an ImportError naming that install command. Type checkers read the
    # imports above instead, so they see no module __getattr__, which would make every
    # unknown name of this package Any.
    _MIDDLEWARES = {"IdempotencyMiddleware", "WSGIIdempotencyMiddleware"}
    _SERVER = {
        "LeaseService": "leasekeeper._service",
        "Reply": "leasekeeper._service",
        "Settings": "leasekeeper._settings",
        "SettingsError": "leasekeeper._settings",
        "Store": "leasekeeper.store",
        "open_store": "leasekeeper.store",
    }

    def __getattr__(name: str) -> object:
        if name in _MIDDLEWARES:
            import leasekeeper.web

            value = getattr(leasekeeper.web, name)
        elif name in _SERVER:
            value = getattr(_import_server(_SERVER[name], f"leasekeeper.{name}"), name)
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value
        return value

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
