"""``IdempotencyMiddleware``: Idempotency-Key for any ASGI app, on ``AsyncLeaseClient``.

Its decisions are made without I/O in ``_policy`` (the settings: which requests are
guarded, the key and fingerprint), ``_request`` (the header), ``_stored`` (a response
stored and replayed) and ``_problems`` (the refusals); this module reads the request,
holds the lease while the app runs, and writes the answers. A guarded request, in order::

    key missing ─────────────> 400 if required, else the app runs unguarded
    body read whole ─────────> fingerprint; lease taken (renewed while the app runs)
        completed ───────────> the stored response, Idempotent-Replayed: true
        held / other payload ─> 409 / 422
        leasekeeper down ────> 503 (or, fail_open, the app runs unguarded)
    the app answers:
        a stored status ─────> buffered; at its last byte stored, then sent
        over 32 KiB ─────────> status and headers stored, then streamed
        other statuses ──────> streamed; the lease released
        raises ──────────────> the lease released; the error goes on
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AsyncExitStack
from typing import Any, Unpack

from leasekeeper import LeaseError, LeaseLost, PayloadTooLarge
from leasekeeper.client import AsyncHeldLease, AsyncLeaseClient
from leasekeeper.web._policy import Policy, PolicyOptions
from leasekeeper.web._problems import Reply, body_too_large, lease_refused
from leasekeeper.web._request import (
    HEADER,
    IdempotentRequest,
    RequestLease,
    read_key,
)
from leasekeeper.web._stored import (
    COMPLETE_RETRY_DELAYS,
    LOST_BEFORE_STORED,
    NOT_STORED,
    UNSURE_COMPLETE,
    ResponseRecorder,
    replay_or_unreadable,
    results_to_store,
)

__all__ = ["IdempotencyMiddleware"]

log = logging.getLogger("leasekeeper.web")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_HEADER = HEADER.encode("ascii")
#: Where the app finds its ``RequestLease``: ``scope["state"]`` (``request.state``).
_STATE_NAME = "leasekeeper"


class IdempotencyMiddleware:
    """Makes an ASGI app's POST and PATCH requests idempotent by their ``Idempotency-Key``.

    ``service`` is leasekeeper's URL or an ``AsyncLeaseClient``; ``namespace`` a minted
    ``ns_...`` (or None: the service then takes only high-entropy keys). The options
    (``PolicyOptions``): ``methods``, ``paths`` (exact, prefixes ending with ``*``, or a
    function), ``required``, ``ttl``, ``stored_statuses`` (below 500 by default),
    ``wait`` (0: a duplicate gets 409 at once), ``fail_open`` (run unguarded rather than
    503), ``fingerprint``, ``key_scope``, ``stored_headers``, ``max_request_bytes``,
    ``docs_url``. The app finds its lease in ``scope["state"]["leasekeeper"]`` (a
    ``RequestLease``, None when unguarded). See docs/middleware.md.
    """

    def __init__(
        self,
        app: ASGIApp,
        service: str | AsyncLeaseClient,
        *,
        namespace: str | None,
        **options: Unpack[PolicyOptions],
    ) -> None:
        self.app = app
        self.policy = Policy.build(namespace=namespace, **options)
        if isinstance(service, AsyncLeaseClient):
            self._url: str | None = None
            self._lease_client = service
        elif isinstance(service, str):
            self._url = service
            self._lease_client = AsyncLeaseClient(service)  # ValueError for a bad URL, now
        else:
            raise TypeError("service must be leasekeeper's URL or an AsyncLeaseClient")
        self._loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> AsyncLeaseClient:
        """The lease client; one of our own is made anew for each event loop, since its
        connections belong to the loop that opened them (a test client's loop ends)."""
        if self._url is not None:
            loop = asyncio.get_running_loop()
            if self._loop is not loop:
                if self._loop is not None:
                    self._lease_client = AsyncLeaseClient(self._url)
                self._loop = loop
        return self._lease_client

    async def aclose(self) -> None:
        """Close the lease client if the middleware made it (done at lifespan shutdown)."""
        if self._url is not None:
            await self._lease_client.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.policy.methods:
            if scope["type"] == "lifespan" and self._url is not None:
                send = self._closing_at_shutdown(send)
            await self.app(scope, receive, send)
            return
        values = [v.decode("latin-1") for k, v in scope["headers"] if k == _HEADER]
        if not (values or self.policy.required) or not self.policy.guards_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        await self._guarded(scope, receive, send, values)

    def _closing_at_shutdown(self, send: Send) -> Send:
        async def closing(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.aclose()
            await send(message)

        return closing

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, values: list[str]) -> None:
        policy = self.policy
        key = read_key(values, policy)
        if isinstance(key, Reply):
            await _send_reply(send, key)
            return
        try:
            body = await _read_body(receive, policy.max_request_bytes)
        except _BodyTooLarge:
            await _send_reply(send, body_too_large(policy))
            return
        if body is None:  # the client left before sending its body: nobody to answer
            return
        request = IdempotentRequest(
            method=scope["method"],
            path=scope["path"],
            query=scope.get("query_string", b"").decode("latin-1"),
            headers=tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]),
            body=body,
            raw=scope,
        )
        lease_key = policy.lease_key(key, request)
        if isinstance(lease_key, Reply):
            await _send_reply(send, lease_key)
            return
        fingerprint = policy.fingerprint_of(request)
        receive = _replaying(body, receive)
        async with AsyncExitStack() as stack:
            try:
                lease = await stack.enter_async_context(
                    self._client().lease(
                        policy.namespace,
                        lease_key,
                        ttl=policy.ttl,
                        fingerprint=fingerprint,
                        wait=policy.wait or None,
                    )
                )
            except LeaseError as error:
                reply = lease_refused(policy, error)
                if reply is None:
                    await self.app(_scope_with(scope, None), receive, send)
                else:
                    await _send_reply(send, reply)
                return
            if lease.completed:
                await _send_reply(send, replay_or_unreadable(policy, lease.result))
                return
            exchange = _Exchange(policy, lease, send)
            await self.app(_scope_with(scope, lease), receive, exchange.send)


