"""MCP over streamable HTTP: the ``/mcp`` route ``leasekeeper serve`` mounts beside the API.

The SDK (mcp 2.3) falls short of the API's rules in three ways, which ``_Gate`` and
``_sdk_errors_as_json`` make up for: it waits for a body as long as the client likes,
it reads JSON leniently (the last of a repeated name wins, ``NaN`` is a number), and
it answers some refusals in plain text.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import orjson
from mcp import types
from mcp.server.streamable_http_manager import (
    StreamableHTTPASGIApp,
    StreamableHTTPSessionManager,
)
from mcp.server.transport_security import TransportSecuritySettings
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leasekeeper._asgi import ClientGone, read_body
from leasekeeper._core.validation import UTF8_BOM
from leasekeeper._errors import PayloadTooLarge, RequestTimeout
from leasekeeper._limits import Limits
from leasekeeper._metrics import Metrics
from leasekeeper._service import LeaseService
from leasekeeper._settings import Settings
from leasekeeper.http import status_code
from leasekeeper.mcp._jsonrpc import Refusal, read_message
from leasekeeper.mcp._server import MCP_PATH, create_mcp_server

__all__ = ["StreamableHttpMount", "streamable_http_mount"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_SCHEMES = ("http", "https")

LifespanHook = Callable[[], contextlib.AbstractAsyncContextManager[None]]


@dataclass(frozen=True, slots=True)
class StreamableHttpMount:
    """What ``create_app`` needs to serve MCP: routes, and lifespan hooks to run them."""

    routes: list[BaseRoute] = field(default_factory=list)
    lifespan_hooks: list[LifespanHook] = field(default_factory=list)


def streamable_http_mount(
    service: LeaseService,
    settings: Settings | None = None,
    *,
    path: str = MCP_PATH,
    limits: Limits | None = None,
) -> StreamableHttpMount:
    """Streamable HTTP at ``path``, for ``create_app(extra_routes=..., lifespan_hooks=...)``.

    Stateless JSON responses, POST only (a stateless server sends nothing unprompted);
    bodies read as the API's are. On a loopback address, Host and Origin must be
    loopback names (DNS rebinding). Pass the HTTP app's ``limits`` so both share one
    budget; by default the mount makes its own from ``settings``.
    """
    settings = settings or Settings()
    if limits is None:
        limits = Limits.from_settings(settings)
    security = None
    if settings.host in _LOOPBACK:
        # The SDK logs each refused Host or Origin header whole (``_ValuesOut``).
        logging.getLogger("mcp.server.transport_security").addFilter(_VALUES_OUT)
        names = ["127.0.0.1", "localhost", "[::1]"]  # as in a Host header
        hosts = names + [f"{name}:*" for name in names]
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=hosts,
            allowed_origins=[f"{scheme}://{host}" for scheme in _SCHEMES for host in hosts],
        )
    manager = StreamableHTTPSessionManager(
        app=create_mcp_server(service, limits=limits),
        json_response=True,
        stateless=True,
        security_settings=security,
        max_request_body_size=settings.max_body_bytes,
    )
    app = _Gate(
        StreamableHTTPASGIApp(manager), settings.max_body_bytes, settings.request_timeout_seconds
    )
    return StreamableHttpMount(
        routes=[Route(path, app, methods=["POST"], name="mcp")],  # "mcp" in metrics
        lifespan_hooks=[manager.run],
    )


class _Gate:
    """In front of the SDK's app: the body read as the API reads one (a 408 or 413 as a
    JSON-RPC error, connection closed), checked by ``read_message`` (a refusal is a
    JSON-RPC error with HTTP 400, so the SDK's validation, which quotes input, never
    sees it), then handed to the SDK whole."""

    def __init__(self, app: ASGIApp, max_body: int, body_timeout: float) -> None:
        self.app = app
        self.max_body = max_body
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_body(
                scope, receive, self.max_body, self.body_timeout, lambda: _count_slow_body(scope)
            )
        except ClientGone:
            return
        except (PayloadTooLarge, RequestTimeout) as error:
            await self._closing(error)(scope, receive, send)  # the rest is not read
            return
        body = body.removeprefix(UTF8_BOM)  # ignored, as before a body of the API's
        read = read_message(body)
        if isinstance(read, Refusal):
            await _refused(read)(scope, receive, send)
            return
        whole: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed() -> Message:
            return whole.pop() if whole else await receive()

        await self.app(scope, replayed, _sdk_errors_as_json(send))

    def _closing(self, error: PayloadTooLarge | RequestTimeout) -> Response:
        """The API's status as a JSON-RPC error (id null) whose data is the API's body
        (an MCP client reads no other body at an error status); closes the connection."""
        if isinstance(error, PayloadTooLarge):
            message = f"Invalid request: the message is larger than {self.max_body} bytes"
        else:
            message = f"Invalid request: {error.error}"
        refused = {"code": types.INVALID_REQUEST, "message": message, "data": error.body()}
        body = orjson.dumps({"jsonrpc": "2.0", "id": None, "error": refused})
        response = Response(body, status_code=status_code(error), media_type="application/json")
        response.headers["connection"] = "close"
        return response


def _count_slow_body(scope: Scope) -> None:
    """Count a body cut off at its deadline in the app's metrics, as the API routes do."""
    metrics = getattr(getattr(scope.get("app"), "state", None), "metrics", None)
    if isinstance(metrics, Metrics):
        metrics.slow_clients.labels("body").inc()


