"""Idempotency-Key for web apps: ASGI and WSGI middleware on leasekeeper.

``IdempotencyMiddleware`` (Starlette, FastAPI, Litestar, Django's ASGI handler) and
``WSGIIdempotencyMiddleware`` (Flask, Django) follow
draft-ietf-httpapi-idempotency-key-header: a retried POST or PATCH with the same
``Idempotency-Key`` gets the first response again instead of running twice. They
need only the client's dependencies. See docs/middleware.md.
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
