"""The queue in front of a store's writer: calls wait, run in batches, and each is
answered once, within the store's timeout (``Deadlines``).

Calls that arrive while a batch runs make up the next one, so under load one
transaction serves many. A 503 means nothing was written, and that rests on one rule:
a call is answered by exactly one of two hands, never both::

    submit ──► queued ──take()──► claimed by a batch ──► answered by that batch
                 │                     │
         deadline passed:         deadline passed: the batch's own bound (its lock
         503 (Deadlines)          wait, its Runner) answers it; given back with its
                                  deadline passed (``retry``): 503; still unanswered a
                                  timeout later (a hung fsync): 503, outcome unknown

A queued call whose deadline passes gets 503 and is never taken into a batch: nothing
is decided for a caller told 503. A call taken into a batch (``take`` claims it) is
answered only by that batch, which must answer within the earliest deadline of its
calls: it answers 503 only when it has written nothing (it rolls back), and "outcome
unknown" when it cannot tell. ``Deadlines`` leaves claimed calls alone until a whole
timeout after their deadline, and then answers "outcome unknown": a batch stuck that
long (a disk that hangs) may still commit.

How a batch runs is the store's ``run``, since there the stores differ. SQLite has one
connection, so one runner: ``run`` COMMITs on the loop (or on the writer's thread, to
wait for a lock) and leaves the answers to the syncer, which gives them after its
fsync while the runner takes the next batch; a task is a batch ``alone``. PostgreSQL
runs up to ``runners`` transactions at once on pooled connections, with retries:
``run`` answers its batch once the COMMIT is answered, and gives back (``retry``) the
calls to decide again. A ``run`` that raises answers its whole batch with the error (a
bug as ``InternalError``, logged), and the runner goes on: a ``run`` raises only what
it has made true (a ``ServiceUnavailable`` after a rollback).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from leasekeeper._errors import InternalError, LeaseError, OutcomeUnknown, ServiceUnavailable

__all__ = ["Batcher", "Deadlines", "Request", "earliest", "late", "settle"]

T = TypeVar("T")


def settle(future: asyncio.Future[Any], outcome: Any) -> None:
    """Give ``future`` its outcome (raised when an exception), unless it is done already."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def late() -> ServiceUnavailable:
    """What a call gets whose deadline passed before anything was written for it."""
    return ServiceUnavailable("The lease store did not answer in time")


@dataclass(slots=True, eq=False)
class Request(Generic[T]):
    """One call waiting for a batch: what it asks, and its caller's future."""

    item: T
    future: asyncio.Future[Any]
    #: When its caller is given up on, in its loop's time (set by ``Deadlines.watch``).
    deadline: float = math.inf
    #: Taken into a batch (``Batcher.take``): only that batch answers it now.
    claimed: bool = False
    #: How many batches gave it back to be decided again (``Batcher.retry``).
    returned: int = 0


def earliest(batch: Iterable[Request[Any]]) -> float:
    """The earliest deadline of ``batch``'s calls: when the batch must have answered."""
    return min((request.deadline for request in batch), default=math.inf)