class _BodyTooLarge(Exception):
    pass


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body; None if the client disconnected first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body read already, then the real one (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay_receive() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay_receive


def _scope_with(scope: Scope, lease: AsyncHeldLease | None) -> Scope:
    """A copy of ``scope`` with the lease in its state and without the ``http.response.*``
    extensions, whose messages a recorded response cannot hold."""
    state = dict(scope.get("state") or {})
    state[_STATE_NAME] = RequestLease(lease) if lease is not None else None
    extensions = {
        name: value
        for name, value in (scope.get("extensions") or {}).items()
        if not name.startswith("http.response.")
    }
    return {**scope, "state": state, "extensions": extensions}


async def _send_reply(send: Send, reply: Reply) -> None:
    headers = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in reply.framed_headers()]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


class _Exchange:
    """The app's ``send`` for a guarded request: the response is stored before any of it
    reaches the client, so a client that has it and retries gets it replayed."""

    def __init__(self, policy: Policy, lease: AsyncHeldLease, send: Send) -> None:
        self._policy = policy
        self._lease = lease
        self._send = send
        self._recorder = ResponseRecorder()
        self._start: Message | None = None
        self._passing = False

    async def send(self, message: Message) -> None:
        if self._passing:
            await self._send(message)
            return
        kind = message["type"]
        if kind == "http.response.start":
            self._start = message
            status = message["status"]
            headers = message.get("headers", [])
            self._recorder.start(
                status, [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
            )
            if not self._policy.stores_status(status):
                self._passing = True
                await self._send(message)
            return
        if kind != "http.response.body" or self._start is None:
            await self._send(message)  # not ours to keep; the server judges it
            return
        more = message.get("more_body", False)
        if self._recorder.add(message.get("body", b"")):
            if not more:
                body = self._recorder.body()
                await self._complete(body)
                await self._send(self._start)
                await self._send({"type": "http.response.body", "body": body})
            return
        # Over the limit: the status and headers are stored now, so the handler's effect
        # is never repeated, and the body goes out as it comes.
        await self._complete(None)
        self._passing = True
        await self._send(self._start)
        await self._send(
            {"type": "http.response.body", "body": self._recorder.body(), "more_body": more}
        )

    async def _complete(self, body: bytes | None) -> None:
        recorder = self._recorder
        fence = self._lease.fencing_token
        delays = list(COMPLETE_RETRY_DELAYS)
        for result in results_to_store(self._policy, recorder.status, recorder.headers, body):
            while True:
                try:
                    await self._lease.complete(result)
                    return
                except LeaseLost:
                    log.warning(LOST_BEFORE_STORED, fence)
                    return
                except PayloadTooLarge:
                    break
                except UNSURE_COMPLETE as error:
                    if not delays:
                        log.warning(NOT_STORED, fence, error.error)
                        return
                    await asyncio.sleep(delays.pop(0))
        log.warning(NOT_STORED, fence, "too large")
