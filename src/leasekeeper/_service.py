"""``LeaseService``: the one object that HTTP, MCP and the CLI call.

It turns a validated request body into a command for the pure rules (digests
instead of secrets, a fresh owner token), hands the command to the store, and
turns the decision into the JSON body the spec defines. Refusals are raised as
the exceptions of ``leasekeeper._errors``; each carries its own body.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import msgspec
import orjson

from leasekeeper import _replies as replies
from leasekeeper._core import secrets, times
from leasekeeper._core.model import (
    Acquire,
    Command,
    Complete,
    CompletedOutcome,
    Conflict,
    Granted,
    Held,
    LeaseRecord,
    Lost,
    Outcome,
    Release,
    Released,
    Renew,
    Renewed,
)
from leasekeeper._core.validation import encode_result
from leasekeeper._errors import (
    FingerprintConflict,
    InternalError,
    LeaseError,
    LeaseHeld,
    LeaseLost,
)
from leasekeeper._schemas import (
    DEFAULT_TTL_SECONDS,
    AcquireBody,
    CompleteBody,
    NamespaceBody,
    ReleaseBody,
    RenewBody,
    parse_body,
)
from leasekeeper._waiting import Timers, Waiting
from leasekeeper.store import MAX_RAISED_FENCE, ChangeFeed, LiveCounter, Purged, Store

__all__ = ["OPERATIONS", "LeaseService", "Reply", "ServiceObserver", "clean_up_every"]

log = logging.getLogger("leasekeeper.service")


class Reply(msgspec.Struct, frozen=True):
    """A successful outcome: the JSON body, and whether a new owner was created (201).

    A frozen Struct, as the core's types are (``leasekeeper._core.model`` says why)."""

    body: replies.ReplyBody
    created: bool = False
    #: The stored result's JSON text when the body carries one (embedded as a Fragment).
    result_text: str | None = None

    def __repr__(self) -> str:
        # The body holds an owner token or a namespace: its status word is all a log
        # line or a traceback gets.
        return f"Reply(status={self.body.get('status')!r}, created={self.created!r})"

    def json_bytes(self) -> bytes:
        """The body as UTF-8 JSON; a stored result is embedded exactly as stored."""
        return orjson.dumps(self.body)

    def plain(self) -> dict[str, Any]:
        """The body with the stored result parsed into Python values (for MCP)."""
        if self.result_text is None:
            return dict(self.body)
        return {**self.body, "result": json.loads(self.result_text)}


class ServiceObserver(Protocol):
    """Told about every store call and decision (``leasekeeper._metrics.Metrics`` is one)."""

    def store_call(self, operation: str, seconds: float, failed: bool) -> None:
        """A store call took ``seconds``; ``failed`` when it raised."""
        ...

    def decided(self, operation: str, outcome: Outcome, lifecycle_ms: int) -> None:
        """The rules decided ``outcome`` for ``operation``."""
        ...


