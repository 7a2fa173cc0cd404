"""The HTTP API: Starlette routes that parse, call ``LeaseService`` and render.

Request handling on the hot path is a handful of steps: read the body (at most
``max_body_bytes``), parse it strictly, validate it, call the service, and write
the reply with orjson. Every response carries ``Cache-Control: no-store`` and
``X-Content-Type-Options: nosniff``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import signal
import threading
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Mapping
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leasekeeper._core.validation import UTF8_BOM, parse_json_object
from leasekeeper._errors import (
    InternalError,
    LeaseError,
    PayloadTooLarge,
    RequestTimeout,
    ServiceUnavailable,
)
from leasekeeper._limits import Limits
from leasekeeper._logging import REQUEST_ID
from leasekeeper._metrics import Children, Metrics
from leasekeeper._service import LeaseService, clean_up_every
from leasekeeper._settings import Settings
from leasekeeper.http._errors import (
    ANSWERED,
    error_parts,
    error_response,
    http_exception_handler,
    unexpected_handler,
)
from leasekeeper.http._openapi import DOCS_HTML, openapi_document

__all__ = [
    "BASE_PATH",
    "ClientGone",
    "LeaseApp",
    "LeaseEndpoint",
    "create_app",
    "read_body",
]

log = logging.getLogger("leasekeeper.http")
access_log = logging.getLogger("leasekeeper.access")

BASE_PATH = "/services/v1"
_JSON = "application/json"
_JSON_WHITESPACE = b" \t\r\n"
_OWN_HEADERS = (b"cache-control", b"x-content-type-options", b"x-request-id")
_JSON_HEADER = (b"content-type", b"application/json")
_SECURITY_HEADERS = ((b"cache-control", b"no-store"), (b"x-content-type-options", b"nosniff"))
#: The metrics' status for a request whose client went away before it was answered.
CLIENT_GONE = 499


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
    """The ASGI application over ``service``.

    Its lifespan opens the store and, when ``run_cleanup`` is true, runs the
    cleanup every ``settings.cleanup_interval_seconds``. ``monotonic`` drives the
    rate limits, and ``sleep`` the pauses of the cleanup and of the live-lease count
    (tests pass fakes). ``extra_routes`` and ``lifespan_hooks`` let
    other adapters (MCP) mount beside the API; ``limits`` are the rate limits to
    share with them (by default new ones from ``settings`` on ``monotonic``).
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
    app.state.route_names = names  # for LeaseApp, and for the unexpected-error log line
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

#: Route names for metrics and logs: a fixed set (with the names of the routes other
#: adapters mount, such as "mcp"), so an unknown path (which a client could fill with
#: a secret) is only ever "other".
_ROUTE_NAMES = {
    **_ROUTES,
    "/healthz": "healthz",
    "/readyz": "readyz",
    "/metrics": "metrics",
    "/openapi.json": "openapi",
    "/docs": "docs",
}


async def _unless_stopped(opening: Awaitable[None]) -> bool:
    """Await ``opening`` (the store's, which may wait out the store timeout), unless
    SIGINT or SIGTERM comes first (False): the server acts on them only once started,
    so a stop asked for meanwhile would wait for the store. Either signal also goes on
    to the handler it had (uvicorn's, which then stops the server)."""
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


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


async def _send_json(
    send: Send,
    status: int,
    body: bytes,
    extra: list[tuple[bytes, bytes]] | None,
    request_id: bytes | None,
) -> None:
    """Send ``body`` as JSON; with ``request_id``, also the headers ``LeaseApp`` adds to
    every response, in the order its wrapper would have added them (last)."""
    headers = [(b"content-length", str(len(body)).encode("ascii")), _JSON_HEADER]
    if extra:
        headers += extra
    if request_id is not None:
        headers += _SECURITY_HEADERS
        headers.append((b"x-request-id", request_id))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class LeaseEndpoint:
    """One lease route (``operation``) as a plain ASGI app; returns the status it sent.

    It takes from the per-address limit (when on), reads the body within
    ``max_body`` bytes and ``body_timeout`` seconds, parses it strictly, applies
    the other rate limits (``Limits.enforce``, the rules MCP tool calls follow
    too), calls ``service.handle`` and answers with the reply or with the error's body from the
    one error table (``error_parts``). Anything unforeseen is logged and answered
    500 ``internal`` without details. A client that went away gets no answer.
    """

    def __init__(
        self,
        operation: str,
        service: LeaseService,
        limits: Limits,
        max_body: int,
        body_timeout: float,
        metrics: Metrics,
    ) -> None:
        self.operation = operation
        self.service = service
        self.limits = limits
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.metrics = metrics

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, request_id: bytes | None = None
    ) -> int:
        """Answer one request. With ``request_id`` (as ``LeaseApp`` calls it) the answer
        carries every header of a response, security headers and X-Request-Id included;
        without, as a plain ASGI app, the layer around it must add those."""
        extra = None
        state = {"body_read": False}
        try:
            status, body = await self._handle(scope, receive, state)
        except LeaseError as error:
            status, body, extra = error_parts(error)
            if not state["body_read"]:
                # The rest of the body may still be on its way: end the connection.
                extra.append((b"connection", b"close"))
        except ClientGone:
            return CLIENT_GONE
        except Exception as exc:
            log.error("unhandled error on POST %s", _ROUTE_NAMES.get(scope["path"]), exc_info=exc)
            status, body, extra = error_parts(InternalError())
        await _send_json(send, status, body, extra, request_id)
        return status

    async def _handle(
        self, scope: Scope, receive: Receive, state: dict[str, bool]
    ) -> tuple[int, bytes]:
        limits = self.limits
        # The address first, before the body is read: a flood costs no reading.
        limits.enforce_address(scope)
        raw = await read_body(scope, receive, self.max_body, self.body_timeout, self._slow_body)
        state["body_read"] = True
        # Only JSON's own whitespace makes an empty body: bytes.strip() would also
        # drop \x0b and \x0c, which are not JSON and must be refused. A byte-order
        # mark before it is ignored, as before any body (parse_json_object).
        if self.operation == "namespace" and not raw.removeprefix(UTF8_BOM).strip(_JSON_WHITESPACE):
            data: dict[str, Any] = {}
        else:
            data = parse_json_object(raw)
        limits.enforce(scope, self.operation, data, address=False)
        reply = await self.service.handle(self.operation, data)
        return 201 if reply.created else 200, reply.json_bytes()

    def _slow_body(self) -> None:
        self.metrics.slow_clients.labels("body").inc()


