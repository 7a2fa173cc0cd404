"""What the sync and async clients share: the waits and retries of ``acquire`` and
``once``, the ``once`` call's lease in this context (``current_lease``), and how the async
client calls a callback (``async_notify``, ``async_call_soon``; the sync one just calls it)."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import threading
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from leasekeeper._errors import (
    LeaseConflict,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    OutcomeUnknown,
    RateLimited,
    RequestTimeout,
    ServerError,
    ServiceUnavailable,
)
from leasekeeper.client._timing import acquire_delay

if TYPE_CHECKING:
    from leasekeeper.client._async import AsyncHeldLease, AsyncLeaseClient
    from leasekeeper.client._renewer import AsyncRenewalWorker, RenewalWorker
    from leasekeeper.client._results import Completed, Lease
    from leasekeeper.client._sync import HeldLease, LeaseClient

__all__ = [
    "FENCE_CHANGED",
    "NOT_OWNED",
    "ONCE_LEASE",
    "UNSURE_COMPLETE",
    "WAITABLE",
    "HeldLeaseBase",
    "OnLost",
    "OnWait",
    "Wait",
    "async_call_soon",
    "async_notify",
    "complete_deadline",
    "complete_delay",
    "current_lease",
    "unknown_outcome",
    "unsure_complete",
]

log = logging.getLogger("leasekeeper.client")

#: ``on_wait(error, delay_seconds)``, told before each wait, and ``on_lost(error)``, told
#: once when a held lease is lost; the async client awaits what they return if it can.
OnWait = Callable[[LeaseError, float], object]
OnLost = Callable[[LeaseLost], object]
Wait = float | timedelta | None

#: What ``wait=`` retries: a held key, a busy or unavailable service, a request the
#: service did not receive in time (408).
WAITABLE = (LeaseHeld, RateLimited, ServiceUnavailable, RequestTimeout)


async def async_notify(callback: Callable[..., object], *args: object) -> None:
    """``callback(*args)``, awaited when it returns an awaitable: the async client's
    callbacks may be plain functions or coroutine functions."""
    outcome = callback(*args)
    if inspect.isawaitable(outcome):
        await outcome


#: The tasks started by ``async_call_soon``, kept until they end (the loop keeps only
#: weak references to its tasks).
_CALLED_SOON: set[asyncio.Future[None]] = set()


def async_call_soon(function: Callable[..., Coroutine[Any, Any, None]], *args: object) -> None:
    """``await function(*args)`` in a task of its own, for code that cannot await it
    (``AsyncHeldLease.check`` is not a coroutine)."""
    task = asyncio.ensure_future(function(*args))
    _CALLED_SOON.add(task)
    task.add_done_callback(_CALLED_SOON.discard)


def unknown_outcome(error: LeaseError, unknown: OutcomeUnknown) -> OutcomeUnknown:
    """What an acquire raises when its waiting ends on ``error`` after an attempt whose
    outcome was ``unknown``: that attempt may hold the key under a token nobody received,
    so a ``LeaseHeld`` (or any refusal to wait on) is not "not acquired"."""
    return OutcomeUnknown(
        f"{unknown.error}; an earlier attempt may have been granted the lease, whose owner "
        f"token was lost, and the last one was refused ({error.status}): the key may be "
        "held by that lease until its TTL ends",
        retry_after_seconds=error.retry_after or unknown.retry_after_seconds,
    )


def unsure_complete(error: LeaseError) -> bool:
    """Whether a ``complete`` that raised ``error`` may be tried again: an answer that is
    not the service's decision (503 or none, 429, 408, a 500, an unreadable 2xx, a 409 not
    in the service's words). It may have come after the result was stored: the retry is
    then answered ``lost`` and finds the result its own (``_stored_by_us``)."""
    return isinstance(error, (ServerError, RateLimited, RequestTimeout)) or (
        type(error) is LeaseConflict
    )


#: The lease of the ``once`` call running in this context (``current_lease``).
ONCE_LEASE: contextvars.ContextVar[HeldLease | AsyncHeldLease] = contextvars.ContextVar(
    "leasekeeper_once_lease"
)


def current_lease() -> HeldLease | AsyncHeldLease:
    """The lease held for the ``once``-decorated function running now (in this thread, or
    this task and the tasks it starts); ``LookupError`` outside such a function."""
    try:
        return ONCE_LEASE.get()
    except LookupError:
        raise LookupError("current_lease() is only set inside a function run by once()") from None


def complete_deadline(lease: HeldLease | AsyncHeldLease, now: float) -> float:
    """Until when ``once`` may go on retrying a ``complete`` that failed at ``now``:
    while the lease is held by the local estimate, and at most one TTL."""
    renewer = lease.renewer
    expires = renewer.plan.expires_at if renewer is not None else now
    return min(expires, now + lease._ttl)


def complete_delay(error: LeaseError, attempt: int, remaining: float, rand: float) -> float | None:
    """The pause before retrying a ``complete`` refused with ``error`` (None: give up),
    as ``acquire`` waits out an outage; said in a WARNING."""
    delay = acquire_delay(attempt, error.retry_after or 0, remaining, rand, held=False)
    if delay is not None:
        log.warning(
            "storing the result failed (%s: %s); retrying in %.1f s",
            error.status,
            error.error,
            delay,
        )
    return delay


#: A renewal answered with a fencing token other than the lease's (the service keeps it on
#: a renewal): a misrouted or broken answer, after which ownership cannot be proven.
FENCE_CHANGED = (
    "A renewal was answered with another fencing token than the lease's: "
    "ownership can no longer be proven"
)

#: The WARNING of a ``complete()`` whose answer does not say whether it stored the result.
UNSURE_COMPLETE = (
    "complete() got no answer that says whether the result was stored (%s: %s); renewals "
    "have stopped: call complete() again before the lease expires, or the next worker "
    "takes the key"
)

NOT_OWNED = (
    "The work on this key was completed before this lease was entered: "
    "it holds no fencing token and must not write"
)


ClientT = TypeVar("ClientT", bound="LeaseClient | AsyncLeaseClient")


class HeldLeaseBase(Generic[ClientT]):
    """The state of a held lease and what reads or marks it without waiting, for both
    clients' held leases (each names its types and how ``check()`` calls ``on_lost``)."""

    #: Set once ownership ended without this object ending it.
    lost: threading.Event | asyncio.Event
    renewer: RenewalWorker | AsyncRenewalWorker | None
    #: Serializes owner operations (renew, complete, release) between the block and the
    #: renewal worker, so a renewal never lands after a complete or release.
    _lock: threading.Lock | asyncio.Lock
    _EVENT: ClassVar[Callable[[], threading.Event | asyncio.Event]]
    _LOCK: ClassVar[Callable[[], threading.Lock | asyncio.Lock]]
    #: The class's name, and the block it is used in, for ``repr`` and errors.
    _NAME: ClassVar[str]
    _BLOCK: ClassVar[str]

    def __init__(
        self,
        client: ClientT,
        namespace: str | None,
        key: str,
        *,
        ttl: int,
        fingerprint: str | None,
        wait: Wait,
        on_lost: OnLost | None,
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
        self.lost = type(self)._EVENT()
        self.lost_error: LeaseLost | None = None
        self.completed = False
        self.result: Any = None
        #: The latest grant (acquire, then each renewal); None until entered or if completed.
        self.grant: Lease | None = None
        self.completion: Completed | None = None
        self.renewer = None
        self._lock = type(self)._LOCK()
        # Makes "lost" once only when the renewal worker, its deadline and check() race
        # (threads in the sync client); held for no await.
        self._lost_lock = threading.Lock()
        self._entered = False
        self._ended = False  # this object ended ownership (completed, released, exited)
        #: A complete's answer did not say whether it stored the result (``complete``).
        self._unsure = False
        #: Lost for want of proof, not on the service's word (a renewal refused otherwise
        #: than ``lost``): the service may still hold it, so leaving releases it.
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
        return f"<{self._NAME} {state} fencing_token={fence}>"

    @property
    def fencing_token(self) -> int:
        """The fence to send with writes: this owner's, also after it completed. A key
        found completed on entry has none for this worker, which never held it:
        ``LeaseLost`` (the completer's is ``completion.fencing_token``)."""
        if self.grant is not None:
            return self.grant.fencing_token
        if self.completed:
            raise LeaseLost(NOT_OWNED)
        raise RuntimeError(f"the lease has not been acquired; use it in {self._BLOCK}")

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
                self._on_lost_from_check(error)
            raise LeaseLost(error.error)

    def _on_lost_from_check(self, error: LeaseLost) -> None:
        """Call ``on_lost`` from ``check()``, which is not a coroutine (each side's own)."""
        raise NotImplementedError

    def _renewal_stopped(self) -> bool:
        """Whether renewal was told to stop (a renewal waiting for the lock then sends none),
        or a ``complete`` may have stored the result (``_unsure``): a renewal would then be
        answered lost, and report as lost a lease whose work is stored."""
        return self._unsure or (self.renewer is not None and self.renewer.stopped)

    def _token(self) -> str:
        if self.grant is None:  # pragma: no cover - guarded by the callers
            raise RuntimeError("the lease has not been acquired")
        return self.grant.owner_token

    def _set_lost(self, error: LeaseLost, *, maybe_held: bool = False) -> bool:
        """Set ``lost`` and log a WARNING, once; whether this call did."""
        with self._lost_lock:
            if self.lost.is_set() or self._ended:
                return False
            self.lost_error = error
            self._maybe_held = maybe_held
            self.lost.set()
        fence = self.grant.fencing_token if self.grant else 0
        log.warning("lease lost (fencing token %d): %s", fence, error.error)
        return True