class LeaseService:
    """Leases over one store.

    ``cleanup_batch`` and ``cleanup_pause`` pace ``cleanup``; ``sleep`` and
    ``monotonic`` are its timing (tests pass fakes). ``random_bytes`` supplies the
    randomness for namespaces and owner tokens (by default ``os.urandom``, the OS's
    CSPRNG; tests may inject a deterministic source); ``lifecycle_seconds`` is the
    length of a key's lifecycle (``LEASEKEEPER_LIFECYCLE_SECONDS``). ``timers`` are
    where acquires that wait (``wait_seconds``) read time and set timers (by default
    the event loop's; tests pass timers that follow a fake clock).
    """

    def __init__(
        self,
        store: Store,
        *,
        lifecycle_seconds: int = 86_400,
        cleanup_batch: int = 200,
        cleanup_pause: float = 1.0,
        random_bytes: Callable[[int], bytes] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        monotonic: Callable[[], float] = time.perf_counter,
        timers: Timers | None = None,
    ) -> None:
        self.store = store
        self._lifecycle_ms = lifecycle_seconds * 1000
        self._cleanup_batch = cleanup_batch
        self._cleanup_pause = cleanup_pause
        self._sleep = sleep
        self._monotonic = monotonic
        self._random = random_bytes or os.urandom
        self._observers: list[ServiceObserver] = []
        feed = store if isinstance(store, ChangeFeed) else None
        self.waiting = Waiting(timers, None if feed is None else feed.recheck_seconds)
        if feed is not None:
            feed.on_change(self.waiting.changed)
        #: Releases of leases granted to waiters whose client went away meanwhile.
        self._orphans: set[asyncio.Task[None]] = set()

    @property
    def lifecycle_seconds(self) -> int:
        """The length of a key's lifecycle (what the MCP tools' texts quote)."""
        return self._lifecycle_ms // 1000

    def add_observer(self, observer: ServiceObserver) -> None:
        """Report every store call and decision to ``observer`` (metrics)."""
        self._observers.append(observer)

    async def start(self) -> None:
        """Open the store (idempotent)."""
        await self.store.open()
        self.waiting.start()

    def stop_waiting(self) -> None:
        """Answer every waiting acquire now (409 held), and every acquire from now on
        without waiting: the server is stopping (idempotent)."""
        self.waiting.stop()

    async def stop(self) -> None:
        """Answer the waiting acquires, then close the store (idempotent)."""
        self.waiting.stop()
        if self._orphans:
            await asyncio.wait(self._orphans)
        await self.store.close()

    async def ready(self) -> None:
        """Raise ``ServiceUnavailable`` unless the store answers."""
        await self._timed("ping", self.store.ping())

    @property
    def counts_live(self) -> bool:
        """Whether the store can count the leases held right now (``count_live``)."""
        return isinstance(self.store, LiveCounter)

    async def count_live(self) -> int | None:
        """Leases held right now, by the store's count; None when the store cannot count."""
        if not isinstance(self.store, LiveCounter):
            return None
        count: int = await self._timed("count_live", self.store.count_live())
        return count

    # -- operations ------------------------------------------------------------------------

    async def create_namespace(self, body: NamespaceBody | None = None) -> Reply:
        """Mint a namespace. Nothing is stored: the namespace is its own proof."""
        namespace = secrets.format_namespace(self._random(secrets.SECRET_BYTES))
        return Reply({"ok": True, "namespace": namespace, "entropy_bits": 256}, created=True)

    async def acquire(self, body: AcquireBody) -> Reply:
        """Take the lease, or learn that it is held, completed or bound elsewhere."""
        ns = body.namespace_secret()
        key_id = secrets.key_id(ns, body.key)
        fingerprint = (
            None
            if body.fingerprint is None
            else secrets.fingerprint_digest(ns, body.key, key_id, body.fingerprint)
        )
        token = secrets.format_owner_token(self._random(secrets.SECRET_BYTES))
        ttl = DEFAULT_TTL_SECONDS if body.ttl_seconds is None else body.ttl_seconds
        command = Acquire(
            key_id, fingerprint, ttl * 1000, secrets.owner_digest(token), self._lifecycle_ms
        )
        wait = body.wait_seconds or 0
        waiting = self.waiting
        if not wait or waiting.stopping:
            outcome = await self._apply("acquire", command)
        elif waiting.queued(key_id):  # behind the waiters already there (_waiting says why)
            outcome = await waiting.wait(command, None, wait, self._acquire_for_waiter)
        else:
            mark = waiting.watch(key_id)
            try:
                outcome = await self._acquire_for_waiter(command)
            finally:
                stale = waiting.missed(key_id, mark)
            if isinstance(outcome, Held):
                outcome = await waiting.wait(
                    command, outcome, wait, self._acquire_for_waiter, stale=stale
                )
        if isinstance(outcome, Granted):
            record, now = outcome.record, outcome.now_ms
            return Reply(
                {
                    "ok": True,
                    "status": "held",
                    "owner_token": token,
                    **_lease_times(record, now),
                },
                created=True,
            )
        if isinstance(outcome, CompletedOutcome):
            return _completed_reply(outcome.record)
        if isinstance(outcome, Held):
            record = outcome.record
            raise LeaseHeld(
                retry_after_seconds=times.retry_after_seconds(
                    record.lease_expires_ms, outcome.now_ms
                ),
                fencing_token=record.fencing_token,
                lease_expires_at=times.iso(record.lease_expires_ms),
                absolute_expires_at=times.iso(record.absolute_expires_ms),
            )
        if isinstance(outcome, Conflict):
            raise FingerprintConflict(
                absolute_expires_at=times.iso(outcome.record.absolute_expires_ms)
            )
        raise _unexpected(outcome)

    async def renew(self, body: RenewBody) -> Reply:
        """Move the live owner's expiry to ``min(now + ttl, absolute_expires_at)``."""
        ttl = DEFAULT_TTL_SECONDS if body.ttl_seconds is None else body.ttl_seconds
        command = Renew(self._key_id(body), secrets.owner_digest(body.owner_token), ttl * 1000)
        outcome = await self._owner_step("renew", command)
        if not isinstance(outcome, Renewed):
            raise _unexpected(outcome)
        return Reply({"ok": True, "status": "held", **_lease_times(outcome.record, outcome.now_ms)})

    async def release(self, body: ReleaseBody) -> Reply:
        """End the live owner's lease now; the key can be acquired at once."""
        command = Release(self._key_id(body), secrets.owner_digest(body.owner_token))
        outcome = await self._owner_step("release", command)
        if not isinstance(outcome, Released):
            raise _unexpected(outcome)
        self.waiting.changed(command.key_id)
        return Reply(
            {"ok": True, "status": "released", "fencing_token": outcome.record.fencing_token}
        )

    async def complete(self, body: CompleteBody) -> Reply:
        """Store the (size-checked, redacted) result and end ownership for the lifecycle."""
        result = encode_result(body.result)
        command = Complete(self._key_id(body), secrets.owner_digest(body.owner_token), result)
        outcome = await self._owner_step("complete", command)
        if not isinstance(outcome, CompletedOutcome):
            raise _unexpected(outcome)
        self.waiting.changed(command.key_id)
        return _completed_reply(outcome.record)

    async def cleanup(self) -> int:
        """Delete every record whose lifecycle is over, in batches; return how many.

        Each batch is one step of the store's walk (``Store.purge``): at most
        ``cleanup_batch`` records deleted, or on SQLite looked at. After each batch but
        the last it pauses ``cleanup_pause`` times as long as the batch took, leaving the
        store to requests: with the default 1.0, a cleanup of a million records takes
        about twice as long as flat out, and requests meanwhile wait behind at most one
        small batch at a time.
        """
        total = 0
        resume: bytes | None = None
        while True:
            started = self._monotonic()
            step: Purged = await self._timed("purge", self.store.purge(self._cleanup_batch, resume))
            total += step.deleted
            if step.resume is None:
                return total
            resume = step.resume
            await self._sleep(self._cleanup_pause * max(0.0, self._monotonic() - started))

    async def raise_fence(self, at_least: int) -> int:
        """Raise the store's fencing counter to ``at_least`` unless it is higher; return it.

        Every token granted afterwards is above the returned value. For operators
        (``leasekeeper fence --raise-to``): after a backup is restored, or records move
        to another store, tokens issued meanwhile are above what the store remembers,
        and a new owner could be given one a stale owner still holds. ``at_least`` is
        from 0 to ``MAX_RAISED_FENCE`` (2**62), so that the counter can never run out
        of tokens to grant; ``raise_fence(0)`` reads the counter.
        """
        if not 0 <= at_least <= MAX_RAISED_FENCE:
            raise ValueError(f"at_least must be from 0 to {MAX_RAISED_FENCE}")
        counter: int = await self._timed("raise_fence", self.store.raise_fence(at_least))
        return counter

    async def handle(self, operation: str, data: Mapping[str, Any]) -> Reply:
        """Validate ``data`` for ``operation`` (a key of ``OPERATIONS``) and run it."""
        model, method = OPERATIONS[operation]
        body = parse_body(model, dict(data))
        return await method(self, body)

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _key_id(body: RenewBody | ReleaseBody | CompleteBody) -> bytes:
        return secrets.key_id(body.namespace_secret(), body.key)

    async def _acquire_for_waiter(self, command: Acquire) -> Outcome:
        """Decide ``command`` for an acquire that may wait. Cancelled meanwhile (its
        client went away), the decision still completes, and a lease it granted is
        released at once: nobody holds its token, and the key is free for the next."""
        deciding = asyncio.ensure_future(self._apply("acquire", command))
        try:
            return await asyncio.shield(deciding)
        except asyncio.CancelledError:
            deciding.add_done_callback(functools.partial(self._release_orphan, command))
            raise

    def _release_orphan(self, command: Acquire, deciding: asyncio.Future[Outcome]) -> None:
        if deciding.cancelled() or deciding.exception() is not None:
            return
        if isinstance(deciding.result(), Granted):
            task = asyncio.ensure_future(self._release_unsent(command.key_id, command.owner))
            self._orphans.add(task)
            task.add_done_callback(self._orphans.discard)

    async def _release_unsent(self, key_id: bytes, owner: bytes) -> None:
        """Release a lease granted to an acquire whose answer was never sent."""
        try:
            await self._apply("release", Release(key_id, owner))
        except LeaseError as error:  # it expires by its TTL then
            log.warning("releasing a lease whose client went away failed: %s", error.error)
        self.waiting.changed(key_id)

    async def release_unsent(self, body: AcquireBody, reply: Reply) -> None:
        """Release the lease of ``reply`` (to ``body``), which could not be sent: its
        client went away while it was being granted (an adapter's call)."""
        token = reply.body.get("owner_token")
        if reply.created and isinstance(token, str):
            ns = body.namespace_secret()
            await self._release_unsent(secrets.key_id(ns, body.key), secrets.owner_digest(token))

    async def _owner_step(self, operation: str, command: Command) -> object:
        outcome = await self._apply(operation, command)
        if isinstance(outcome, Lost):
            raise LeaseLost(outcome.reason.value)
        return outcome

    async def _apply(self, operation: str, command: Command) -> Outcome:
        outcome: Outcome = (await self._timed(operation, self.store.apply(command))).outcome
        for observer in self._observers:
            observer.decided(operation, outcome, self._lifecycle_ms)
        return outcome

    async def _timed(self, operation: str, call: Awaitable[Any]) -> Any:
        """Await a store call, reporting its latency (and failure) to the observers."""
        started = time.perf_counter()
        failed = True
        try:
            result = await call
            failed = False
            return result
        finally:
            seconds = time.perf_counter() - started
            for observer in self._observers:
                observer.store_call(operation, seconds, failed)


