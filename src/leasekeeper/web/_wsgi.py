"""``WSGIIdempotencyMiddleware``: Idempotency-Key for any WSGI app, on ``LeaseClient``.

The same behaviour as ``IdempotencyMiddleware`` (see ``_asgi``), from the same
decisions (``_policy``, ``_request``, ``_stored``, ``_problems``); here the lease is
renewed by a thread while the app runs in the request's thread, and the app's body
iterable is read in the middleware up to the storable size before anything is sent.
"""

from __future__ import annotations

import io
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING, Unpack
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from leasekeeper import LeaseError, LeaseLost, PayloadTooLarge
from leasekeeper.client import HeldLease, LeaseClient
from leasekeeper.web._policy import Policy, PolicyOptions
from leasekeeper.web._problems import Reply, body_too_large, lease_refused, status_line
from leasekeeper.web._request import (
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

if TYPE_CHECKING:
    from _typeshed import OptExcInfo

__all__ = ["WSGIIdempotencyMiddleware"]

log = logging.getLogger("leasekeeper.web")

Environ = WSGIEnvironment
WSGIApp = WSGIApplication
Write = Callable[[bytes], object]

#: Where the app finds its ``RequestLease`` (Flask: ``request.environ["leasekeeper.lease"]``).
ENVIRON_KEY = "leasekeeper.lease"
_READ_CHUNK = 64 * 1024


class WSGIIdempotencyMiddleware:
    """Makes a WSGI app's POST and PATCH requests idempotent by their ``Idempotency-Key``.

    The options are ``IdempotencyMiddleware``'s; ``service`` is leasekeeper's URL or a
    ``LeaseClient``. The app finds its lease in ``environ["leasekeeper.lease"]`` (a
    ``RequestLease``, None when it runs unguarded). See docs/middleware.md.
    """

    def __init__(
        self,
        app: WSGIApp,
        service: str | LeaseClient,
        *,
        namespace: str | None,
        **options: Unpack[PolicyOptions],
    ) -> None:
        self.app = app
        self.policy = Policy.build(namespace=namespace, **options)
        if isinstance(service, LeaseClient):
            self._owned = False
            self._lease_client = service
        elif isinstance(service, str):
            self._owned = True
            self._lease_client = LeaseClient(service)
        else:
            raise TypeError("service must be leasekeeper's URL or a LeaseClient")

    def close(self) -> None:
        """Close the lease client if the middleware made it."""
        if self._owned:
            self._lease_client.close()

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        if environ["REQUEST_METHOD"] not in self.policy.methods:
            return self.app(environ, start_response)
        value = environ.get("HTTP_IDEMPOTENCY_KEY")
        if (value is None and not self.policy.required) or not self.policy.guards_path(
            _path(environ)
        ):
            return self.app(environ, start_response)
        return self._guarded(environ, start_response, [] if value is None else [value])

    def _guarded(
        self, environ: Environ, start_response: StartResponse, values: list[str]
    ) -> Iterable[bytes]:
        policy = self.policy
        key = read_key(values, policy)
        if isinstance(key, Reply):
            return _reply(start_response, key)
        try:
            body = _read_body(environ, policy.max_request_bytes)
        except _BodyTooLarge:
            return _reply(start_response, body_too_large(policy))
        request = IdempotentRequest(
            method=environ["REQUEST_METHOD"],
            path=_path(environ),
            query=environ.get("QUERY_STRING", ""),
            headers=_headers(environ),
            body=body,
            raw=environ,
        )
        lease_key = policy.lease_key(key, request)
        if isinstance(lease_key, Reply):
            return _reply(start_response, lease_key)
        fingerprint = policy.fingerprint_of(request)
        environ = {**environ, "wsgi.input": io.BytesIO(body), "CONTENT_LENGTH": str(len(body))}
        stack = ExitStack()
        try:
            lease = stack.enter_context(
                self._lease_client.lease(
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
                environ[ENVIRON_KEY] = None
                return self.app(environ, start_response)
            return _reply(start_response, reply)
        if lease.completed:
            return _reply(start_response, replay_or_unreadable(policy, lease.result))
        environ[ENVIRON_KEY] = RequestLease(lease)
        try:
            return _Exchange(policy, lease, start_response, stack).run(self.app, environ)
        except BaseException:
            stack.__exit__(*sys.exc_info())  # the lease released; the error goes on
            raise


def _path(environ: Environ) -> str:
    """The request's path, decoded (WSGI gives its UTF-8 bytes as latin-1 text)."""
    path = environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")
    return str(path.encode("latin-1", "replace").decode("utf-8", "replace"))


def _headers(environ: Environ) -> tuple[tuple[str, str], ...]:
    headers = []
    for name, value in environ.items():
        if name.startswith("HTTP_"):
            headers.append((name[5:].replace("_", "-").lower(), value))
        elif name in ("CONTENT_TYPE", "CONTENT_LENGTH") and value:
            headers.append((name.replace("_", "-").lower(), value))
    return tuple(headers)


class _BodyTooLarge(Exception):
    pass


def _read_body(environ: Environ, limit: int) -> bytes:
    """The whole request body: ``CONTENT_LENGTH`` bytes, or up to the end of a chunked one
    (``wsgi.input_terminated``); a request with neither has none (PEP 3333)."""
    stream = environ["wsgi.input"]
    try:
        length: int | None = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if not length and environ.get("wsgi.input_terminated"):
        length = None
    if length is not None and length > limit:
        raise _BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    while length is None or size < length:
        chunk = stream.read(_READ_CHUNK if length is None else min(_READ_CHUNK, length - size))
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _reply(start_response: StartResponse, reply: Reply) -> list[bytes]:
    start_response(status_line(reply.status), reply.framed_headers())
    return [reply.body]


class _Exchange:
    """Runs the app for a guarded request and records its response; it is stored before
    any of it reaches the client, as in ``IdempotencyMiddleware``."""

    def __init__(
        self, policy: Policy, lease: HeldLease, start_response: StartResponse, stack: ExitStack
    ) -> None:
        self._policy = policy
        self._lease = lease
        self._start_response = start_response
        self._stack = stack
        self._recorder = ResponseRecorder()
        self._status = ""
        self._headers: list[tuple[str, str]] = []
        #: Set once the response goes out as it comes (not stored, or too large to).
        self._write: Write | None = None
        #: Chunks for the client, not yet handed to the server.
        self._pending: list[bytes] = []

    def run(self, app: WSGIApp, environ: Environ) -> Iterable[bytes]:
        iterable = app(environ, self._start)
        try:
            iterator = iter(iterable)
            for chunk in iterator:
                self._add(chunk)
                if self._write is not None:
                    return _Stream(self._pending, iterator, iterable, self._stack)
        except BaseException:
            _close(iterable)
            raise
        _close(iterable)
        if not self._status:
            raise RuntimeError("the WSGI app returned without calling start_response")
        if self._write is not None:  # a status not stored: passed through at once
            return _Stream(self._pending, iter(()), (), self._stack)
        body = self._recorder.body()
        self._complete(body)
        self._stack.close()
        self._start_response(self._status, self._headers)
        return [body]

    def _start(
        self, status: str, headers: list[tuple[str, str]], exc_info: OptExcInfo | None = None
    ) -> Write:
        if self._write is not None:  # sent already: the server raises exc_info, as it must
            return self._start_response(status, headers, exc_info)
        self._status, self._headers = status, list(headers)
        code = int(status.split(" ", 1)[0])
        self._recorder.start(code, self._headers)
        if not self._policy.stores_status(code):
            self._write = self._start_response(status, headers, exc_info)
        return self._app_write

    def _app_write(self, data: bytes) -> None:
        """The legacy ``write()``: kept as a yielded chunk is, in order."""
        if self._write is None:
            self._add(data)
            return
        for chunk in self._pending:  # what was held back goes first
            self._write(chunk)
        self._pending.clear()
        self._write(data)

    def _add(self, chunk: bytes) -> None:
        if self._write is not None:
            self._pending.append(chunk)
        elif not self._recorder.add(chunk):
            # Over the limit: the status and headers are stored now, so the handler's
            # effect is never repeated, and the body goes out as it comes.
            self._complete(None)
            self._write = self._start_response(self._status, self._headers)
            self._pending.extend(self._recorder.chunks)

    def _complete(self, body: bytes | None) -> None:
        recorder = self._recorder
        fence = self._lease.fencing_token
        delays = list(COMPLETE_RETRY_DELAYS)
        for result in results_to_store(self._policy, recorder.status, recorder.headers, body):
            while True:
                try:
                    self._lease.complete(result)
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
                    time.sleep(delays.pop(0))
        log.warning(NOT_STORED, fence, "too large")


class _Stream:
    """The body of a response that goes out as it comes: what was held back, then the
    rest of the app's iterable; closing it closes that and lets the lease go."""

    def __init__(
        self,
        head: list[bytes],
        rest: Iterator[bytes],
        iterable: Iterable[bytes],
        stack: ExitStack,
    ) -> None:
        self._head = head
        self._rest = rest
        self._iterable = iterable
        self._stack = stack

    def __iter__(self) -> Iterator[bytes]:
        while self._head:
            yield self._head.pop(0)
        yield from self._rest

    def close(self) -> None:
        try:
            _close(self._iterable)
        finally:
            self._stack.close()


def _close(iterable: Iterable[bytes]) -> None:
    close = getattr(iterable, "close", None)
    if close is not None:
        close()
