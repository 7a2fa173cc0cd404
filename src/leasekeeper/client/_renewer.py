"""Background renewal: one explicit worker per held lease, sync (a thread) and async (a task).

A turn waits on a stop event *with a timeout* (never ``sleep``), so stopping takes
effect at once; then it renews and reschedules from the ``RenewalPlan``. The lease is
held weakly, so a forgotten one is not renewed for ever. Every way renewal can end
badly reaches the lease's ``_lost`` (``lost`` set, a WARNING, ``on_lost``)::

    renew ok ──────────> next turn at sent_at + ttl/3
    lost (409) ────────> lease lost, worker ends
    another fence ─────> lease lost (Unproven); the block's exit still releases it
    503/5xx/429/408 ───> retry soon; past the local expiry: lease lost
    other refusals ────> lease lost (nothing a retry would change); the block's
                         exit still releases it, as the service may hold it
    granted < asked ───> lifecycle end: no more renewals; lost at the expiry
    stop() ────────────> worker ends, touches the lease no more

Clock, events and the thread or task factory are injected: tests drive the worker turn
by turn (``step()``) on a fake clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Protocol

from leasekeeper._errors import LeaseError, LeaseLost, RateLimited, RequestTimeout, ServerError
from leasekeeper.client._timing import MIN_RETRY_SECONDS, RenewalPlan

__all__ = [
    "AsyncRenewalWorker",
    "AsyncSignal",
    "AsyncWaiter",
    "RenewalWorker",
    "TaskFactory",
    "ThreadFactory",
    "ThreadLike",
    "Unproven",
    "Waiter",
]

#: Renewal failures tried again until the local expiry: the service is down, busy or
#: asked us to slow down, or it did not receive our request in time (408).
_RETRIED = (ServerError, RateLimited, RequestTimeout)

log = logging.getLogger("leasekeeper.client")


class Unproven(LeaseLost):
    """A renewal's answer that cannot prove ownership (another fencing token), though the
    service did not say it is gone: reported as a ``LeaseLost`` the block still releases."""


def _failure(
    plan: RenewalPlan, error: LeaseError, monotonic: Callable[[], float]
) -> tuple[LeaseLost, bool] | None:
    """What a renewal refused with ``error`` means (the module's table): the error the
    lease is lost with and whether it may still be held; or None, a retry scheduled."""
    if isinstance(error, Unproven):
        return LeaseLost(error.error), True
    if isinstance(error, LeaseLost):
        return error, False
    if not isinstance(error, _RETRIED):
        return _refused(error), True
    now = monotonic()
    plan.failed(now, error.retry_after or 1)
    log.warning(
        "lease renewal failed (%s: %s); retrying in %.1f s, the lease expires in %.1f s",
        error.status,
        error.error,
        max(plan.next_at - now, 0.0),
        max(plan.expires_at - now, 0.0),
    )
    return None


class Waiter(Protocol):
    """What the sync worker waits on: ``threading.Event``'s shape."""

    def wait(self, timeout: float | None = None) -> bool: ...
    def set(self) -> None: ...
    def is_set(self) -> bool: ...


class ThreadLike(Protocol):
    def start(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def is_alive(self) -> bool: ...


class ThreadFactory(Protocol):
    """``threading.Thread``'s constructor, as far as the worker uses it."""

    def __call__(self, *, target: Callable[[], object], name: str, daemon: bool) -> ThreadLike: ...


class AsyncWaiter(Protocol):
    """What the async worker waits on; ``AsyncSignal`` is the real one."""

    async def wait(self, seconds: float | None = None) -> bool: ...
    def set(self) -> None: ...
    def is_set(self) -> bool: ...


TaskFactory = Callable[[Coroutine[Any, Any, None]], "asyncio.Future[None] | None"]


class AsyncSignal:
    """An ``asyncio.Event`` whose ``wait`` takes a timeout and says whether it was set."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self, seconds: float | None = None) -> bool:
        """Wait until set or ``seconds`` pass; whether it was set."""
        if self._event.is_set():
            return True
        try:
            async with asyncio.timeout(seconds):
                await self._event.wait()
        except TimeoutError:
            return self._event.is_set()
        return True


class _SyncLease(Protocol):
    def _renew_for_worker(
        self, request_seconds: float, deadline: Callable[[], AbstractContextManager[object]]
    ) -> int | None: ...
    def _lost(self, error: LeaseLost, *, maybe_held: bool = False) -> None: ...


class _AsyncLease(Protocol):
    async def _renew_for_worker(
        self,
        request_seconds: float,
        deadline: Callable[[], AbstractAsyncContextManager[object]],
    ) -> int | None: ...
    async def _lost(self, error: LeaseLost, *, maybe_held: bool = False) -> None: ...


def _expired(plan: RenewalPlan) -> LeaseLost:
    if plan.final:
        return LeaseLost(
            "The lease reached the end of its key's lifecycle (absolute_expires_at) "
            "and cannot be renewed any further"
        )
    return LeaseLost(
        f"The lease expired before a renewal succeeded ({plan.failures} failed attempts)"
    )


def _crashed() -> LeaseLost:
    return LeaseLost(
        "Lease renewal stopped on an unexpected error; ownership can no longer be assured"
    )


def _unanswered() -> LeaseLost:
    return LeaseLost("The lease expired while a renewal was still waiting for its answer")


def _refused(error: LeaseError) -> LeaseLost:
    return LeaseLost(
        f"Lease renewal was refused ({error.status}: {error.error}); "
        "ownership can no longer be assured"
    )


def _log_late(plan: RenewalPlan, now: float) -> None:
    late = now - plan.next_at
    if late > plan.late_after:
        log.warning(
            "lease renewal is %.1f s late (was the process paused or overloaded?); "
            "%.1f s of the lease were left",
            late,
            plan.expires_at - now,
        )


def _log_final(plan: RenewalPlan, now: float) -> None:
    if plan.final:
        log.warning(
            "the lease reached the end of its key's lifecycle: it ends in %.1f s "
            "and cannot be renewed",
            plan.expires_at - now,
        )


class RenewalWorker:
    """Renews one lease from a thread until it is stopped, the lease is lost, or gone.

    ``step()`` is one turn; ``run()`` (the thread's target) repeats it. After ``stop()``
    the worker no longer acts on the lease, even if a request was still in flight.
    """

    def __init__(
        self,
        lease: _SyncLease,
        plan: RenewalPlan,
        *,
        monotonic: Callable[[], float],
        event_factory: Callable[[], Waiter],
        thread_factory: ThreadFactory,
        request_timeout: float,
    ) -> None:
        self.plan = plan
        self.renewals = 0
        self._lease = weakref.ref(lease)
        self._monotonic = monotonic
        self._event_factory = event_factory
        self._thread_factory = thread_factory
        self._stop = event_factory()
        self._request_timeout = request_timeout
        self._thread = thread_factory(target=self.run, name="leasekeeper-renewal", daemon=True)
        self._started = False

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        self._thread.start()
        self._started = True  # only now: a thread that never started cannot be joined

    def stop(self, *, wait: bool = True) -> bool:
        """End renewal now, waiting for a renewal in flight (up to the request timeout)
        unless ``wait`` is false; False when one is still in flight (it will not act on
        the lease when it ends)."""
        self._stop.set()
        if not self._started or self._thread is threading.current_thread():
            return True
        if not wait:
            return not self._thread.is_alive()
        limit = self._request_timeout + 1.0
        self._thread.join(limit)
        if self._thread.is_alive():
            log.warning(
                "the lease renewal thread did not stop within %.1f s; "
                "it will not act on the lease any more",
                limit,
            )
            return False
        return True

    def _stop_on_exit(self, *, lost: bool, release: bool) -> bool:
        """``stop`` as the lease's block is left: a renewal in flight is waited for only when
        the lease is to be ``release``d. Whether the lease may be released now."""
        return self.stop(wait=release)

    def run(self) -> None:
        """Turn after turn until done; an unexpected error marks the lease lost, loudly."""
        try:
            while self.step():
                pass
        except Exception:
            log.exception("the lease renewal worker failed")
            lease = self._lease()
            if lease is not None and not self.stopped:
                lease._lost(_crashed(), maybe_held=True)

    def step(self) -> bool:
        """Wait until the next renewal is due, then renew; False when the worker is done."""
        if self._stop.wait(self.plan.wait_seconds(self._monotonic())):
            return False
        lease = self._lease()
        if lease is None:
            log.debug("the lease object is gone; renewal stops")
            return False
        return self._turn(lease)

    def _turn(self, lease: _SyncLease) -> bool:
        plan, now = self.plan, self._monotonic()
        if plan.expired(now):
            lease._lost(_expired(plan))
            return False
        _log_late(plan, now)
        timeout = min(self._request_timeout, max(plan.expires_at - now, MIN_RETRY_SECONDS))
        try:
            granted = lease._renew_for_worker(timeout, lambda: self._watch_expiry(lease))
        except LeaseError as error:
            if self.stopped:
                return False
            failure = _failure(plan, error, self._monotonic)
            if failure is not None:
                lease._lost(failure[0], maybe_held=failure[1])
            return failure is None
        if granted is None or self.stopped:
            return False
        plan.renewed(granted, now)
        self.renewals += 1
        _log_final(plan, now)
        return True

    @contextlib.contextmanager
    def _watch_expiry(self, lease: _SyncLease) -> Iterator[None]:
        """Around a renewal's request: report the lease lost if no answer has come by the
        local expiry (httpx's timeout bounds each read, not the whole request)."""
        answered = self._event_factory()
        seconds = max(self.plan.expires_at - self._monotonic(), 0.0)

        def watch() -> None:
            if not answered.wait(seconds) and not self.stopped:
                lease._lost(_unanswered())

        self._thread_factory(target=watch, name="leasekeeper-renewal-deadline", daemon=True).start()
        try:
            yield
        finally:
            answered.set()


class AsyncRenewalWorker:
    """The asyncio mirror of ``RenewalWorker``: one task, stopped by cancellation."""

    def __init__(
        self,
        lease: _AsyncLease,
        plan: RenewalPlan,
        *,
        monotonic: Callable[[], float],
        signal_factory: Callable[[], AsyncWaiter],
        task_factory: TaskFactory,
        request_timeout: float,
    ) -> None:
        self.plan = plan
        self.renewals = 0
        self._lease = weakref.ref(lease)
        self._monotonic = monotonic
        self._stop = signal_factory()
        self._task_factory = task_factory
        self._request_timeout = request_timeout
        self._task: asyncio.Future[None] | None = None

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        self._task = self._task_factory(self.run())

    async def stop(self, *, cancel: bool = True) -> None:
        """End renewal now, cancelling a renewal in flight; with ``cancel`` false the task
        ends by itself (an ``on_lost`` it runs runs to its end), acting on the lease no more."""
        self._stop.set()
        task = self._task
        if not cancel or task is None or task is asyncio.current_task() or task.done():
            return
        task.cancel()
        # asyncio.wait does not raise the task's CancelledError, so a cancellation
        # of the caller itself still propagates.
        await asyncio.wait([task])

    async def _stop_on_exit(self, *, lost: bool, release: bool) -> bool:
        """``stop`` as the lease's block is left; a lost lease's task is not cancelled (it
        may be running ``on_lost``). True: the lease may be released now."""
        await self.stop(cancel=not lost)
        return True

    async def run(self) -> None:
        try:
            while await self.step():
                pass
        except Exception:
            log.exception("the lease renewal worker failed")
            lease = self._lease()
            if lease is not None and not self.stopped:
                await lease._lost(_crashed(), maybe_held=True)

    async def step(self) -> bool:
        """Wait until the next renewal is due, then renew; False when the worker is done."""
        if await self._stop.wait(self.plan.wait_seconds(self._monotonic())):
            return False
        lease = self._lease()
        if lease is None:
            log.debug("the lease object is gone; renewal stops")
            return False
        return await self._turn(lease)

    async def _turn(self, lease: _AsyncLease) -> bool:
        plan, now = self.plan, self._monotonic()
        if plan.expired(now):
            await lease._lost(_expired(plan))
            return False
        _log_late(plan, now)
        timeout = min(self._request_timeout, max(plan.expires_at - now, MIN_RETRY_SECONDS))

        def deadline() -> asyncio.Timeout:
            # On the whole request (httpx's timeout bounds each read only).
            left = max(plan.expires_at - self._monotonic(), MIN_RETRY_SECONDS)
            return asyncio.timeout(min(self._request_timeout, left))

        try:
            granted = await lease._renew_for_worker(timeout, deadline)
        except TimeoutError:
            if self.stopped:
                return False
            later = self._monotonic()
            if plan.expired(later):
                await lease._lost(_unanswered())
                return False
            plan.failed(later, MIN_RETRY_SECONDS)
            log.warning(
                "lease renewal was not answered within %.1f s; retrying, the lease expires "
                "in %.1f s",
                timeout,
                max(plan.expires_at - later, 0.0),
            )
            return True
        except LeaseError as error:
            if self.stopped:
                return False
            failure = _failure(plan, error, self._monotonic)
            if failure is not None:
                await lease._lost(failure[0], maybe_held=failure[1])
            return failure is None
        if granted is None or self.stopped:
            return False
        plan.renewed(granted, now)
        self.renewals += 1
        _log_final(plan, now)
        return True
