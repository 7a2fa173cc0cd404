"""The asyncio client: ``AsyncLeaseClient`` and the ``AsyncHeldLease`` of ``async with``.

The one source of both clients: ``python scripts/unasync.py`` writes the sync client
(``_sync.py``) from it by renaming (``async def`` to ``def``, ``AsyncX`` to ``X``, ...).
What differs between the sides lives outside, each twin beside the other: bounding a
request's time (``_http``), calling a callback (``_common``), the renewal worker
(``_renewer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import random as _random
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, ParamSpec

import httpx

from leasekeeper._clock import elapsed_seconds
from leasekeeper._errors import LeaseError, LeaseHeld, LeaseLost, OutcomeUnknown
from leasekeeper.client._common import (
    FENCE_CHANGED,
    ONCE_LEASE,
    UNSURE_COMPLETE,
    WAITABLE,
    HeldLeaseBase,
    OnLost,
    OnWait,
    Wait,
    async_call_soon,
    async_notify,
    complete_deadline,
    complete_delay,
    unknown_outcome,
    unsure_complete,
)
from leasekeeper.client._http import (
    DEFAULT_TIMEOUT,
    HEADERS,
    AsyncBodyReader,
    Direct,
    async_own_transport,
    async_within,
    encode,
    http_root,
    lease_body,
    read_response,
    renewal_timeout,
    route_prefix,
    unreachable,
)
from leasekeeper.client._renewer import (
    AsyncRenewalWorker,
    AsyncSignal,
    AsyncWaiter,
    TaskFactory,
    Unproven,
)
from leasekeeper.client._results import (
    Completed,
    Lease,
    Released,
    parse_acquire,
    parse_completed,
    parse_lease,
    parse_namespace,
    parse_released,
)
from leasekeeper.client._timing import RenewalPlan, acquire_delay, as_seconds, server_wait

__all__ = ["AsyncHeldLease", "AsyncLeaseClient"]

log = logging.getLogger("leasekeeper.client")

P = ParamSpec("P")


class AsyncLeaseClient:
    """A client for the leasekeeper HTTP API (docs/python-client.md says it all).

    It opens its own ``httpx.AsyncClient`` unless given ``client=`` (whose ``base_url``
    applies when ``base_url`` is not given) or ``transport=``. A refusal raises the
    matching exception of ``leasekeeper``'s one tree; no answer, ``ServiceUnreachable``.
    ``monotonic``, ``signal_factory``, ``task_factory`` and ``random`` are for tests.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        monotonic: Callable[[], float] = elapsed_seconds,
        signal_factory: Callable[[], AsyncWaiter] = AsyncSignal,
        task_factory: TaskFactory = asyncio.ensure_future,
        random: Callable[[], float] = _random.random,
    ) -> None:
        if client is not None and transport is not None:
            raise TypeError("pass either client= or transport=, not both")
        if client is None:
            root, own = http_root(base_url), None
            if transport is None:
                # One TLS context, made as httpx makes it, for its transports and our own.
                context = httpx.create_ssl_context()
                self._http = httpx.AsyncClient(base_url=root, timeout=timeout, verify=context)
                own = async_own_transport(context)
            else:
                self._http = httpx.AsyncClient(base_url=root, transport=transport, timeout=timeout)
            self._prefix = ""
            self._owns_http = True
            self._direct: Direct | None = Direct(self._http, timeout, own)
        else:
            self._http = client
            self._prefix = route_prefix(base_url, client)
            self._owns_http = False
            self._direct = None
        self.timeout = timeout
        self._monotonic = monotonic
        self._signal_factory = signal_factory
        self._task_factory = task_factory
        self._random = random

    # -- lifecycle ---------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the HTTP client if this object opened it."""
        if self._owns_http:
            await self._http.aclose()
            if self._direct is not None and self._direct.own is not None:
                await self._direct.own.aclose()

    async def __aenter__(self) -> AsyncLeaseClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- the five operations -------------------------------------------------------------------

    async def _post(
        self, route: str, body: dict[str, Any], request_seconds: float | None = None
    ) -> dict[str, Any]:
        content = encode(body)
        url = self._prefix + route
        # Timeouts only on our own client: an injected one keeps its settings (Starlette's
        # TestClient refuses a per-request timeout). A number of seconds (not None, nor an
        # httpx.Timeout) bounds the whole answer's arrival too.
        seconds = self.timeout if request_seconds is None else request_seconds
        owned = self._owns_http
        limit = seconds if owned and isinstance(seconds, int | float) else None
        reader = AsyncBodyReader(limit, self._monotonic)
        direct = self._direct
        if direct is not None and direct.transport is not None and not self._http.is_closed:
            request = direct.request(route, content, request_seconds)
            return await self._post_direct(direct, request, limit, reader)
        try:
            async with async_within(limit):
                if request_seconds is None or not owned:
                    streamed = self._http.stream("POST", url, content=content, headers=HEADERS)
                else:
                    streamed = self._http.stream(
                        "POST", url, content=content, headers=HEADERS, timeout=request_seconds
                    )
                async with streamed as response:
                    if reader.start(response):  # never an encoded body: nothing is inflated
                        async for chunk in response.aiter_bytes():
                            reader.add(chunk)
        except httpx.RequestError as exc:  # no answer, or none that could be read
            raise unreachable(exc) from exc
        return read_response(response, reader.content())

    async def _post_direct(
        self,
        direct: Direct,
        request: httpx.Request,
        limit: float | None,
        reader: AsyncBodyReader,
    ) -> dict[str, Any]:
        """``_post`` on our own client, straight to its transport (``Direct``)."""
        try:
            async with async_within(limit):
                response = await direct.transport.handle_async_request(request)
                try:
                    if reader.start(response):  # never an encoded body: nothing is inflated
                        # (its stream: a response a transport has read already, as
                        # MockTransport does, is read again, as httpx's client reads it)
                        async for chunk in response.stream:
                            reader.add(chunk)
                finally:
                    await response.aclose()
        except httpx.RequestError as exc:  # no answer, or none that could be read
            exc.request = request  # (httpx's client does this; its message names the URL)
            raise unreachable(exc) from exc
        return read_response(response, reader.content())

    async def create_namespace(self) -> str:
        """Mint a namespace: a 256-bit bearer secret. Keep it; nobody can recover it."""
        return parse_namespace(await self._post("/lease/namespace", {}))

    async def acquire(
        self,
        namespace: str | None,
        key: str,
        *,
        ttl: int | None = None,
        fingerprint: str | None = None,
        wait: Wait = None,
        on_wait: OnWait | None = None,
    ) -> Lease | Completed:
        """Take the lease on ``key``: a ``Lease`` (yours now) or the ``Completed`` result.
        With ``wait`` (seconds, a ``timedelta``, ``math.inf``) a held key is waited for by
        the service, and a rate limit or an outage is retried with backoff;
        ``on_wait(error, delay)`` is told of each pause, and of each wait on the service
        that ended held (``delay`` 0: asked again at once).
        ``OutcomeUnknown`` when an attempt may have been granted a lease whose token was
        lost: never ``LeaseHeld`` after one, since the holder may be that lease."""
        outcome, _ = await self._acquire(namespace, key, ttl, fingerprint, wait, on_wait)
        return outcome

    async def _acquire(
        self,
        namespace: str | None,
        key: str,
        ttl: int | None,
        fingerprint: str | None,
        wait: Wait,
        on_wait: OnWait | None,
    ) -> tuple[Lease | Completed, float]:
        """Acquire, waiting as ``acquire`` does; also returns when the winning request was
        sent. A held key is waited for by the server (``wait_seconds``, up to a minute per
        request), which hands the key over the moment it is free; the client itself waits
        only out the last fraction of a second, and out rate limits and outages."""
        body = lease_body(namespace=namespace, key=key, ttl_seconds=ttl, fingerprint=fingerprint)
        deadline = self._monotonic() + as_seconds(wait)
        attempt = 0
        unknown: OutcomeUnknown | None = None
        while True:
            sent_at = self._monotonic()
            waits = server_wait(deadline - sent_at)
            try:
                if not waits:
                    return parse_acquire(await self._post("/lease", body)), sent_at
                asked = {**body, "wait_seconds": waits}
                answer = await self._post("/lease", asked, self.timeout + waits)
                return parse_acquire(answer), sent_at
            except WAITABLE as error:
                if isinstance(error, OutcomeUnknown):
                    unknown = error
                if waits and isinstance(error, LeaseHeld):
                    # The server waited: ask it to wait on, at once (progress is told).
                    if on_wait is not None:
                        await async_notify(on_wait, error, 0.0)
                    continue
                delay = acquire_delay(
                    attempt,
                    error.retry_after or 0,
                    deadline - self._monotonic(),
                    self._random(),
                    held=isinstance(error, LeaseHeld),
                )
                if delay is None:
                    if unknown is None or error is unknown:
                        raise
                    raise unknown_outcome(error, unknown) from error
                if on_wait is not None:
                    await async_notify(on_wait, error, delay)
                await self._signal_factory().wait(delay)
                attempt += 1

    async def renew(
        self, namespace: str | None, key: str, owner_token: str, *, ttl: int | None = None
    ) -> Lease:
        """Move the lease's expiry to ``min(now + ttl, absolute_expires_at)``; same fence."""
        return await self._renew(namespace, key, owner_token, ttl, None)

    async def _renew(
        self,
        namespace: str | None,
        key: str,
        owner_token: str,
        ttl: int | None,
        request_seconds: float | None,
    ) -> Lease:
        body = lease_body(namespace=namespace, key=key, owner_token=owner_token, ttl_seconds=ttl)
        return parse_lease(await self._post("/lease/renew", body, request_seconds), owner_token)

    async def release(self, namespace: str | None, key: str, owner_token: str) -> Released:
        """End ownership now; the key can be acquired at once, its binding stays."""
        body = lease_body(namespace=namespace, key=key, owner_token=owner_token)
        return parse_released(await self._post("/lease/release", body))

    async def complete(
        self, namespace: str | None, key: str, owner_token: str, result: Any
    ) -> Completed:
        """Store ``result`` (any JSON value, at most 32 KiB) and end ownership for good."""
        body = lease_body(namespace=namespace, key=key, owner_token=owner_token, result=result)
        return parse_completed(await self._post("/lease/complete", body))

    # -- held leases -------------------------------------------------------------------------

    def lease(
        self,
        namespace: str | None,
        key: str,
        *,
        ttl: int = 30,
        fingerprint: str | None = None,
        wait: Wait = None,
        on_lost: OnLost | None = None,
        on_wait: OnWait | None = None,
    ) -> AsyncHeldLease:
        """A lease for an ``async with`` block: acquired on entry, renewed, released on exit
        (see ``AsyncHeldLease``). ``wait`` and ``on_wait`` are ``acquire``'s; ``on_lost`` is
        called once if the lease is lost."""
        return AsyncHeldLease(
            self,
            namespace,
            key,
            ttl=ttl,
            fingerprint=fingerprint,
            wait=wait,
            on_lost=on_lost,
            on_wait=on_wait,
        )

    def once(
        self,
        namespace: str | None,
        *,
        key: str | Callable[..., str],
        fingerprint: str | Callable[..., str | None] | None = None,
        ttl: int = 30,
        wait: Wait = math.inf,
        on_lost: OnLost | None = None,
    ) -> Callable[[Callable[P, Awaitable[Any]]], Callable[P, Awaitable[Any]]]:
        """Run the decorated function (in the async client, a coroutine function) at most
        once per key and fingerprint, across workers; every caller gets the stored result.

        ``key`` and ``fingerprint`` are values or functions of the call's arguments.
        Others wait while the key is held (by default for ever); if the function raises,
        the next caller runs it. Inside it ``current_lease()`` is its lease. A
        ``complete`` whose answer does not say whether it stored the result is retried.
        """

        def decorate(function: Callable[P, Awaitable[Any]]) -> Callable[P, Awaitable[Any]]:
            @functools.wraps(function)
            async def run_once(*args: P.args, **kwargs: P.kwargs) -> Any:
                the_key = key(*args, **kwargs) if callable(key) else key
                the_fingerprint = (
                    fingerprint(*args, **kwargs) if callable(fingerprint) else fingerprint
                )
                async with self.lease(
                    namespace,
                    the_key,
                    ttl=ttl,
                    fingerprint=the_fingerprint,
                    wait=wait,
                    on_lost=on_lost,
                ) as lease:
                    if lease.completed:
                        return lease.result
                    running = ONCE_LEASE.set(lease)
                    try:
                        value = await function(*args, **kwargs)
                    finally:
                        ONCE_LEASE.reset(running)
                    return await self._complete_once(lease, value)

            return run_once

        return decorate

    async def _complete_once(self, lease: AsyncHeldLease, value: Any) -> Any:
        """``lease.complete(value)``, tried again while the lease is held after an answer
        that does not say whether it was stored (``unsure_complete``)."""
        attempt, deadline = 0, math.inf
        while True:
            try:
                # Stops the renewals when unsure; retried with a WARNING of its own.
                return await lease._complete(value, retried=lease._unsure)
            except LeaseError as error:
                if not unsure_complete(error):
                    raise
                now = self._monotonic()  # after the stop, which may wait for a renewal
                if attempt == 0:
                    deadline = complete_deadline(lease, now)
                delay = complete_delay(error, attempt, deadline - now, self._random())
                if delay is None:
                    raise
                await self._signal_factory().wait(delay)
                attempt += 1


