"""The store interface (``Store``): a few atomic primitives and no lease rules.

Failures to reach or write a store raise ``ServiceUnavailable``; nothing else escapes.
The rules live in ``leasekeeper._core.rules``: every store decides through
``decide_with_fence`` (a batch through ``decide_in_turn``), so no two can disagree.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from leasekeeper._core.model import Command, Decision, LeaseRecord
from leasekeeper._core.rules import decide
from leasekeeper._errors import InternalError, LeaseError, ServiceUnavailable

__all__ = [
    "MAX_FENCING_TOKEN",
    "MAX_RAISED_FENCE",
    "ChangeFeed",
    "Durable",
    "LiveCounter",
    "Purged",
    "Refusals",
    "Store",
    "Throttled",
    "decide_in_turn",
    "decide_with_fence",
    "not_ours",
]

log = logging.getLogger("leasekeeper.store")

#: Fencing tokens are positive integers below 2**63.
MAX_FENCING_TOKEN = 2**63 - 1
#: The highest an operator may raise the fencing counter to: far above any real use,
#: and far enough below ``MAX_FENCING_TOKEN`` that the counter never runs out.
MAX_RAISED_FENCE = 2**62


class Purged(NamedTuple):
    """One step of a purge: how many records it deleted, and where the next step starts."""

    deleted: int
    #: Pass as ``after`` to the next ``purge``; ``None``: the walk is over. Opaque.
    resume: bytes | None


class Store(Protocol):
    """Where lease records live: one ``LeaseRecord`` per key id, and one store-wide
    fencing counter."""

    async def open(self) -> None:
        """Connect, and create or migrate the schema. Idempotent."""
        ...

    async def close(self) -> None:
        """Finish pending work and release every resource. Idempotent."""
        ...

    async def apply(self, command: Command) -> Decision:
        """As one transaction: read the record of ``command.key_id``, decide on it with
        ``decide_with_fence`` at the store's ``now``, write the decided record, commit,
        and only then return the decision. Two ``apply`` calls on one key never
        interleave; a returned decision is durable."""
        ...

    async def purge(self, limit: int, after: bytes | None = None) -> Purged:
        """One bounded step of a walk deleting records whose lifecycle is over: at most
        ``limit`` (SQLite looks at no more than ``limit`` past ``after``). Pass ``resume``
        as the next ``after`` until it is ``None``. Never lowers the counter."""
        ...

    async def ping(self) -> None:
        """Succeed when the store can serve requests (``/readyz``): reachable, and no
        recent write refused for want of room or resources (``Refusals``)."""
        ...

    async def raise_fence(self, at_least: int) -> int:
        """As one durable transaction: raise the fencing counter to at least ``at_least``
        and return it; every later token, on every instance, is above it."""
        ...


@runtime_checkable
class LiveCounter(Protocol):
    """A store that can count the leases held now (for the live leases gauge)."""

    async def count_live(self) -> int:
        """Leases held at the store's ``now``: may be a scan, must not delay ``apply``,
        and is read every few seconds at most."""
        ...


@runtime_checkable
class ChangeFeed(Protocol):
    """A store shared by several service instances that tells each of them about the
    releases and completions committed at any of them (waiting acquires wake on them).
    A store only one instance writes to needs none: that instance knows its own."""

    #: How often a waiting acquire asks the store again although it heard of no
    #: change: the most a missed notification delays it.
    recheck_seconds: float

    def on_change(self, callback: Callable[[bytes | None], None]) -> None:
        """Call ``callback(key_id)``, on the event loop that opened the store, after a
        release or completion of ``key_id`` committed at any instance (this one too), and
        ``callback(None)`` when some may have been missed (the feed reconnected). Set
        before ``open``."""
        ...


@runtime_checkable
class Durable(Protocol):
    """A store whose records outlive the process: what the operator commands take."""

    @property
    def where(self) -> str:
        """Where the store is, after "no leasekeeper store": "at PATH", say."""
        ...

    @property
    def described(self) -> str:
        """The store for the line a server logs at every start: "SQLite file PATH", say;
        never a password or a user name."""
        ...

    async def exists(self) -> bool:
        """Whether leasekeeper's tables are there already, read without creating anything."""
        ...

    async def damage(self) -> str | None:
        """What a check of the whole store finds wrong (for ``fence``, after a restore),
        or None."""
        ...


def not_ours(
    table: str, found: Sequence[Sequence[object]], wanted: Sequence[Sequence[object]]
) -> str | None:
    """Why ``table`` (columns ``found``, each its name then what the store compares) is
    not the one leasekeeper makes (``wanted``), or None."""
    if [tuple(column) for column in found] == [tuple(column) for column in wanted]:
        return None
    names = [column[0] for column in found]
    ours = [column[0] for column in wanted]
    missing = [str(name) for name in ours if name not in names]
    extra = [str(name) for name in names if name not in ours]
    if missing:
        why = f"lacks the column{'s' if len(missing) > 1 else ''} " + ", ".join(missing)
    elif extra:
        why = "has columns leasekeeper does not make: " + ", ".join(extra)
    else:
        why = "has columns of other types, constraints or order"
    return f"its table {table} is not leasekeeper's (it {why})"


def decide_with_fence(
    record: LeaseRecord | None, command: Command, now_ms: int, next_fence: Callable[[], int]
) -> Decision:
    """The rules' decision, with a token from ``next_fence`` (called inside the caller's
    transaction, only for a new owner; always higher than before)."""
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
    """Decide ``commands`` in turn, each on ``found`` as the ones before left it (a
    refused or failing one gets its error and changes nothing). Returns each outcome,
    and the last record of every changed key: what to write in the transaction that
    read ``found``."""
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


class Throttled:
    """Logs a line at most once every ``every_ms``, with a count of those skipped (a
    failing store must not flood the logs). Thread-safe."""

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
    """Whether the store lately refused a write for want of room or resources: ``check``
    (in ``ping``) raises ``ServiceUnavailable`` until ``hold_ms`` after the last one,
    even if writes succeed meanwhile (readiness must not flap on a full disk).
    Thread-safe."""

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
