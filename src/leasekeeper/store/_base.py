"""The store interface: a few atomic primitives and no lease rules.

A store keeps one ``LeaseRecord`` per key id and one store-wide fencing counter,
and offers exactly this:

``apply(command)``
    Atomically, as one transaction: read the record for ``command.key_id``, run
    ``decide_with_fence`` on it at the store's ``now``, write the decided record,
    commit, and only then return the decision. Two ``apply`` calls on one key never
    interleave; a returned decision is durable.
``purge(limit, after)``
    Delete records whose lifecycle is over at the store's ``now``, one bounded
    step of a walk over the store: at most ``limit`` records are deleted, and a
    store that walks its records in key order (SQLite) looks at no more than
    ``limit`` of them, the ones past ``after``. Returns ``Purged(deleted,
    resume)``: pass ``resume`` as ``after`` to take the next step; it is ``None``
    once the walk has covered the store (``after=None`` starts a walk). Records
    written behind the walk wait for the next one. Deleting never lowers the
    fencing counter.
``ping()``
    Succeed when the store can serve requests (``/readyz``): it can be reached, and
    it has not refused a write for want of room or resources lately (``Refusals``).
``raise_fence(at_least)``
    Atomically, as one durable transaction: raise the fencing counter to
    ``at_least`` if it is lower, never lower it, and return the counter. Every
    token granted after it returns is above the returned value, on every instance
    sharing the store (``leasekeeper fence --raise-to``, after a restore or a move).

Optionally, a store may also be a ``LiveCounter``: ``count_live()`` returns how many
leases are held at the store's ``now`` (for the ``leasekeeper_live_leases`` gauge). It
may be slow (a scan), must not delay ``apply``, and is read every few seconds at most.

A store whose records outlive the process (SQLite, PostgreSQL) is also ``Durable``:
``exists()`` says, creating nothing, whether leasekeeper's tables are there already,
``damage()`` names what a check of the whole store finds wrong (or None), and
``where`` says where it is, for messages. The operator commands (``leasekeeper
cleanup``, ``fence``) take only these.

Failures to reach or write the store raise ``ServiceUnavailable``; nothing else
escapes. The rules themselves live in ``leasekeeper._core.rules``: every backend
calls ``decide_with_fence`` (a batch of commands through ``decide_in_turn``), so
no backend can disagree with another about them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from leasekeeper._core.model import Command, Decision, LeaseRecord
from leasekeeper._core.rules import decide
from leasekeeper._errors import InternalError, LeaseError, ServiceUnavailable

__all__ = [
    "MAX_FENCING_TOKEN",
    "MAX_RAISED_FENCE",
    "Deadlines",
    "Durable",
    "LiveCounter",
    "Purged",
    "Refusals",
    "Store",
    "Throttled",
    "decide_in_turn",
    "decide_with_fence",
    "settle",
]

log = logging.getLogger("leasekeeper.store")

#: Fencing tokens are positive integers below 2**63.
MAX_FENCING_TOKEN = 2**63 - 1
#: The highest an operator may raise the fencing counter to (``raise_fence``): far
#: above any store's real use, and far enough below ``MAX_FENCING_TOKEN`` that the
#: counter can never run out (2**62 grants more: 146,000 years at a million a second).
MAX_RAISED_FENCE = 2**62


class Purged(NamedTuple):
    """One step of a purge: how many records it deleted, and where the next step starts."""

    deleted: int
    #: Pass as ``after`` to the next ``purge``; ``None``: the walk is over. Opaque.
    resume: bytes | None


class Store(Protocol):
    """Where lease records live. See the module docstring for the contract."""

    async def open(self) -> None:
        """Connect, and create or migrate the schema. Idempotent."""
        ...

    async def close(self) -> None:
        """Finish pending work and release every resource. Idempotent."""
        ...

    async def apply(self, command: Command) -> Decision:
        """Decide ``command`` against its key's record atomically and durably."""
        ...

    async def purge(self, limit: int, after: bytes | None = None) -> Purged:
        """Take one bounded step of deleting records whose lifecycle is over."""
        ...

    async def ping(self) -> None:
        """Raise ``ServiceUnavailable`` unless the store can serve requests now."""
        ...

    async def raise_fence(self, at_least: int) -> int:
        """Raise the fencing counter to ``at_least`` unless it is higher; the counter."""
        ...


@runtime_checkable
class LiveCounter(Protocol):
    """A store that can count the leases held right now (optional; see the module docstring)."""

    async def count_live(self) -> int:
        """Leases whose owner holds them at the store's ``now``."""
        ...


@runtime_checkable
class Durable(Protocol):
    """A store whose records outlive the process (optional; see the module docstring)."""

    @property
    def where(self) -> str:
        """Where the store is, after "no leasekeeper store": "at PATH", say."""
        ...

    async def exists(self) -> bool:
        """Whether leasekeeper's tables are there already, read without creating anything."""
        ...

    async def damage(self) -> str | None:
        """What a check of the whole store finds wrong (for ``fence``, after a restore),
        or None."""
        ...


def decide_with_fence(
    record: LeaseRecord | None, command: Command, now_ms: int, next_fence: Callable[[], int]
) -> Decision:
    """The rules' decision, with a fencing token from ``next_fence`` when it grants a new owner.

    ``next_fence`` is called only for a new owner, inside the caller's transaction,
    and must return a value higher than any it returned before.
    """
    decision = decide(record, command, now_ms)
    if decision.new_owner:
        fence = next_fence()
        if not 0 < fence <= MAX_FENCING_TOKEN:
            raise OverflowError("the fencing counter is exhausted")
        decision = decision.with_fence(fence)
    return decision


