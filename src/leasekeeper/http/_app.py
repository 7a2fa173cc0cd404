"""The HTTP API's application: its routes, and the lifespan that opens the store.

A ``POST`` to a lease route goes to its ``LeaseEndpoint`` (http._endpoint) through
``LeaseApp`` (http._lease_app), the layer every request passes; the other routes are
Starlette's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from leasekeeper._errors import LeaseError, ServiceUnavailable
from leasekeeper._limits import Limits
from leasekeeper._metrics import Metrics
from leasekeeper._service import LeaseService, clean_up_every
from leasekeeper._settings import Settings
from leasekeeper.http._endpoint import LeaseEndpoint
from leasekeeper.http._errors import error_response, http_exception_handler, unexpected_handler
from leasekeeper.http._lease_app import LeaseApp
from leasekeeper.http._openapi import openapi_document
from leasekeeper.http._swagger import ASSET_PATHS, docs_routes

__all__ = ["BASE_PATH", "create_app"]

log = logging.getLogger("leasekeeper.http")

BASE_PATH = "/services/v1"
_JSON = "application/json"


def create_app(
    service: LeaseService,
    settings: Settings | None = None,
    *,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    run_cleanup: bool = True,
    extra_routes: list[BaseRoute] | None = None,
    lifespan_hooks: list[Callable[[], contextlib.AbstractAsyncContextManager[None]]] | None = None,
    limits: Limits | None = None,
) -> LeaseApp:
    """The ASGI application over ``service``; its lifespan opens the store and runs the
    cleanup (``run_cleanup``). ``monotonic`` drives the rate limits, ``sleep`` the
    periodic tasks. ``extra_routes``, ``lifespan_hooks`` and ``limits`` (shared) let
    other adapters (MCP) mount beside the API.
    """
    settings = settings or Settings()
    metrics = Metrics()
    service.add_observer(metrics)
    if limits is None:
        limits = Limits.from_settings(settings, monotonic=monotonic)
    endpoints = {
        operation: LeaseEndpoint(
            operation,
            service,
            limits,
            settings.max_body_bytes,
            settings.request_timeout_seconds,
            metrics,
        )
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

    post = ["POST"]
    routes: list[BaseRoute] = [
        *(Route(path, endpoints[operation], methods=post) for path, operation in _ROUTES.items()),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *docs_routes(),
        *(extra_routes or []),
    ]

    def cleaned(deleted: int | None, seconds: float) -> None:
        metrics.cleanup_seconds.observe(seconds)
        if deleted is None:
            metrics.cleanup_runs.labels("failed").inc()
            return
        metrics.cleanup_runs.labels("ok").inc()
        metrics.cleanup_deleted.inc(deleted)

    counting = settings.live_leases_interval_seconds > 0 and service.counts_live
    if not counting:  # not counted: no gauge, rather than a false 0
        metrics.registry.unregister(metrics.live_leases)
        metrics.registry.unregister(metrics.live_leases_counted)

    async def live_leases_loop() -> None:
        while True:
            try:
                count = await service.count_live()
            except LeaseError as error:
                log.warning("counting live leases failed: %s", error.error)
            else:
                if count is not None:  # always: the loop runs only on a store that counts
                    metrics.live_leases.set(count)
                    metrics.live_leases_counted.set(time.time())
            await sleep(settings.live_leases_interval_seconds)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            opened = await _unless_stopped(service.start())
        except LeaseError as error:  # a store that cannot be opened: said in one line
            log.error("%s", error.error)
            app.state.start_refused = True  # LeaseApp keeps uvicorn from adding a traceback
            raise
        if not opened:  # asked to stop while the store was being opened: as asked
            log.warning("stopped while the store was being opened")
            app.state.start_refused = True
            raise ServiceUnavailable("Stopped while the store was being opened")
        tasks = []
        if run_cleanup:
            tasks.append(
                asyncio.create_task(
                    clean_up_every(
                        service,
                        settings.cleanup_interval_seconds,
                        sleep=sleep,
                        ran=cleaned,
                    )
                )
            )
        if counting:
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
    direct = {path: endpoints[operation] for path, operation in _ROUTES.items()}
    names = {
        **_ROUTE_NAMES,
        **{route.path: route.name for route in extra_routes or [] if isinstance(route, Route)},
    }
    app.state.route_names = names  # for the unexpected-error log line
    return LeaseApp(app, metrics, settings.max_connections, direct, names)


#: Lease route path -> operation (a key of ``LeaseService``'s ``OPERATIONS``).
_ROUTES = {
    f"{BASE_PATH}/lease/namespace": "namespace",
    f"{BASE_PATH}/lease": "acquire",
    f"{BASE_PATH}/lease/acquire": "acquire",
    f"{BASE_PATH}/lease/renew": "renew",
    f"{BASE_PATH}/lease/release": "release",
    f"{BASE_PATH}/lease/complete": "complete",
}

#: Route names for metrics and logs: a fixed set, so an unknown path (which could hold
#: a secret) is only ever "other".
_ROUTE_NAMES = {
    **_ROUTES,
    "/healthz": "healthz",
    "/readyz": "readyz",
    "/metrics": "metrics",
    "/openapi.json": "openapi",
    "/docs": "docs",
    **dict.fromkeys(ASSET_PATHS, "docs_asset"),
}


async def _unless_stopped(opening: Awaitable[None]) -> bool:
    """Await ``opening`` unless SIGINT or SIGTERM comes first (False; uvicorn acts on
    them only once started). Either signal goes on to the handler it had."""
    task = asyncio.ensure_future(opening)
    if threading.current_thread() is not threading.main_thread():
        await task  # signal handlers are the main thread's alone
        return True
    loop = asyncio.get_running_loop()
    stopped: list[int] = []
    previous: dict[int, Any] = {}

    def stop(signum: int, frame: types.FrameType | None) -> None:
        stopped.append(signum)
        loop.call_soon_threadsafe(task.cancel)
        if callable(chained := previous[signum]):
            chained(signum, frame)

    for handled in (signal.SIGINT, signal.SIGTERM):
        previous[handled] = signal.signal(handled, stop)
    try:
        await task
    except asyncio.CancelledError:
        if not stopped or not task.cancelled():
            raise
        return False
    finally:
        for handled_signal, handler in previous.items():
            signal.signal(handled_signal, handler)
    return True
