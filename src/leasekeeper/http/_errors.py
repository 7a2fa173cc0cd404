"""Errors become HTTP responses here, and only here."""

from __future__ import annotations

import logging

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from leasekeeper._errors import (
    FingerprintConflict,
    HeadersTooLarge,
    InternalError,
    InvalidRequest,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    ServiceUnavailable,
)

__all__ = [
    "ANSWERED",
    "STATUS_CODES",
    "error_parts",
    "error_response",
    "http_exception_handler",
    "status_code",
    "unexpected_handler",
]

log = logging.getLogger("leasekeeper.http")

#: The one table from error class to HTTP status code.
STATUS_CODES: dict[type[LeaseError], int] = {
    InvalidRequest: 400,
    NotFound: 404,
    MethodNotAllowed: 405,
    RequestTimeout: 408,
    LeaseHeld: 409,
    FingerprintConflict: 409,
    LeaseLost: 409,
    PayloadTooLarge: 413,
    HeadersTooLarge: 431,
    RateLimited: 429,
    InternalError: 500,
    ServiceUnavailable: 503,
}

#: The scope entry where ``unexpected_handler`` leaves the exception it answered, which
#: ``LeaseApp`` then does not pass on to uvicorn (which would log it twice and close).
ANSWERED = "leasekeeper.answered"

_FROM_HTTP: dict[int, type[LeaseError]] = {
    400: InvalidRequest,
    404: NotFound,
    405: MethodNotAllowed,
    413: PayloadTooLarge,
}


def status_code(error: LeaseError) -> int:
    """The HTTP status for ``error`` (its nearest class in the table)."""
    for cls in type(error).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            return code
    return 500


def error_parts(error: LeaseError) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """Status code, JSON body and extra headers (``Retry-After`` where waiting helps) for
    ``error``; ``error_response`` and the direct lease routes both answer with these."""
    headers = []
    if error.retry_after is not None:
        headers.append((b"retry-after", str(error.retry_after).encode("ascii")))
    return status_code(error), orjson.dumps(error.body()), headers


def error_response(error: LeaseError) -> Response:
    """The JSON response for ``error``, with ``Retry-After`` where waiting helps."""
    code, body, headers = error_parts(error)
    response = Response(body, status_code=code, media_type="application/json")
    response.raw_headers.extend(headers)
    return response


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no route, wrong method, body too large) in our shape."""
    code = exc.status_code if isinstance(exc, HTTPException) else 500
    error_class = _FROM_HTTP.get(code)
    if error_class is None:
        return error_response(InternalError())
    response = error_response(error_class())
    if isinstance(exc, HTTPException) and code == 405 and exc.headers:
        allow = exc.headers.get("Allow") or exc.headers.get("allow")
        if allow:
            response.headers["allow"] = allow
    return response


async def unexpected_handler(request: Request, exc: Exception) -> Response:
    """Anything unforeseen: logged with its traceback, answered without details."""
    request.scope[ANSWERED] = exc
    if isinstance(exc, LeaseError):
        return error_response(exc)
    # The route's name, never the path, which a client could fill with a secret.
    route = getattr(request.app.state, "route_names", {}).get(request.scope["path"], "other")
    log.error("unhandled error on %s %s", request.method, route, exc_info=exc)
    return error_response(InternalError())
