"""The asyncio client: ``AsyncLeaseClient`` and the ``AsyncHeldLease`` of ``async with``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import random as _random
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, ParamSpec

import httpx

from leasekeeper._clock import elapsed_seconds
from leasekeeper._errors import LeaseError, LeaseHeld, LeaseLost, ServiceUnreachable
from leasekeeper.client._common import (
    FENCE_CHANGED,
    NOT_OWNED,
    ONCE_LEASE,
    UNSURE_COMPLETE,
    WAITABLE,
    OnWait,
    Wait,
    complete_deadline,
    complete_delay,
    unsure_complete,
)
from leasekeeper.client._http import (
    DEFAULT_TIMEOUT,
    HEADERS,
    BodyReader,
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
from leasekeeper.client._timing import RenewalPlan, acquire_delay, as_seconds

__all__ = ["AsyncHeldLease", "AsyncLeaseClient"]

log = logging.getLogger("leasekeeper.client")

P = ParamSpec("P")

#: ``on_lost(error)``: a function or a coroutine function, told once when the lease is lost.
AsyncOnLost = Callable[[LeaseLost], object]


class AsyncLeaseClient:
    """The asyncio mirror of ``LeaseClient``; every operation is a coroutine.

    ``AsyncLeaseClient("http://127.0.0.1:8787")``, or ``client=`` an
    ``httpx.AsyncClient`` of yours, or ``transport=`` (for example
    ``httpx.ASGITransport(app)`` to talk to an app in-process).
    ``monotonic``, ``signal_factory``, ``task_factory`` and ``random`` drive
    waiting and background renewal; tests replace them.
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
            self._http = httpx.AsyncClient(
                base_url=http_root(base_url), transport=transport, timeout=timeout
            )
            self._prefix = ""
            self._owns_http = True
        else:
            self._http = client
            self._prefix = route_prefix(base_url, client)
            self._owns_http = False
        self.timeout = timeout
        self._monotonic = monotonic
        self._signal_factory = signal_factory
        self._task_factory = task_factory
        self._random = random

    async def aclose(self) -> None:
        """Close the HTTP client if this object opened it."""
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncLeaseClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _post(
        self, route: str, body: dict[str, Any], request_seconds: float | None = None
    ) -> Any:
        content = encode(body)
        url = self._prefix + route
        # As in LeaseClient._post: timeouts only on our own client, and the request's time
        # bounds the whole exchange, here with asyncio.timeout (the head included).
        seconds = self.timeout if request_seconds is None else request_seconds
        bounded = self._owns_http and isinstance(seconds, int | float)  # not an httpx.Timeout
        reader = BodyReader(None, self._monotonic)
        try:
            async with asyncio.timeout(seconds if bounded else None):
                if request_seconds is None or not self._owns_http:
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
        except TimeoutError:
            raise ServiceUnreachable("The lease service's answer did not arrive in time") from None
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
        """Take the lease on ``key``, waiting as ``LeaseClient.acquire`` does;
        ``on_wait`` may be a plain function or a coroutine function."""
        return (await self._acquire(namespace, key, ttl, fingerprint, wait, on_wait))[0]

    async def _acquire(
        self,
        namespace: str | None,
        key: str,
        ttl: int | None,
        fingerprint: str | None,
        wait: Wait,
        on_wait: OnWait | None,
    ) -> tuple[Lease | Completed, float]:
        body = lease_body(namespace=namespace, key=key, ttl_seconds=ttl, fingerprint=fingerprint)
        deadline = self._monotonic() + as_seconds(wait)
        attempt = 0
        while True:
            sent_at = self._monotonic()
            try:
                return parse_acquire(await self._post("/lease", body)), sent_at
            except WAITABLE as error:
                delay = acquire_delay(
                    attempt,
                    error.retry_after or 0,
                    deadline - self._monotonic(),
                    self._random(),
                    held=isinstance(error, LeaseHeld),
                )
                if delay is None:
                    raise
                if on_wait is not None:
                    told = on_wait(error, delay)
                    if inspect.isawaitable(told):  # a coroutine function, as on_lost may be
                        await told
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

    def lease(
        self,
        namespace: str | None,
        key: str,
        *,
        ttl: int = 30,
        fingerprint: str | None = None,
        wait: Wait = None,
        on_lost: AsyncOnLost | None = None,
        on_wait: OnWait | None = None,
    ) -> AsyncHeldLease:
        """A lease for an ``async with`` block; see ``AsyncHeldLease``."""
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
        on_lost: AsyncOnLost | None = None,
    ) -> Callable[[Callable[P, Awaitable[Any]]], Callable[P, Awaitable[Any]]]:
        """Run the decorated coroutine function at most once per key and fingerprint.

        As ``LeaseClient.once``: every caller gets the stored result, the function
        finds its ``AsyncHeldLease`` in ``current_lease()``, and a ``complete``
        whose answer does not say whether it stored the result is tried again while
        the lease is held.
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
        """As ``LeaseClient._complete_once``."""
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


class AsyncHeldLease:
    """The asyncio mirror of ``HeldLease``: renewed by a task, ``lost`` an ``asyncio.Event``.

    ``on_lost`` may be a plain function or a coroutine function; it runs in the
    renewal task, and runs to its end even when the block is left meanwhile. Leaving
    the block cancels the renewal task (not a lost lease's), then releases the
    lease unless it was completed or lost (one lost to a renewal refused otherwise
    than ``lost``, or answered with another fencing token, is released too: the
    service may still hold it).
    """

    def __init__(
        self,
        client: AsyncLeaseClient,
        namespace: str | None,
        key: str,
        *,
        ttl: int,
        fingerprint: str | None,
        wait: Wait,
        on_lost: AsyncOnLost | None,
        on_wait: OnWait | None,
    ) -> None:
        if type(ttl) is not int:  # not a bool or None either: the renewal plan needs seconds
            raise TypeError("ttl must be a whole number of seconds (an int)")
        self._client = client
        self._namespace = namespace
        self._key = key
        self._ttl = ttl
        self._fingerprint = fingerprint
        self._wait = wait
        self._on_lost = on_lost
        self._on_wait = on_wait
        self.lost = asyncio.Event()
        self.lost_error: LeaseLost | None = None
        self.completed = False
        self.result: Any = None
        self.grant: Lease | None = None
        self.completion: Completed | None = None
        self.renewer: AsyncRenewalWorker | None = None
        self._lock = asyncio.Lock()
        self._callbacks: set[asyncio.Future[None]] = set()
        self._entered = False
        self._ended = False
        #: A complete's answer did not say whether it stored the result (``complete``).
        self._unsure = False
        #: Lost for want of proof, not on the service's word: leaving releases it
        #: (``LeaseClient``'s ``HeldLease`` has the same).
        self._maybe_held = False

    def __repr__(self) -> str:
        state = (
            "completed"
            if self.completed
            else "lost"
            if self.lost.is_set()
            else "ended"
            if self._ended
            else "held"
            if self._entered
            else "not entered"
        )
        grant, completion = self.grant, self.completion
        fence = grant.fencing_token if grant else completion.fencing_token if completion else None
        return f"<AsyncHeldLease {state} fencing_token={fence}>"

    @property
    def fencing_token(self) -> int:
        """The fence to send with writes: this owner's, also after it completed.

        A key found completed on entry has none for this worker, which never held
        it and must not write: ``LeaseLost``, as from ``check()``, so that a write
        guarded by the fence (``FenceGuard``) cannot pass with the completer's.
        That one is ``completion.fencing_token``.
        """
        if self.grant is not None:
            return self.grant.fencing_token
        if self.completed:
            raise LeaseLost(NOT_OWNED)
        raise RuntimeError("the lease has not been acquired; use it in an async with block")

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
        lost = self.lost.is_set()
        if self.renewer is not None:
            # A lost lease's renewal task is not cancelled: it may be running on_lost, which
            # runs to its end as in the sync client (a renewal still in flight ends by its
            # own deadline, and acts on nothing).
            await self.renewer.stop(cancel=not lost)
        if lost and not self._maybe_held:
            self._ended = True
            return
        async with self._lock:
            if self._ended:
                return
            self._ended = True
            # Lost on the service's word, or past its expiry: nothing to release. Lost to a
            # renewal refused otherwise (a proxy's 404): the service may still hold it.
            if self.lost.is_set() and not self._maybe_held:
                return
            try:
                await self._client.release(self._namespace, self._key, self._token())
            except LeaseLost:
                log.debug("the lease was no longer held at release")
            except LeaseError as error:
                log.warning(
                    "could not release the lease (%s); it expires by itself after its TTL",
                    error.error,
                )
            except Exception as exc:  # a closed client: the block's own exception goes on
                log.warning(
                    "could not release the lease (%s); it expires by itself after its TTL",
                    type(exc).__name__,
                )

    def check(self) -> None:
        """Raise ``LeaseLost`` unless this lease is still held (by the local estimate)."""
        if self.lost.is_set() and self.lost_error is not None:
            raise LeaseLost(self.lost_error.error)
        if self.completed:
            raise LeaseLost("The work on this key is completed; there is no lease to hold")
        if self._ended or not self._entered:
            raise LeaseLost("The lease is not held (not entered, released or exited)")
        renewer = self.renewer
        if renewer is not None and renewer.plan.expired(self._client._monotonic()):
            error = LeaseLost("The lease expired before a renewal succeeded")
            if self._set_lost(error) and self._on_lost is not None:
                # check() is not a coroutine: a coroutine on_lost runs as a task.
                task = asyncio.ensure_future(self._call_on_lost(error))
                self._callbacks.add(task)
                task.add_done_callback(self._callbacks.discard)
            raise LeaseLost(error.error)

    async def complete(self, result: Any) -> Any:
        """Store ``result`` and end ownership for good; returns the stored (redacted) result.
        As ``HeldLease.complete``, an unsure answer included."""
        try:
            return await self._complete(result, retried=self._unsure)
        except LeaseError as error:
            if unsure_complete(error):
                log.warning(UNSURE_COMPLETE, error.status, error.error)
            raise

    async def _complete(self, result: Any, *, retried: bool) -> Any:
        """As ``HeldLease._complete``."""
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
            await self.renewer.stop()  # after an unsure answer too: as HeldLease
        if unsure is not None:
            raise unsure
        return self.result

    async def _stored_by_us(self) -> Completed | None:
        """As ``HeldLease._stored_by_us``."""
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

    def _renewal_stopped(self) -> bool:
        """Whether renewal was told to stop (a renewal waiting for the lock then sends none),
        or a ``complete`` may have stored the result (``_unsure``): a renewal would then be
        answered lost, and report as lost a lease whose work is stored."""
        return self._unsure or (self.renewer is not None and self.renewer.stopped)

    def _token(self) -> str:
        if self.grant is None:  # pragma: no cover - guarded by the callers
            raise RuntimeError("the lease has not been acquired")
        return self.grant.owner_token

    async def _renew_for_worker(
        self,
        request_seconds: float,
        deadline: Callable[[], AbstractAsyncContextManager[object]],
    ) -> int | None:
        async with self._lock:
            if self._ended or self.lost.is_set() or self._renewal_stopped():
                return None
            async with deadline():  # entered once the lock is held, as in the sync client
                renewed = await self._client._renew(
                    self._namespace, self._key, self._token(), self._ttl, request_seconds
                )
            if self.grant is not None and renewed.fencing_token != self.grant.fencing_token:
                raise Unproven(FENCE_CHANGED)
            self.grant = renewed
            return self.grant.ttl_seconds

    def _set_lost(self, error: LeaseLost, *, maybe_held: bool = False) -> bool:
        if self.lost.is_set() or self._ended:
            return False
        self.lost_error = error
        self._maybe_held = maybe_held
        self.lost.set()
        fence = self.grant.fencing_token if self.grant else 0
        log.warning("lease lost (fencing token %d): %s", fence, error.error)
        return True

    async def _lost(self, error: LeaseLost, *, maybe_held: bool = False) -> None:
        """Ownership ended without us: set ``lost``, log a WARNING, call ``on_lost`` once.
        ``maybe_held``: on no word of the service's, so leaving still releases it."""
        if self._set_lost(error, maybe_held=maybe_held):
            await self._call_on_lost(error)

    async def _call_on_lost(self, error: LeaseLost) -> None:
        if self._on_lost is None:
            return
        try:
            outcome = self._on_lost(error)
            if inspect.isawaitable(outcome):
                await outcome
        except Exception:
            log.exception("the on_lost callback failed")
