"""What the sync and async clients share: the waits and retries of ``acquire`` and
``once``, the ``once`` call's lease in this context (``current_lease``), and how the async
client calls a callback (``async_notify``, ``async_call_soon``; the sync one just calls it)."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from leasekeeper._errors import (
    LeaseConflict,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    RateLimited,
    RequestTimeout,
    ServerError,
    ServiceUnavailable,
)
from leasekeeper.client._timing import acquire_delay

if TYPE_CHECKING:
    from leasekeeper.client._async import AsyncHeldLease
    from leasekeeper.client._sync import HeldLease

__all__ = [
    "FENCE_CHANGED",
    "NOT_OWNED",
    "ONCE_LEASE",
    "UNSURE_COMPLETE",
    "WAITABLE",
    "OnLost",
    "OnWait",
    "Wait",
    "async_call_soon",
    "async_notify",
    "complete_deadline",
    "complete_delay",
    "current_lease",
    "unsure_complete",
]

log = logging.getLogger("leasekeeper.client")

#: ``on_wait(error, delay_seconds)``: told before each wait for a held key. The async
#: client awaits what it returns when that is awaitable (a coroutine function's call).
OnWait = Callable[[LeaseError, float], object]
#: ``on_lost(error)``: told once when a held lease is lost; awaited as ``on_wait`` is.
OnLost = Callable[[LeaseLost], object]
Wait = float | timedelta | None

#: What ``acquire`` waits through when it may wait: held keys and passing faults.
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


def unsure_complete(error: LeaseError) -> bool:
    """Whether a ``complete`` that raised ``error`` may be tried again: an answer that is
    not the service's decision on it. A passing refusal (503 or no answer at all, 429,
    408), a fault of the service (a 500, a 2xx that cannot be read), or a 409 in none of
    the service's words (a proxy's page). Any of them may have come after the result was
    stored; the retry is then answered ``lost`` and finds the result its own
    (``_stored_by_us``), so retrying is safe, and the work is not done again."""
    return isinstance(error, (ServerError, RateLimited, RequestTimeout)) or (
        type(error) is LeaseConflict
    )


#: The lease of the ``once`` call running in this context (``current_lease``).
ONCE_LEASE: contextvars.ContextVar[HeldLease | AsyncHeldLease] = contextvars.ContextVar(
    "leasekeeper_once_lease"
)


def current_lease() -> HeldLease | AsyncHeldLease:
    """The lease held for the ``once``-decorated function running now (in this thread,
    or this task and the tasks it starts): call its ``check()`` before a side effect and
    send its ``fencing_token`` with writes. ``LookupError`` outside such a function."""
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
