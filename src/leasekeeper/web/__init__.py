"""Idempotency-Key for web apps: ASGI and WSGI middleware on leasekeeper.

Following draft-ietf-httpapi-idempotency-key-header, a retried POST or PATCH with the
same ``Idempotency-Key`` gets the first response again instead of running twice. Only
the client's dependencies are needed. See docs/middleware.md.
"""

from leasekeeper.web._asgi import IdempotencyMiddleware
from leasekeeper.web._request import IdempotentRequest, RequestLease, default_fingerprint
from leasekeeper.web._wsgi import WSGIIdempotencyMiddleware

__all__ = [
    "IdempotencyMiddleware",
    "IdempotentRequest",
    "RequestLease",
    "WSGIIdempotencyMiddleware",
    "default_fingerprint",
]
