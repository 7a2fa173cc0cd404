"""Acquires that wait for a held key (``wait_seconds``): per-key queues at this instance.

A waiting acquire decides like any other first; when the rules say 409 ``held`` it
joins its key's queue here and waits. Only the queue's head ever asks the store again,
and only when something may have changed: a release or completion at this instance
(``changed``), the same at another instance sharing the store (the store's change
feed, ``ChangeFeed``), the lease it waits on running out (a timer at its expiry),
or, with a store shared by several instances, a periodic re-check that bounds the
cost of a missed notification. Nothing else costs store work, however many wait.

What the head decides settles the queue:

- granted (201): the head leaves with the lease; the next waiter becomes the head
  and decides at once (it then waits on the new owner's lease);
- completed: every waiter is decided at once against the completed record, by the
  same pure rules (200 ``completed`` for the same fingerprint, 409 ``conflict``);
- held: the head waits on;
- the store unreachable: every waiter of the key is answered 503.

A newcomer whose key has waiters here joins the queue without deciding: a decision of
its own could take a key just freed ahead of the head being woken for it. A waiter
whose time runs out (or whose server stops) is answered from what the queue last
learned of the key, decided by the same rules at the estimated store time: 409
``held`` with the ``retry_after_seconds`` of the lease it waited on (the head, alone
allowed to take the key, asks the store once more instead).

Time here is the event loop's (``Timers``); the store's time is estimated from the
store's ``now`` at the last decision plus the loop time since. Tests inject timers
that follow a fake clock.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

from leasekeeper._core.model import (
    Acquire,
    CompletedOutcome,
    Conflict,
    Granted,
    Held,
    LeaseRecord,
    Outcome,
)
from leasekeeper._core.rules import decide
from leasekeeper._errors import LeaseError, ServiceUnavailable

__all__ = ["Cancellable", "LoopTimers", "Timers", "Waiting"]

#: Decide an acquire through the store (the service's one path for that).
Decide = Callable[[Acquire], Awaitable[Outcome]]


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Timers(Protocol):
    """Where waiting reads time and sets its timers (seconds, any epoch)."""

    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Cancellable: ...


class LoopTimers:
    """The running event loop's time and timers."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def call_at(self, when: float, callback: Callable[[], None]) -> Cancellable:
        return asyncio.get_running_loop().call_at(when, callback)


class _Waiter:
    """One waiting acquire."""

    __slots__ = ("answer", "command", "future", "poked", "timed_out")

    def __init__(self, command: Acquire, poked: bool) -> None:
        self.command = command
        #: Set when something may have changed: the head decides again.
        self.poked = poked
        self.timed_out = False
        #: The final answer, decided by another waiter (a completion, a store failure).
        self.answer: Outcome | LeaseError | None = None
        self.future: asyncio.Future[None] | None = None

    def wake(self) -> None:
        future = self.future
        if future is not None and not future.done():
            future.set_result(None)

    def time_out(self) -> None:
        self.timed_out = True
        self.wake()

    async def sleep(self) -> None:
        self.future = asyncio.get_running_loop().create_future()
        try:
            await self.future
        finally:
            self.future = None