class AsyncHeldLease(HeldLeaseBase["AsyncLeaseClient"]):
    """A lease held for an ``async with`` block: acquired on entry, renewed about every
    third of ``ttl``, released on exit unless completed or lost on the service's word.

    A key already completed with this fingerprint gives ``completed`` and the stored
    ``result``. If ownership ends early, ``lost`` is set, ``lost_error`` says why,
    ``on_lost`` is called and ``check()`` raises ``LeaseLost`` (docs/python-client.md,
    "How a held lease behaves", says every case).
    """

    _NAME = "AsyncHeldLease"
    _BLOCK = "an async with block"
    _EVENT = asyncio.Event
    _LOCK = asyncio.Lock
    lost: asyncio.Event
    renewer: AsyncRenewalWorker | None
    _lock: asyncio.Lock

    async def __aenter__(self) -> AsyncHeldLease:
        if self._entered:
            raise RuntimeError("an AsyncHeldLease is entered once; call client.lease() again")
        outcome, sent_at = await self._client._acquire(
            self._namespace, self._key, self._ttl, self._fingerprint, self._wait, self._on_wait
        )
        self._entered = True
        if isinstance(outcome, Completed):
            self.completion, self.completed, self.result = outcome, True, outcome.result
            self._ended = True
            return self
        self.grant = outcome
        try:
            self._start_renewal(outcome, sent_at)
        except BaseException:  # the key is ours: let it go rather than hold it to its TTL
            await self.__aexit__(None, None, None)
            raise
        return self

    def _start_renewal(self, outcome: Lease, sent_at: float) -> None:
        client = self._client
        self.renewer = AsyncRenewalWorker(
            self,
            RenewalPlan.after_acquire(self._ttl, outcome.ttl_seconds, sent_at),
            monotonic=client._monotonic,
            signal_factory=client._signal_factory,
            task_factory=client._task_factory,
            request_timeout=renewal_timeout(client.timeout),
        )
        self.renewer.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        lost = self.lost.is_set()  # the service said so, or its expiry has passed
        # A lost lease has nothing to release, unless it was lost to a refused renewal:
        # the service may still hold that one, and it is released as a held one is.
        release = not lost or self._maybe_held
        stopped = (
            await self.renewer._stop_on_exit(lost=lost, release=release)
            if self.renewer is not None
            else True
        )
        if not release or not stopped:
            self._ended = True
            if release:
                log.warning(
                    "could not release the lease: a renewal is still waiting for its "
                    "answer; it expires by itself after its TTL"
                )
            return
        async with self._lock:
            if self._ended:
                return
            self._ended = True
            if self.lost.is_set() and not self._maybe_held:
                return
            try:
                await self._client.release(self._namespace, self._key, self._token())
            except LeaseLost:
                log.debug("the lease was no longer held at release")
            except Exception as exc:  # a closed client too: the block's own exception goes on
                why = exc.error if isinstance(exc, LeaseError) else type(exc).__name__
                log.warning(
                    "could not release the lease (%s); it expires by itself after its TTL", why
                )

    def _on_lost_from_check(self, error: LeaseLost) -> None:
        async_call_soon(self._call_on_lost, error)  # check() is not a coroutine

    async def complete(self, result: Any) -> Any:
        """Store ``result`` and end ownership for good; returns the stored (redacted) result.
        After an error that does not say whether it was stored (``unsure_complete``),
        renewals stop: call ``complete`` again before the lease expires to find out."""
        try:
            return await self._complete(result, retried=self._unsure)
        except LeaseError as error:
            if unsure_complete(error):
                log.warning(UNSURE_COMPLETE, error.status, error.error)
            raise

    async def _complete(self, result: Any, *, retried: bool) -> Any:
        """``complete``; ``retried`` when an earlier attempt may have stored the result:
        no local check first, and a ``lost`` is looked into (``_stored_by_us``)."""
        if not retried:
            self.check()
        unsure: LeaseError | None = None
        async with self._lock:
            try:
                done: Completed | None = await self._client.complete(
                    self._namespace, self._key, self._token(), result
                )
            except LeaseLost as error:
                done = await self._stored_by_us() if retried else None
                lost: LeaseLost | None = error if done is None else None
            except LeaseError as error:
                if not unsure_complete(error):
                    raise
                done, lost, unsure, self._unsure = None, None, error, True
            except asyncio.CancelledError:  # the request may have been sent, and stored
                self._unsure = True
                raise
            else:
                lost = None
            if done is not None:  # stored: from now on a complete() is refused as any is
                self._ended, self._unsure = True, False
                self.completion, self.completed, self.result = done, True, done.result
        if lost is not None:
            await self._lost(lost)
            raise lost
        if self.renewer is not None:
            # After an unsure answer too: a renewal would race the retried complete, and
            # be answered lost (the key completed) if the first attempt stored it.
            await self.renewer.stop()
        if unsure is not None:
            raise unsure
        return self.result

    async def _stored_by_us(self) -> Completed | None:
        """The result an earlier attempt of this owner stored, or None, after a retried
        complete answered ``lost``: looked up with an acquire (a key found free is let go
        again at once)."""
        try:
            found = await self._client.acquire(
                self._namespace, self._key, ttl=1, fingerprint=self._fingerprint
            )
        except LeaseError as error:
            if unsure_complete(error):  # no answer to the lookup: still unsure, not lost
                raise
            return None
        if isinstance(found, Completed):
            ours = self.grant is not None and found.fencing_token == self.grant.fencing_token
            return found if ours else None
        with contextlib.suppress(LeaseError):
            await self._client.release(self._namespace, self._key, found.owner_token)
        return None

    async def release(self) -> None:
        """Release the lease now, before the block ends (``LeaseLost`` if it was lost)."""
        self.check()
        if self.renewer is not None:
            await self.renewer.stop()
        async with self._lock:
            self._ended = True
            await self._client.release(self._namespace, self._key, self._token())

    # -- for the renewal worker ------------------------------------------------------------------

    async def _renew_for_worker(
        self,
        request_seconds: float,
        deadline: Callable[[], AbstractAsyncContextManager[object]],
    ) -> int | None:
        """Renew once for the worker; the granted TTL, or None if the lease is over. The
        request is sent inside ``deadline()``, entered once the lock is held (a slow
        ``complete`` holding it is not a renewal waiting for its answer)."""
        async with self._lock:
            if self._ended or self.lost.is_set() or self._renewal_stopped():
                return None
            async with deadline():
                renewed = await self._client._renew(
                    self._namespace, self._key, self._token(), self._ttl, request_seconds
                )
            if self.grant is not None and renewed.fencing_token != self.grant.fencing_token:
                raise Unproven(FENCE_CHANGED)
            self.grant = renewed
            return self.grant.ttl_seconds

    async def _lost(self, error: LeaseLost, *, maybe_held: bool = False) -> None:
        """Ownership ended without us: set ``lost``, log a WARNING, call ``on_lost`` once.
        ``maybe_held``: on no word of the service's (a renewal refused otherwise), so
        leaving the block still releases it."""
        if self._set_lost(error, maybe_held=maybe_held):
            await self._call_on_lost(error)

    async def _call_on_lost(self, error: LeaseLost) -> None:
        if self._on_lost is None:
            return
        try:
            await async_notify(self._on_lost, error)
        except Exception:
            log.exception("the on_lost callback failed")
