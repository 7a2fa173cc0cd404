"""The HTTP API: the lease routes, and Starlette for everything else.

A lease request is a handful of steps: read the body (at most ``max_body_bytes``),
parse it strictly, validate it, call the service, and write the reply with orjson.
Those steps are one plain ASGI app per route (``LeaseEndpoint``). The outermost
layer, ``LeaseApp``, calls it directly for ``POST`` on its path: no routing table,
no middleware stack, no Request or Response objects on the hot path. Starlette
holds the same endpoint objects as its routes, so other methods on those paths get
Starlette's 405, and serves everything else (health, metrics, OpenAPI, docs, MCP,
404). Every response carries ``Cache-Control: no-store`` and
``X-Content-Type-Options: nosniff``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leasekeeper._core.validation import parse_json_object
from leasekeeper._errors import (
    InternalError,
    LeaseError,
    PayloadTooLarge,
    RateLimited,
    ServiceUnavailable,
)
from leasekeeper._limits import RateLimiter
from leasekeeper._metrics import Metrics
from leasekeeper._service import LeaseService
from leasekeeper._settings import Settings
from leasekeeper.http._errors import (
    error_parts,
    error_response,
    http_exception_handler,
    unexpected_handler,
)
from leasekeeper.http._openapi import DOCS_HTML, openapi_document

__all__ = ["BASE_PATH", "LeaseApp", "LeaseEndpoint", "create_app", "json_unavailable_app"]

log = logging.getLogger("leasekeeper.http")

BASE_PATH = "/services/v1"
_JSON = "application/json"
_JSON_HEADER = (b"content-type", b"application/json")
_SECURITY_HEADERS = ((b"cache-control", b"no-store"), (b"x-content-type-options", b"nosniff"))
#: The metrics' status for a request whose client went away before it was answered.
CLIENT_GONE = 499


def create_app(
    service: LeaseService,
    settings: Settings | None = None,
    *,
    monotonic: Callable[[], float] = time.monotonic,
    run_cleanup: bool = True,
    extra_routes: list[BaseRoute] | None = None,
    lifespan_hooks: list[Callable[[], contextlib.AbstractAsyncContextManager[None]]] | None = None,
) -> LeaseApp:
    """The ASGI application over ``service``.

    Its lifespan opens the store and, when ``run_cleanup`` is true, runs the
    cleanup every ``settings.cleanup_interval_seconds``. ``monotonic`` drives the
    rate limits (tests pass a fake). ``extra_routes`` and ``lifespan_hooks`` let
    other adapters (MCP) mount beside the API.
    """
    settings = settings or Settings()
    metrics = Metrics()
    mint_limit = RateLimiter(settings.namespace_rate, settings.namespace_burst, monotonic=monotonic)
    address_limit = RateLimiter(settings.address_rate, settings.address_burst, monotonic=monotonic)
    namespace_limit = RateLimiter(
        settings.namespace_request_rate, settings.namespace_request_burst, monotonic=monotonic
    )
    limits = _Limits(address_limit, mint_limit, namespace_limit)
    endpoints = {
        operation: LeaseEndpoint(operation, service, limits, settings.max_body_bytes)
        for operation in dict.fromkeys(_ROUTES.values())
    }

    async def healthz(request: Request) -> Response:
        return Response(b'{"ok":true,"status":"alive"}', media_type=_JSON)

    async def readyz(request: Request) -> Response:
        try:
            await service.ready()
        except LeaseError as error:
            return error_response(error)
        return Response(b'{"ok":true,"status":"ready"}', media_type=_JSON)

    async def metrics_endpoint(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    openapi_bytes = orjson.dumps(openapi_document(BASE_PATH))

    async def openapi(request: Request) -> Response:
        return Response(openapi_bytes, media_type=_JSON)

    async def docs(request: Request) -> Response:
        return HTMLResponse(DOCS_HTML)

    post = ["POST"]
    routes: list[BaseRoute] = [
        *(Route(path, endpoints[operation], methods=post) for path, operation in _ROUTES.items()),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/docs", docs, methods=["GET"]),
        *(extra_routes or []),
    ]

    async def cleanup_loop() -> None:
        while True:
            await asyncio.sleep(settings.cleanup_interval_seconds)
            try:
                deleted = await service.cleanup()
            except LeaseError as error:
                metrics.cleanup_runs.labels("failed").inc()
                log.warning("cleanup failed: %s", error.error)
                continue
            metrics.cleanup_runs.labels("ok").inc()
            metrics.cleanup_deleted.inc(deleted)
            log.info("cleanup deleted %d records whose lifecycle was over", deleted)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        task = asyncio.create_task(cleanup_loop()) if run_cleanup else None
        try:
            async with contextlib.AsyncExitStack() as stack:
                for hook in lifespan_hooks or []:
                    await stack.enter_async_context(hook())
                yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await service.stop()

    app = Starlette(
        routes=routes,
        exception_handlers={
            HTTPException: http_exception_handler,
            Exception: unexpected_handler,
        },
        lifespan=lifespan,
    )
    app.state.metrics = metrics
    app.state.service = service
    direct = {path: endpoints[operation] for path, operation in _ROUTES.items()}
    return LeaseApp(app, metrics, settings.max_connections, direct)


#: Lease route path -> operation (a key of ``LeaseService``'s ``OPERATIONS``).
_ROUTES = {
    f"{BASE_PATH}/lease/namespace": "namespace",
    f"{BASE_PATH}/lease": "acquire",
    f"{BASE_PATH}/lease/acquire": "acquire",
    f"{BASE_PATH}/lease/renew": "renew",
    f"{BASE_PATH}/lease/release": "release",
    f"{BASE_PATH}/lease/complete": "complete",
}


class _ClientGone(Exception):
    """The client disconnected before its request body arrived."""


@dataclass(frozen=True, slots=True)
class _Limits:
    address: RateLimiter
    mint: RateLimiter
    namespace: RateLimiter


def _limit(limiter: RateLimiter, key: Hashable, what: str) -> None:
    wait = limiter.take(key)
    if wait is not None:
        raise RateLimited(f"Too many {what}; retry after {wait} seconds", retry_after_seconds=wait)


def _client_address(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


async def _send_json(
    send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [(b"content-length", str(len(body)).encode("ascii")), _JSON_HEADER]
    if extra:
        headers += extra
    headers += _SECURITY_HEADERS
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class LeaseEndpoint:
    """One lease route (``operation``) as a plain ASGI app; returns the status it sent.

    It reads the body within ``max_body`` bytes, parses it strictly, applies the
    rate limits that are switched on, calls ``service.handle`` and answers with the
    reply or with the error's body from the one error table (``error_parts``).
    Anything unforeseen is logged and answered 500 ``internal`` without details.
    """

    def __init__(
        self, operation: str, service: LeaseService, limits: _Limits, max_body: int
    ) -> None:
        self.operation = operation
        self.service = service
        self.limits = limits
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> int:
        extra = None
        try:
            status, body = await self._handle(scope, receive)
        except LeaseError as error:
            status, body, extra = error_parts(error)
        except _ClientGone:
            return CLIENT_GONE
        except Exception as exc:
            log.error("unhandled error on POST %s", scope.get("path"), exc_info=exc)
            status, body, extra = error_parts(InternalError())
        await _send_json(send, status, body, extra)
        return status

    async def _handle(self, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        limits = self.limits
        if limits.address.enabled:
            _limit(limits.address, _client_address(scope), "requests from this address")
        raw = await self._read_body(scope, receive)
        if self.operation == "namespace":
            _limit(limits.mint, _client_address(scope), "namespaces minted from this address")
            data: dict[str, Any] = parse_json_object(raw) if raw.strip() else {}
        else:
            data = parse_json_object(raw)
        namespace = data.get("namespace")
        if limits.namespace.enabled and isinstance(namespace, str):
            digest = hashlib.sha256(namespace.encode("utf-8", "replace")).digest()
            _limit(limits.namespace, digest, "requests for this namespace")
        reply = await self.service.handle(self.operation, data)
        return 201 if reply.created else 200, reply.json_bytes()

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        max_body = self.max_body
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > max_body:
                    raise PayloadTooLarge(f"Request body is larger than {max_body} bytes")
                break
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect
                raise _ClientGone
            chunk: bytes = message.get("body", b"")
            body += chunk  # usually one chunk; at most max_body bytes in all
            if len(body) > max_body:
                raise PayloadTooLarge(f"Request body is larger than {max_body} bytes")
            if not message.get("more_body", False):
                return body


class LeaseApp:
    """The application: the lease routes and Starlette inside one outermost ASGI layer.

    The layer caps requests in flight, counts request metrics, sends ``POST`` to a
    lease route straight to its ``LeaseEndpoint``, and adds the security headers
    to whatever Starlette answers.

    A plain ASGI wrapper rather than ``BaseHTTPMiddleware``, which would cost a
    task and a stream per request on the hot path.
    """

    def __init__(
        self,
        app: Starlette,
        metrics: Metrics,
        max_in_flight: int,
        lease_routes: dict[str, LeaseEndpoint] | None = None,
    ) -> None:
        self.app = app
        self.state = app.state
        self.router = app.router
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.lease_routes = lease_routes or {}
        self._route_names = {path: e.operation for path, e in self.lease_routes.items()}
        metrics.in_flight.set_function(lambda: self.in_flight)
        self._busy = error_parts(
            ServiceUnavailable("The server is at its connection limit; retry shortly")
        )
        # prometheus_client's labels() costs a lock and a tuple per call: keep the children.
        self._counted: dict[tuple[str, int], Callable[[], None]] = {}
        self._timed: dict[str, Callable[[float], None]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.in_flight >= self.max_in_flight:
            status, body, extra = self._busy
            await _send_json(send, status, body, extra)
            self._count(self._route_names.get(path, "other"), status)
            return
        endpoint = self.lease_routes.get(path) if scope["method"] == "POST" else None
        started = time.perf_counter()
        self.in_flight += 1
        status = 500
        try:
            if endpoint is not None:
                status = await endpoint(scope, receive, send)
            else:
                status = await self._starlette(scope, receive, send)
        finally:
            self.in_flight -= 1
            route = self._route_names.get(path, "other")
            self._count(route, status)
            observe = self._timed.get(route)
            if observe is None:
                observe = self._timed[route] = self.metrics.latency.labels(route).observe
            observe(time.perf_counter() - started)

    def _count(self, route: str, status: int) -> None:
        increment = self._counted.get((route, status))
        if increment is None:
            child = self.metrics.requests.labels(route, str(status))
            increment = self._counted[(route, status)] = child.inc
        increment()

    async def _starlette(self, scope: Scope, receive: Receive, send: Send) -> int:
        status_code = 500

        async def send_with_headers(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
                headers = [
                    (name, value)
                    for name, value in message.get("headers", [])
                    if name.lower() not in (b"cache-control", b"x-content-type-options")
                ]
                headers.extend(_SECURITY_HEADERS)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
        return status_code


def json_unavailable_app() -> ASGIApp:
    """An ASGI app answering 503 ``unavailable`` in JSON (used for uvicorn's connection cap)."""
    response = error_response(
        ServiceUnavailable("The server is at its connection limit; retry shortly")
    )

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await response(scope, receive, send)

    return app