async def clean_up_every(
    service: LeaseService,
    seconds: float,
    *,
    sleep: Callable[[float], Awaitable[None]],
    ran: Callable[[int | None, float], None] | None = None,
) -> None:
    """Run ``service.cleanup()`` for ever: every ``seconds``, the first time at a random
    point of the first interval (both ``serve`` and ``leasekeeper mcp``).

    The random start spreads out instances started together, and lets a server restarted
    more often than the interval (every deploy), or a ``leasekeeper mcp`` that a desktop
    client starts for each session, still clean up. Each pass is logged (a failed one at
    WARNING, and the loop goes on), then ``ran(deleted, seconds_taken)`` is called,
    ``deleted`` being None when the pass failed.
    """
    pause = seconds * random.random()  # no secret
    while True:
        await sleep(pause)
        pause = seconds
        started = time.perf_counter()
        deleted: int | None = None
        try:
            deleted = await service.cleanup()
        except LeaseError as error:
            log.warning("cleanup failed: %s", error.error)
        else:
            log.info("cleanup deleted %d records whose lifecycle was over", deleted)
        if ran is not None:
            ran(deleted, time.perf_counter() - started)


def _lease_times(record: LeaseRecord, now_ms: int) -> replies.LeaseTimes:
    return {
        "ttl_seconds": times.ttl_seconds(record.lease_expires_ms, now_ms),
        "fencing_token": record.fencing_token,
        "lease_expires_at_timestamp": times.floor_seconds(record.lease_expires_ms),
        "lease_expires_at": times.iso(record.lease_expires_ms),
        "absolute_expires_at_timestamp": times.floor_seconds(record.absolute_expires_ms),
        "absolute_expires_at": times.iso(record.absolute_expires_ms),
    }


def _completed_reply(record: LeaseRecord) -> Reply:
    if record.completed_ms is None or record.result is None:  # pragma: no cover - by the rules
        raise InternalError()
    body: replies.Completed = {
        "ok": True,
        "status": "completed",
        "completed_at": times.iso(record.completed_ms),
        "result": orjson.Fragment(record.result),
        "fencing_token": record.fencing_token,
        "absolute_expires_at": times.iso(record.absolute_expires_ms),
    }
    return Reply(body, result_text=record.result)


def _unexpected(outcome: object) -> InternalError:
    log.error("unexpected outcome %s", type(outcome).__name__)
    return InternalError()


_Method = Callable[[LeaseService, Any], Awaitable[Reply]]

#: Operation name -> (request model, service method); the adapters' routing table.
OPERATIONS: dict[str, tuple[type[Any], _Method]] = {
    "namespace": (NamespaceBody, LeaseService.create_namespace),
    "acquire": (AcquireBody, LeaseService.acquire),
    "renew": (RenewBody, LeaseService.renew),
    "release": (ReleaseBody, LeaseService.release),
    "complete": (CompleteBody, LeaseService.complete),
}
