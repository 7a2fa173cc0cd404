"""A lease route as a plain ASGI app: read, parse, limit, call the service, answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from starlette.types import Receive, Scope, Send

from leasekeeper._asgi import ClientGone, read_body
from leasekeeper._core.parsing import parse_json_object
from leasekeeper._core.validation import UTF8_BOM
from leasekeeper._errors import InternalError, LeaseError
from leasekeeper._limits import Limits
from leasekeeper._metrics import Metrics
from leasekeeper._schemas import AcquireBody, parse_body
from leasekeeper._service import LeaseService, Reply
from leasekeeper.http._errors import error_parts

__all__ = ["CLIENT_GONE", "SECURITY_HEADERS", "LeaseEndpoint", "send_json"]

log = logging.getLogger("leasekeeper.http")

#: The metrics' status for a request whose client went away before it was answered.
CLIENT_GONE = 499
#: The headers ``LeaseApp`` adds to every response (with ``X-Request-Id``).
SECURITY_HEADERS = ((b"cache-control", b"no-store"), (b"x-content-type-options", b"nosniff"))
_JSON_HEADER = (b"content-type", b"application/json")
_JSON_WHITESPACE = b" \t\r\n"


async def send_json(
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
        headers += SECURITY_HEADERS
        headers.append((b"x-request-id", request_id))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _disconnected(receive: Receive) -> None:
    """Return when the client disconnects (its body has been read: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class LeaseEndpoint:
    """One lease route (``operation``) as a plain ASGI app; returns the status it sent.
    Anything unforeseen is logged and answered 500 ``internal`` without details; a
    client that went away gets no answer.
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
        """Answer one request; without ``request_id`` (as a plain ASGI app) the layer
        around it must add the security headers and X-Request-Id."""
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
            log.error("unhandled error on POST %s", self.operation, exc_info=exc)
            status, body, extra = error_parts(InternalError())
        await send_json(send, status, body, extra, request_id)
        return status

    async def _handle(
        self, scope: Scope, receive: Receive, state: dict[str, bool]
    ) -> tuple[int, bytes]:
        limits = self.limits
        # The address first, before the body is read: a flood costs no reading.
        limits.enforce_address(scope)
        raw = await read_body(scope, receive, self.max_body, self.body_timeout, self._slow_body)
        state["body_read"] = True
        # Only JSON's own whitespace makes an empty body (not bytes.strip()'s \x0b, \x0c).
        if self.operation == "namespace" and not raw.removeprefix(UTF8_BOM).strip(_JSON_WHITESPACE):
            data: dict[str, Any] = {}
        else:
            data = parse_json_object(raw)
        limits.enforce(scope, self.operation, data, address=False)
        if self.operation == "acquire" and data.get("wait_seconds"):
            reply = await self._unless_gone(data, receive)
        else:
            reply = await self.service.handle(self.operation, data)
        return 201 if reply.created else 200, reply.json_bytes()

    async def _unless_gone(self, data: dict[str, Any], receive: Receive) -> Reply:
        """An acquire that may wait, given up (``ClientGone``) when its client disconnects
        first: the service grants it nothing then, and a lease granted in the same moment
        is released, so the key stays free for the next waiter."""
        body = parse_body(AcquireBody, data)
        acquiring = asyncio.ensure_future(self.service.acquire(body))
        gone = asyncio.ensure_future(_disconnected(receive))
        client_gone = True
        try:
            await asyncio.wait((acquiring, gone), return_when=asyncio.FIRST_COMPLETED)
            client_gone = gone.done()
        finally:
            if not gone.done():
                gone.cancel()
            if not acquiring.done():
                acquiring.cancel()
                with contextlib.suppress(asyncio.CancelledError, LeaseError):
                    await acquiring
        if client_gone:
            if not acquiring.cancelled() and acquiring.exception() is None:
                await self.service.release_unsent(body, acquiring.result())
            raise ClientGone
        return acquiring.result()

    def _slow_body(self) -> None:
        self.metrics.slow_clients.labels("body").inc()
