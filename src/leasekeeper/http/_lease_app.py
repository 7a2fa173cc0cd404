"""``LeaseApp``: the outermost ASGI layer, what every HTTP request goes through."""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Mapping

from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leasekeeper._errors import ServiceUnavailable
from leasekeeper._logging import REQUEST_ID
from leasekeeper._metrics import Children, Metrics
from leasekeeper.http._endpoint import SECURITY_HEADERS, LeaseEndpoint, send_json
from leasekeeper.http._errors import ANSWERED, error_parts

__all__ = ["LeaseApp"]

access_log = logging.getLogger("leasekeeper.access")

_OWN_HEADERS = (b"cache-control", b"x-content-type-options", b"x-request-id")


class LeaseApp:
    """The application: the lease routes and Starlette inside one outermost ASGI layer.

    It draws each request's id, serves a path with a trailing slash as without, adds
    the security headers, caps requests in flight, counts metrics, sends a lease
    ``POST`` straight to its ``LeaseEndpoint`` and the rest to Starlette, and at DEBUG
    logs one line per request (never a path, body or header value). ``route_names``
    maps each path served to its name (any other is "other").
    """

    def __init__(
        self,
        app: Starlette,
        metrics: Metrics,
        max_in_flight: int,
        lease_routes: dict[str, LeaseEndpoint],
        route_names: Mapping[str, str],
    ) -> None:
        self.app = app
        self.state = app.state
        self.router = app.router
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.lease_routes = lease_routes
        self.route_names = route_names
        metrics.in_flight.set_function(lambda: self.in_flight)
        self._busy = error_parts(
            ServiceUnavailable("The server is at its connection limit; retry shortly")
        )
        self._counted = Children(metrics.requests, "inc")
        self._timed = Children(metrics.latency, "observe")

    def at_connection_limit(self) -> ASGIApp:
        """The app uvicorn runs past its connection limit: the in-flight cap's JSON 503."""
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
            # /lease/ is /lease, with no redirect a client might not follow.
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
                    await send_json(send, status, body, list(extra), header_id)
                elif scope["method"] == "POST" and (endpoint := self.lease_routes.get(path)):
                    status = await endpoint(scope, receive, send, header_id)
                else:
                    status = await self._starlette(scope, receive, send, header_id)
            finally:
                elapsed = time.perf_counter() - started
                if not busy:
                    self.in_flight -= 1
                self._counted[route, status]()  # prometheus_client makes the status a string
                self._timed[route](elapsed)
                if access_log.isEnabledFor(logging.DEBUG):
                    access_log.debug(
                        "%s %s %d %.1fms", scope["method"], route, status, elapsed * 1000
                    )
        finally:
            REQUEST_ID.reset(reset)

    def _lifespan_send(self, send: Send) -> Send:
        """``send`` for the lifespan: a start refused because the store cannot be opened
        (logged already) is reported without Starlette's traceback."""

        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed" and getattr(
                self.state, "start_refused", False
            ):
                message = {**message, "message": ""}
            await send(message)

        return lifespan_send

    async def _starlette(
        self, scope: Scope, receive: Receive, send: Send, request_id: bytes
    ) -> int:
        """Starlette answers, with our headers; returns the status sent (500 if none).
        An error ``unexpected_handler`` answered ends here; any other goes on."""
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
                headers.extend(SECURITY_HEADERS)
                headers.append((b"x-request-id", request_id))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception as exc:
            if scope.pop(ANSWERED, None) is not exc:
                raise
            # Answered and logged already: uvicorn would log it again and close.
        return status_code