def decide_in_turn(
    commands: Sequence[Command],
    found: Mapping[bytes, LeaseRecord],
    now_ms: Callable[[], int],
    next_fence: Callable[[], int],
) -> tuple[list[Decision | LeaseError], dict[bytes, LeaseRecord]]:
    """Decide a batch of ``commands`` as if each ran alone, one after another.

    ``found`` holds the stored records of their keys. Each command is decided on the
    records as the commands before it left them; a command the rules refuse, or that
    fails unexpectedly, gets its error in its place and changes nothing. Returns each
    command's decision (or error), and the last record decided for every changed key:
    what the store must write, inside the transaction that read ``found``.
    """
    records = dict(found)
    outcomes: list[Decision | LeaseError] = []
    writes: dict[bytes, LeaseRecord] = {}
    for command in commands:
        try:
            decision = decide_with_fence(records.get(command.key_id), command, now_ms(), next_fence)
        except LeaseError as exc:
            outcomes.append(exc)
            continue
        except Exception:
            log.exception("lease decision failed")
            outcomes.append(InternalError())
            continue
        w = decision.write
        if w is not None:
            records[w.key_id] = writes[w.key_id] = w
        outcomes.append(decision)
    return outcomes, writes


def settle(future: asyncio.Future[Any], outcome: Any) -> None:
    """Give ``future`` its outcome (raised when an exception), unless it is done already."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class Deadlines:
    """Answers ``ServiceUnavailable`` to each store call still waiting ``seconds`` after
    it began: one loop timer for all of a store's calls.

    What ``loop.call_later(seconds, ...)`` for each call and its ``cancel()`` after
    did, at a fraction of the cost (those were about 2 µs of every request). Every
    call waits the same ``seconds``, so deadlines come due in the order calls were
    made: the calls wait in that order, and the one timer is set for the oldest
    that is still unanswered. Answered calls leave the front of the queue as new
    ones arrive, so it holds no more than the calls of the last ``seconds``.
    """

    __slots__ = ("_loop", "_seconds", "_timer", "_waiting")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._waiting: collections.deque[tuple[float, asyncio.Future[Any]]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, future: asyncio.Future[Any]) -> None:
        """Expire ``future`` in ``seconds`` unless it is done by then (on its loop)."""
        loop = future.get_loop()
        waiting = self._waiting
        if loop is not self._loop:  # a first call, or the store reopened on another loop
            self._loop, self._timer = loop, None
            waiting.clear()
        while waiting and waiting[0][1].done():
            waiting.popleft()
        deadline = loop.time() + self._seconds
        waiting.append((deadline, future))
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        waiting = self._waiting
        while waiting:
            deadline, future = waiting[0]
            if not future.done():
                loop = future.get_loop()
                if deadline > loop.time():
                    self._timer = loop.call_at(deadline, self._expire)
                    return
                settle(future, ServiceUnavailable("The lease store did not answer in time"))
            waiting.popleft()


class Throttled:
    """A log line at most once every ``every_ms``, then with how many like it were not
    logged: when every batch fails (a full disk, a read-only or unreachable database),
    a line for each, hundreds a second, would flood the logs, often on that same disk.
    ``now_ms`` is any clock of milliseconds; safe to call from any thread."""

    def __init__(
        self,
        logger: logging.Logger,
        level: int,
        now_ms: Callable[[], int],
        every_ms: int = 1_000,
    ) -> None:
        self._logger = logger
        self._level = level
        self._now_ms = now_ms
        self._every_ms = every_ms
        self._next_ms: int | None = None
        self._quiet = 0
        self._lock = threading.Lock()

    def log(self, message: str, *args: object) -> None:
        now = self._now_ms()
        with self._lock:
            if self._next_ms is not None and now < self._next_ms:
                self._quiet += 1
                return
            quiet, self._quiet, self._next_ms = self._quiet, 0, now + self._every_ms
        if quiet:
            message, args = message + " (and %d more since the last such line)", (*args, quiet)
        self._logger.log(self._level, message, *args)


class Refusals:
    """Whether the store has lately refused writes for want of room or resources (a full
    disk, a failing device), for readiness: ``check`` (in ``ping``) raises
    ``ServiceUnavailable`` until ``hold_ms`` have passed since the last such refusal. A
    store that can still be read would otherwise look ready while its writes fail.

    A write that succeeds meanwhile does not end it: on a full disk, renewals that
    rewrite rows in place go on succeeding while every new key is refused, and readiness
    would flap with them. A server taken out of rotation for it gets requests again
    ``hold_ms`` after the last refusal, and so finds out whether there is room. Failures
    of one key or one request (a lock, a timeout) are not for this: they would take a
    whole server out for one row. ``now_ms`` is any clock of milliseconds; safe to call
    from any thread."""

    def __init__(self, now_ms: Callable[[], int], hold_ms: int = 10_000) -> None:
        self._now_ms = now_ms
        self._hold_ms = hold_ms
        #: When the latest refusal came and what it was (one tuple, replaced whole).
        self._last: tuple[int, str] | None = None

    def refused(self, reason: str) -> None:
        """A write was refused; ``reason`` names the error's kind, never its data."""
        self._last = (self._now_ms(), reason)

    def check(self) -> None:
        last = self._last
        if last is not None and self._now_ms() - last[0] < self._hold_ms:
            raise ServiceUnavailable(
                f"The lease store is refusing writes ({last[1]}); ready again "
                f"{self._hold_ms // 1000} s after the last refusal"
            )