def _refused(refusal: Refusal) -> Response:
    """The JSON-RPC error for a body ``read_message`` refused: HTTP 400, as the SDK's own."""
    error = {"code": refusal.code, "message": refusal.message}
    body = orjson.dumps({"jsonrpc": "2.0", "id": refusal.id, "error": error})
    return Response(body, status_code=400, media_type="application/json")


def _sdk_errors_as_json(send: Send) -> Send:
    """``send``, with the SDK's plain-text error answers (each one piece) made the API's
    ``invalid`` body with the same status and sentence."""
    held: Message | None = None

    async def sending(message: Message) -> None:
        nonlocal held
        if message["type"] == "http.response.start" and message["status"] >= 400:
            held = message  # until its body shows what it says
            return
        if held is not None and message["type"] == "http.response.body":
            start, held = held, None
            body = _as_json(message.get("body", b""), start["status"])
            if body is not None:
                headers = [
                    (name, value)
                    for name, value in start["headers"]
                    if name not in (b"content-length", b"content-type")
                ]
                headers.append((b"content-type", b"application/json"))
                headers.append((b"content-length", str(len(body)).encode("ascii")))
                start = {**start, "headers": headers}
                message = {**message, "body": body}
            await send(start)
        await send(message)

    return sending


#: What an SDK refusal without a body says (its 2026-07-28 transport answers 406 so).
_EMPTY_REFUSALS: Final = {406: "Not Acceptable: Client must accept application/json"}


def _as_json(body: bytes, status: int) -> bytes | None:
    """The API's ``invalid`` body for an SDK error body in plain text (its fixed
    sentences, which quote no input); None for one in JSON, which stays."""
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:
        sentence = body.decode("utf-8", "replace").strip()[:200] or _EMPTY_REFUSALS.get(
            status, "The request was refused"
        )
        return orjson.dumps({"ok": False, "status": "invalid", "error": sentence})
    return None


class _ValuesOut(logging.Filter):
    """Cuts a log line at its first colon: the SDK logs each refused Host or Origin
    header whole, a client's text of any size."""

    def filter(self, record: logging.LogRecord) -> bool:
        head, colon, _ = record.getMessage().partition(":")
        if colon:
            record.msg, record.args = f"{head} (the value is not logged)", ()
        return True


_VALUES_OUT = _ValuesOut()