async def read_body(
    scope: Scope,
    receive: Receive,
    max_body: int,
    body_timeout: float,
    on_slow: Callable[[], None],
) -> bytes:
    """The request's whole body, read as every POST route reads it (the lease routes
    and ``/mcp``): at most ``max_body`` bytes (a larger ``Content-Length`` is refused
    before reading), all of it within ``body_timeout`` seconds.

    Raises ``PayloadTooLarge``, ``RequestTimeout`` (after calling ``on_slow``, which
    counts it), or ``ClientGone`` when the client disconnected first.
    """
    for name, value in scope["headers"]:
        if name == b"content-length":
            if value.isdigit() and _larger_than(value, max_body):
                raise PayloadTooLarge(f"Request body is larger than {max_body} bytes")
            break
    # A client trickling its body (or lying about its length) must not hold a
    # connection forever: the whole body must arrive within body_timeout seconds
    # (the headers have their own bound, http._protocol). The timer starts when a
    # receive() first has to wait, before which no time has passed; a body that is
    # already there (nearly every request) is read without one.
    deadline = None
    body = b""
    try:
        while True:
            receiving = receive().__await__()
            try:
                waits_for = receiving.send(None)
            except StopIteration as arrived:
                message = arrived.value
            else:
                if deadline is None:
                    deadline = _Deadline(body_timeout)
                message = await _resume(receiving, waits_for)
            if message["type"] != "http.request":  # http.disconnect
                raise ClientGone
            chunk: bytes = message.get("body", b"")
            body += chunk  # usually one chunk; at most max_body bytes in all
            if len(body) > max_body:
                raise PayloadTooLarge(f"Request body is larger than {max_body} bytes")
            if not message.get("more_body", False):
                return body
    except asyncio.CancelledError:
        if deadline is None or not deadline.stop():
            raise  # cancelled by someone else: never swallowed
    except TimeoutError:
        pass  # receive()'s own timeout: a slow body as well
    finally:
        if deadline is not None:
            deadline.stop()
    on_slow()
    raise RequestTimeout(f"The request body was not received within {body_timeout:g} seconds")


def _larger_than(digits: bytes, limit: int) -> bool:
    """Whether the decimal ``digits`` are a number above ``limit``.

    Without the leading zeros first: HTTP allows them, the parser accepts thousands,
    and ``int()`` refuses more than 4,300 digits.
    """
    significant = digits.lstrip(b"0")
    return len(significant) > len(str(limit)) or int(significant or b"0") > limit


class _Deadline:
    """Cancels the current task ``seconds`` from now unless stopped first.

    What ``asyncio.timeout`` does, as an object that is only made when a body has
    to be waited for (a loop timer costs a few microseconds). ``stop()`` cancels
    the timer and undoes its own cancellation of the task (``Task.uncancel``); it
    answers True only when the deadline expired and nobody else has asked to
    cancel the task, so that the ``CancelledError`` being raised is the deadline's
    alone.
    """

    __slots__ = ("_cancelling", "_expired", "_handle", "_task")

    def __init__(self, seconds: float) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("_Deadline should be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            seconds, self._expire
        )

    def _expire(self) -> None:
        self._expired = True
        self._task.cancel()

    def stop(self) -> bool:
        """Stop the timer (again: nothing); True if it had expired and its cancellation
        is the only one."""
        handle = self._handle
        if handle is None:
            return False
        handle.cancel()
        self._handle = None
        if not self._expired:
            return False
        self._expired = False
        return self._task.uncancel() <= self._cancelling