class Batcher(Generic[T]):
    """Runs queued calls in batches of up to ``max_batch`` with ``run``, on up to
    ``runners`` tasks at once; ``alone(item)`` says which calls are a batch by
    themselves, ``log`` where a failed batch is logged."""

    def __init__(
        self,
        run: Callable[[list[Request[T]]], Awaitable[None]],
        *,
        timeout_seconds: float,
        max_batch: int,
        log: logging.Logger,
        runners: int = 1,
        alone: Callable[[T], bool] | None = None,
    ) -> None:
        self.pending: collections.deque[Request[T]] = collections.deque()
        #: The runners' tasks, for a store that cancels them as it closes.
        self.tasks: set[asyncio.Task[None]] = set()
        self._run = run
        self._max_batch = max_batch
        self._max_runners = runners
        self._alone = alone
        self._log = log
        self._deadlines = Deadlines(timeout_seconds)
        # Counted in the runner itself, not by its task's done callback, which runs a
        # turn later: a call queued meanwhile would find no runner left to take it.
        self._running = 0
        self._idle: asyncio.Future[None] | None = None

    def submit(self, item: T) -> asyncio.Future[Any]:
        """Queue ``item`` for a batch: the future of its outcome (an error is raised)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        request = Request(item, future)
        self._deadlines.watch(request)
        self.pending.append(request)
        if self._running < self._max_runners:
            self._running += 1
            task = loop.create_task(self._drain())
            self.tasks.add(task)
            task.add_done_callback(self._ended)
        return future

    def take(self) -> list[Request[T]]:
        """The next batch, claimed (only it answers them now): up to ``max_batch`` calls
        not answered yet, in their order; one that must be ``alone`` only by itself. A
        call whose deadline has passed is answered 503 instead (its timer may be late)."""
        pending, alone = self.pending, self._alone
        batch: list[Request[T]] = []
        now = asyncio.get_running_loop().time() if pending else 0.0
        while pending and len(batch) < self._max_batch:
            request = pending[0]
            if request.future.done():
                pending.popleft()
            elif request.deadline <= now:
                settle(pending.popleft().future, late())
            elif alone is not None and alone(request.item):
                if not batch:
                    batch.append(pending.popleft())
                break
            else:
                batch.append(pending.popleft())
        for request in batch:
            request.claimed = True
        return batch

    @staticmethod
    def answer(results: Iterable[tuple[Request[T], Any]]) -> None:
        """Answer each call with its outcome."""
        for request, outcome in results:
            settle(request.future, outcome)

    @staticmethod
    def fail(batch: Iterable[Request[T]], error: LeaseError) -> None:
        """Answer every call of ``batch`` with ``error``."""
        for request in batch:
            settle(request.future, error)

    def retry(self, requests: list[Request[T]], limit: int) -> None:
        """Give ``requests`` back (nothing was written for them) to the front of the
        queue, in their order, to be decided again; one given back ``limit`` times, or
        whose deadline has passed, is answered 503 instead."""
        now = asyncio.get_running_loop().time() if requests else 0.0
        for request in reversed(requests):
            request.claimed = False
            request.returned += 1
            if request.returned >= limit:
                settle(request.future, ServiceUnavailable("The lease store is too busy"))
            elif request.deadline <= now:
                settle(request.future, late())
            elif not request.future.done():
                self.pending.appendleft(request)

    def refuse_all(self, error: LeaseError) -> None:
        """Answer every queued call with ``error``."""
        while self.pending:
            settle(self.pending.popleft().future, error)

    async def idle(self) -> None:
        """Return once no runner is left (the queue is empty, every batch has run)."""
        if self._running:
            if self._idle is None:
                self._idle = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._idle)

    async def _drain(self) -> None:
        """A runner: batches until the queue is empty, each a turn of the loop after the
        last, so that what arrives meanwhile joins it."""
        try:
            while batch := self.take():
                try:
                    await self._run(batch)
                except asyncio.CancelledError:  # the store is closing
                    self.fail(batch, ServiceUnavailable("The lease store is closing"))
                    raise
                except LeaseError as exc:
                    self.fail(batch, exc)
                except Exception:  # a bug: its callers must not hang
                    self._log.exception("a batch of %d calls failed", len(batch))
                    self.fail(batch, InternalError())
                await asyncio.sleep(0)
        finally:
            self._running -= 1
            if not self._running and self._idle is not None:
                settle(self._idle, None)
                self._idle = None

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a runner raises nothing but cancellation


class Deadlines:
    """Answers ``ServiceUnavailable`` to each call still queued ``seconds`` after it
    began, and ``OutcomeUnknown`` to each call claimed by a batch and still unanswered
    ``seconds`` later again (a batch answers its calls itself; this is for one stuck
    past its own bounds, which may yet commit). Every call waits the same ``seconds``,
    so deadlines come due in the order the calls were made: one loop timer, set for
    the oldest unanswered, serves them all."""

    __slots__ = ("_loop", "_seconds", "_stuck", "_timer", "_waiting")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._waiting: collections.deque[Request[Any]] = collections.deque()
        #: Calls claimed at their deadline, until their second one.
        self._stuck: collections.deque[Request[Any]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, request: Request[Any]) -> None:
        """Set ``request.deadline`` ``seconds`` from now, and answer it then unless it is
        answered or claimed by then (on its future's loop)."""
        loop = request.future.get_loop()
        waiting = self._waiting
        if loop is not self._loop:  # a first call, or the store reopened on another loop
            self._loop, self._timer = loop, None
            waiting.clear()
            self._stuck.clear()
        while waiting and waiting[0].future.done():
            waiting.popleft()
        request.deadline = loop.time() + self._seconds
        waiting.append(request)
        if self._timer is None:
            self._timer = loop.call_at(request.deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        loop = self._loop
        assert loop is not None
        now = loop.time()
        waiting, stuck = self._waiting, self._stuck
        while waiting and (waiting[0].future.done() or waiting[0].deadline <= now):
            request = waiting.popleft()
            if request.future.done():
                continue
            if request.claimed:  # its batch answers it
                stuck.append(request)
            else:
                settle(request.future, late())
        while stuck and (stuck[0].future.done() or stuck[0].deadline + self._seconds <= now):
            request = stuck.popleft()
            settle(
                request.future,
                OutcomeUnknown(
                    "The lease store did not answer in time and may still apply this "
                    "request: its outcome is unknown"
                ),
            )
        due = min(
            waiting[0].deadline if waiting else math.inf,
            stuck[0].deadline + self._seconds if stuck else math.inf,
        )
        if due < math.inf:
            self._timer = loop.call_at(due, self._expire)