class _Queue:
    """The waiters on one key, in arrival order, and what was last learned of the key."""

    __slots__ = ("local", "record", "store_ms", "timer", "timer_at", "waiters")

    def __init__(self, record: LeaseRecord, store_ms: int, local: float) -> None:
        self.waiters: deque[_Waiter] = deque()
        self.record = record
        self.store_ms = store_ms
        self.local = local
        self.timer: Cancellable | None = None
        self.timer_at = 0.0

    def saw(self, record: LeaseRecord, store_ms: int, local: float) -> None:
        self.record, self.store_ms, self.local = record, store_ms, local

    def poke_head(self) -> None:
        if self.waiters:
            head = self.waiters[0]
            head.poked = True
            head.wake()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Waiting:
    """Every waiting acquire at this instance, queued per key id.

    ``recheck_seconds``: with a store shared by several instances, how often a queue's
    head asks the store again although it heard of no change (None: never, for a store
    only this instance writes to)."""

    def __init__(self, timers: Timers | None = None, recheck_seconds: float | None = None) -> None:
        self.timers: Timers = timers or LoopTimers()
        self.recheck_seconds = recheck_seconds
        self._queues: dict[bytes, _Queue] = {}
        #: Keys whose first decision is in flight: [how many, changes heard meanwhile].
        self._watched: dict[bytes, list[int]] = {}
        self.stopping = False

    def __len__(self) -> int:
        """How many acquires are waiting."""
        return sum(len(queue.waiters) for queue in self._queues.values())

    def queued(self, key_id: bytes) -> bool:
        """Whether acquires are waiting for ``key_id`` here."""
        return key_id in self._queues

    def changed(self, key_id: bytes | None) -> None:
        """The key ``key_id`` was released or completed (None: any key may have been):
        its queue's head decides again."""
        if key_id is None:
            for each in self._queues.values():
                each.poke_head()
            for counts in self._watched.values():
                counts[1] += 1
            return
        if (queue := self._queues.get(key_id)) is not None:
            queue.poke_head()
        if (watched := self._watched.get(key_id)) is not None:
            watched[1] += 1

    def watch(self, key_id: bytes) -> int:
        """Before the first decision of an acquire that may wait: a mark for ``missed``.
        A change heard while that decision is in flight has no queue to wake yet."""
        counts = self._watched.setdefault(key_id, [0, 0])
        counts[0] += 1
        return counts[1]

    def missed(self, key_id: bytes, mark: int) -> bool:
        """After that decision: whether the key changed while it was in flight."""
        counts = self._watched[key_id]
        counts[0] -= 1
        if not counts[0]:
            del self._watched[key_id]
        return counts[1] != mark

    def stop(self) -> None:
        """Answer every waiter now (409 held, from what its queue last learned), and
        every acquire from now on without waiting."""
        self.stopping = True
        for queue in self._queues.values():
            for waiter in queue.waiters:
                waiter.wake()

    def start(self) -> None:
        self.stopping = False

    async def wait(
        self,
        command: Acquire,
        first: Held | None,
        seconds: float,
        decide_acquire: Decide,
        *,
        stale: bool = False,
    ) -> Outcome:
        """Wait up to ``seconds`` for the key of ``command`` (decided ``first``, or not
        decided yet when its key has waiters here) to be decided otherwise than held.
        ``stale``: the key changed while ``first`` was being decided (``missed``)."""
        timers = self.timers
        key_id = command.key_id
        queue = self._queues.get(key_id)
        if queue is None:
            if first is None:  # pragma: no cover - the service decides first then
                raise ValueError("a key without waiters is decided before it is waited for")
            queue = self._queues[key_id] = _Queue(first.record, first.now_ms, timers.now())
        elif first is not None:
            queue.saw(first.record, first.now_ms, timers.now())
        else:
            # Bound to another fingerprint for the lifecycle: no wait would change that.
            known = self._estimate(queue, command)
            if isinstance(known, Conflict):
                return known
        waiter = _Waiter(command, poked=first is None or stale)
        queue.waiters.append(waiter)
        deadline = timers.call_at(timers.now() + seconds, waiter.time_out)
        try:
            while True:
                answer = waiter.answer
                if isinstance(answer, LeaseError):
                    raise answer
                if answer is not None:
                    return answer
                if self.stopping:
                    return self._estimate(queue, command)
                head = queue.waiters[0] is waiter
                if waiter.timed_out:
                    if head:  # nobody is ahead of it: the store's word on the key
                        return await self._head_decides(queue, waiter, decide_acquire)
                    return self._estimate(queue, command)
                if head and waiter.poked:
                    waiter.poked = False
                    outcome = await self._head_decides(queue, waiter, decide_acquire)
                    if not isinstance(outcome, Held):
                        return outcome
                    continue
                if head:
                    self._arm(queue)
                await waiter.sleep()
        finally:
            deadline.cancel()
            self._leave(key_id, queue, waiter)

    async def _head_decides(
        self, queue: _Queue, waiter: _Waiter, decide_acquire: Decide
    ) -> Outcome:
        try:
            outcome = await decide_acquire(waiter.command)
        except ServiceUnavailable as error:
            for other in queue.waiters:
                if other is not waiter and other.answer is None:
                    other.answer = ServiceUnavailable(error.error)
                    other.wake()
            raise
        if isinstance(outcome, Held | Granted):
            queue.saw(outcome.record, outcome.now_ms, self.timers.now())
        elif isinstance(outcome, CompletedOutcome):
            record = outcome.record
            for other in queue.waiters:
                if other is not waiter and other.answer is None:
                    # The same rules on the completed record: completed for the same
                    # fingerprint, conflict for another. Nothing is written.
                    other.answer = decide(record, other.command, record.updated_ms).outcome
                    other.wake()
        return outcome

    def _estimate(self, queue: _Queue, command: Acquire) -> Outcome:
        """The rules' decision on what the queue last learned, at the store time
        estimated now; a key that looks free then is being handed to the head: held."""
        elapsed_ms = max(0, round((self.timers.now() - queue.local) * 1000))
        now_ms = queue.store_ms + elapsed_ms
        outcome = decide(queue.record, command, now_ms).outcome
        if isinstance(outcome, Granted):
            return Held(queue.record, now_ms)
        return outcome

    def _arm(self, queue: _Queue) -> None:
        """Wake the head when the lease it waits on runs out, or at the next re-check."""
        timers = self.timers
        expiry_ms = queue.record.lease_expires_ms - queue.store_ms
        when = queue.local + max(0, expiry_ms) / 1000
        if self.recheck_seconds is not None:
            when = min(when, timers.now() + self.recheck_seconds)
        if queue.timer is not None:
            if queue.timer_at == when:
                return
            queue.timer.cancel()
        queue.timer_at = when
        queue.timer = timers.call_at(when, queue.poke_head)

    def _leave(self, key_id: bytes, queue: _Queue, waiter: _Waiter) -> None:
        waiters = queue.waiters
        was_head = bool(waiters) and waiters[0] is waiter
        if was_head:
            waiters.popleft()
        else:
            waiters.remove(waiter)  # a timeout or a disconnect: O(n), rare
        if not waiters:
            queue.disarm()
            if self._queues.get(key_id) is queue:
                del self._queues[key_id]
        elif was_head:
            queue.disarm()
            queue.poke_head()  # the next in line decides now