@types.coroutine
def _resume(
    receiving: Generator[Any, None, Message], waits_for: Any
) -> Generator[Any, Any, Message]:
    """Await the rest of ``receiving``, which ran until it yielded ``waits_for``.

    The same as ``await`` would have done had it run from the start: what it yields
    goes to the task, what the task sends or throws in (a cancellation) goes to it.
    """
    try:
        while True:
            try:
                sent = yield waits_for
            except GeneratorExit:
                receiving.close()
                raise
            except BaseException as exc:
                waits_for = receiving.throw(exc)
            else:
                waits_for = receiving.send(sent)
    except StopIteration as done:
        message: Message = done.value
        return message


class LeaseApp:
    """The application: the lease routes and Starlette inside one outermost ASGI layer.

    The layer draws each request's id (``X-Request-Id``, and ``request_id`` in its
    log lines), serves a path with a trailing slash as the path without, adds the
    security headers, caps requests in flight, counts request metrics, sends
    ``POST`` to a lease route straight to its ``LeaseEndpoint`` and everything else
    to Starlette, and at DEBUG logs one line per request (method, route name,
    status, time; never a path, body or header value).

    A plain ASGI wrapper rather than ``BaseHTTPMiddleware``, which would cost a
    task and a stream per request on the hot path. A ``LeaseEndpoint`` is handed
    the request id and sends its final header list itself; only Starlette's
    responses go through a ``send`` wrapper that adds the headers.
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
        self.route_names: Mapping[str, str] = getattr(app.state, "route_names", _ROUTE_NAMES)
        metrics.in_flight.set_function(lambda: self.in_flight)
        self._busy = error_parts(
            ServiceUnavailable("The server is at its connection limit; retry shortly")
        )
        self._counted = Children(metrics.requests, "inc")
        self._timed = Children(metrics.latency, "observe")

    def at_connection_limit(self) -> ASGIApp:
        """The app uvicorn runs instead of this one past its connection limit: the JSON 503
        of the in-flight cap, with every response's headers, counted, timed and logged as
        every answer is."""
        return functools.partial(self, refuse=True)

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, *, refuse: bool = False
    ) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                send = self._lifespan_send(send)
            await self.app(scope, receive, send)
            return
        request_id = f"{random.getrandbits(64):016x}"  # unique enough; not a secret
        reset = REQUEST_ID.set(request_id)
        header_id = request_id.encode("ascii")
        path = scope["path"]
        if path[-1:] == "/" and len(path) > 1:
            # A trailing slash changes nothing (/lease/ is /lease): served as it is,
            # with no redirect that a client might not follow.
            path = path.rstrip("/") or "/"
            scope = {**scope, "path": path}
        route = self.route_names.get(path, "other")
        try:
            started = time.perf_counter()
            status = 500
            busy = refuse or self.in_flight >= self.max_in_flight
            if not busy:
                self.in_flight += 1
            try:
                if busy:
                    status, body, extra = self._busy
                    await _send_json(send, status, body, list(extra), header_id)
                elif scope["method"] == "POST" and (endpoint := self.lease_routes.get(path)):
                    status = await endpoint(scope, receive, send, header_id)
                else:
                    status = await self._starlette(scope, receive, send, header_id)
            finally:
                elapsed = time.perf_counter() - started
                if not busy:
                    self.in_flight -= 1
                self._count(route, status)
                self._timed[route](elapsed)
                if access_log.isEnabledFor(logging.DEBUG):
                    access_log.debug(
                        "%s %s %d %.1fms", scope["method"], route, status, elapsed * 1000
                    )
        finally:
            REQUEST_ID.reset(reset)

    def _lifespan_send(self, send: Send) -> Send:
        """``send`` for the lifespan: a start refused because the store cannot be opened
        (logged in one line) is reported to the server without Starlette's traceback,
        which uvicorn would log as a second ERROR; any other failure keeps it."""

        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed" and getattr(
                self.state, "start_refused", False
            ):
                message = {**message, "message": ""}
            await send(message)

        return lifespan_send

    def _count(self, route: str, status: int) -> None:
        self._counted[route, status]()  # prometheus_client makes the status a string

    async def _starlette(
        self, scope: Scope, receive: Receive, send: Send, request_id: bytes
    ) -> int:
        """Starlette answers; its response gets the security headers and X-Request-Id
        (replacing any it set itself). Returns the status it sent (500 if none). An
        error its handler answered (``unexpected_handler``) ends here; any other goes
        on to the server."""
        status_code = 500

        async def send_with_headers(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
                headers = [
                    (name, value)
                    for name, value in message.get("headers", [])
                    if name.lower() not in _OWN_HEADERS
                ]
                headers.extend(_SECURITY_HEADERS)
                headers.append((b"x-request-id", request_id))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception as exc:
            if scope.pop(ANSWERED, None) is not exc:
                raise
            # Answered and logged by unexpected_handler: Starlette raises it again for
            # the server, which would log it twice and close the connection.
        return status_code
