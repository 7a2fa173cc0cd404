"""The HTTP API: Starlette routes that parse, call ``LeaseService`` and render.

Request handling on the hot path is a handful of steps: read the body (at most
``max_body_bytes``), parse it strictly, validate it, call the service, and write
the reply with orjson. Every response carries ``Cache-Control: no-store`` and
``X-Content-Type-Options: nosniff``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leasekeeper._core.validation import parse_json_object
from leasekeeper._errors import (
    InvalidRequest,
    LeaseError,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    ServiceUnavailable,
)
from leasekeeper._limits import RateLimiter
from leasekeeper._logging import REQUEST_ID
from leasekeeper._metrics import Metrics
from leasekeeper._service import LeaseService
from leasekeeper._settings import Settings
from leasekeeper.http._errors import error_response, http_exception_handler, unexpected_handler
from leasekeeper.http._openapi import DOCS_HTML, openapi_document

__all__ = ["BASE_PATH", "LeaseApp", "create_app", "json_unavailable_app"]

log = logging.getLogger("leasekeeper.http")
access_log = logging.getLogger("leasekeeper.access")

BASE_PATH = "/services/v1"
_JSON = "application/json"
_JSON_WHITESPACE = b" \t\r\n"
_OWN_HEADERS = (b"cache-control", b"x-content-type-options", b"x-request-id")


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
    service.add_observer(metrics)
    mint_limit = RateLimiter(settings.namespace_rate, settings.namespace_burst, monotonic=monotonic)
    address_limit = RateLimiter(settings.address_rate, settings.address_burst, monotonic=monotonic)
    namespace_limit = RateLimiter(
        settings.namespace_request_rate, settings.namespace_request_burst, monotonic=monotonic
    )
    max_body = settings.max_body_bytes
    body_timeout = settings.request_timeout_seconds

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            raise PayloadTooLarge(f"Request body is larger than {max_body} bytes")
        chunks = []
        size = 0
        try:
            # A client trickling its body (or lying about its length) must not hold a
            # connection forever; the headers have their own bound (http._protocol).
            async with asyncio.timeout(body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_body:
                        raise PayloadTooLarge(f"Request body is larger than {max_body} bytes")
                    chunks.append(chunk)
        except ClientDisconnect:
            # Nobody is left to answer; a client going away is not a server fault.
            raise InvalidRequest("The client disconnected before sending the whole body") from None
        except TimeoutError:
            metrics.slow_clients.labels("body").inc()
            raise RequestTimeout(
                f"The request body was not received within {body_timeout:g} seconds"
            ) from None
        return b"".join(chunks)

    def client_address(request: Request) -> str:
        return request.client.host if request.client else "unknown"

    def limit(limiter: RateLimiter, key: object, what: str) -> None:
        wait = limiter.take(key)
        if wait is not None:
            raise RateLimited(
                f"Too many {what}; retry after {wait} seconds", retry_after_seconds=wait
            )

    def lease_endpoint(operation: str) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            body_read = False
            try:
                if address_limit.enabled:
                    limit(address_limit, client_address(request), "requests from this address")
                raw = await read_body(request)
                body_read = True
                if operation == "namespace":
                    limit(
                        mint_limit, client_address(request), "namespaces minted from this address"
                    )
                    # Only JSON's own whitespace makes an empty body: bytes.strip() would also
                    # drop \x0b and \x0c, which are not JSON and must be refused.
                    empty = not raw.strip(_JSON_WHITESPACE)
                    data: dict[str, Any] = {} if empty else parse_json_object(raw)
                else:
                    data = parse_json_object(raw)
                namespace = data.get("namespace")
                if namespace_limit.enabled and isinstance(namespace, str):
                    digest = hashlib.sha256(namespace.encode("utf-8", "replace")).digest()
                    limit(namespace_limit, digest, "requests for this namespace")
                reply = await service.handle(operation, data)
            except LeaseError as error:
                response = error_response(error)
                if not body_read:
                    # The rest of the body may still be on its way: end the connection.
                    response.headers["connection"] = "close"
                return response
            return Response(
                reply.json_bytes(), status_code=201 if reply.created else 200, media_type=_JSON
            )

        endpoint.__name__ = f"lease_{operation}"
        return endpoint

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
        Route(f"{BASE_PATH}/lease/namespace", lease_endpoint("namespace"), methods=post),
        Route(f"{BASE_PATH}/lease", lease_endpoint("acquire"), methods=post),
        Route(f"{BASE_PATH}/lease/acquire", lease_endpoint("acquire"), methods=post),
        Route(f"{BASE_PATH}/lease/renew", lease_endpoint("renew"), methods=post),
        Route(f"{BASE_PATH}/lease/release", lease_endpoint("release"), methods=post),
        Route(f"{BASE_PATH}/lease/complete", lease_endpoint("complete"), methods=post),
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
            started = time.perf_counter()
            try:
                deleted = await service.cleanup()
            except LeaseError as error:
                metrics.cleanup_runs.labels("failed").inc()
                log.warning("cleanup failed: %s", error.error)
                continue
            finally:
                metrics.cleanup_seconds.observe(time.perf_counter() - started)
            metrics.cleanup_runs.labels("ok").inc()
            metrics.cleanup_deleted.inc(deleted)
            log.info("cleanup deleted %d records whose lifecycle was over", deleted)

    async def live_leases_loop() -> None:
        while True:
            try:
                count = await service.count_live()
            except LeaseError as error:
                log.warning("counting live leases failed: %s", error.error)
            else:
                if count is None:  # this store cannot count: show no gauge rather than 0
                    metrics.registry.unregister(metrics.live_leases)
                    metrics.registry.unregister(metrics.live_leases_counted)
                    return
                metrics.live_leases.set(count)
                metrics.live_leases_counted.set(time.time())
            await asyncio.sleep(settings.live_leases_interval_seconds)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        tasks = []
        if run_cleanup:
            tasks.append(asyncio.create_task(cleanup_loop()))
        if settings.live_leases_interval_seconds > 0:
            tasks.append(asyncio.create_task(live_leases_loop()))
        try:
            async with contextlib.AsyncExitStack() as stack:
                for hook in lifespan_hooks or []:
                    await stack.enter_async_context(hook())
                yield
        finally:
            for task in tasks:
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
    return LeaseApp(app, metrics, settings.max_connections)


#: Route names for metrics and logs: a fixed set, so an unknown path (which a client
#: could fill with a secret) is only ever "other".
_ROUTE_NAMES = {
    f"{BASE_PATH}/lease/namespace": "namespace",
    f"{BASE_PATH}/lease": "acquire",
    f"{BASE_PATH}/lease/acquire": "acquire",
    f"{BASE_PATH}/lease/renew": "renew",
    f"{BASE_PATH}/lease/release": "release",
    f"{BASE_PATH}/lease/complete": "complete",
    "/healthz": "healthz",
    "/readyz": "readyz",
    "/metrics": "metrics",
    "/openapi.json": "openapi",
    "/docs": "docs",
}


class LeaseApp:
    """The application: Starlette inside one outermost ASGI layer.

    The layer draws each request's id (``X-Request-Id``, and ``request_id`` in its
    log lines), adds the security headers, caps requests in flight, counts request
    metrics and, at DEBUG, logs one line per request (method, route name, status,
    time; never a path, body or header value).

    A plain ASGI wrapper rather than ``BaseHTTPMiddleware``, which would cost a
    task and a stream per request on the hot path.
    """

    def __init__(self, app: Starlette, metrics: Metrics, max_in_flight: int) -> None:
        self.app = app
        self.state = app.state
        self.router = app.router
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self._busy = error_response(
            ServiceUnavailable("The server is at its connection limit; retry shortly")
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status_code = 500
        request_id = os.urandom(8).hex()
        reset = REQUEST_ID.set(request_id)
        header_id = request_id.encode("ascii")

        async def send_with_headers(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
                headers = [
                    (name, value)
                    for name, value in message.get("headers", [])
                    if name.lower() not in _OWN_HEADERS
                ]
                headers.append((b"cache-control", b"no-store"))
                headers.append((b"x-content-type-options", b"nosniff"))
                headers.append((b"x-request-id", header_id))
                message = {**message, "headers": headers}
            await send(message)

        try:
            if self.in_flight >= self.max_in_flight:
                await self._busy(scope, receive, send_with_headers)
                return
            route = _ROUTE_NAMES.get(scope["path"], "other")
            started = time.perf_counter()
            self.in_flight += 1
            self.metrics.in_flight.inc()
            try:
                await self.app(scope, receive, send_with_headers)
            finally:
                elapsed = time.perf_counter() - started
                self.in_flight -= 1
                self.metrics.in_flight.dec()
                self.metrics.requests.labels(route, str(status_code)).inc()
                self.metrics.latency.labels(route).observe(elapsed)
                if access_log.isEnabledFor(logging.DEBUG):
                    access_log.debug(
                        "%s %s %d %.1fms", scope["method"], route, status_code, elapsed * 1000
                    )
        finally:
            REQUEST_ID.reset(reset)


def json_unavailable_app() -> ASGIApp:
    """An ASGI app answering 503 ``unavailable`` in JSON (used for uvicorn's connection cap)."""
    response = error_response(
        ServiceUnavailable("The server is at its connection limit; retry shortly")
    )

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await response(scope, receive, send)

    return app
