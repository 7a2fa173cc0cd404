"""The lease rules: pure functions ``(record | None, command, now_ms) -> Decision``.

No I/O, no clock reads, no randomness; a store applies the ``Decision`` atomically.

A key's life, for one lifecycle::

    acquire ──► HELD ──renew──► HELD
                 │ │ └─ time passes ──► EXPIRED ──acquire──► HELD (higher fence)
                 │ └─ release ──► RELEASED ──acquire──► HELD (higher fence)
                 └─ complete ──► COMPLETED   (acquire returns the result)

    now >= absolute_expires_ms ──► ABSENT (a new lifecycle on the next acquire)

Time guard: a decision runs at ``max(now_ms, record.updated_ms)`` and persists the
time it saw, so a clock stepping back never revives an expiry.
"""

from __future__ import annotations

from msgspec.structs import replace

from leasekeeper._core.model import (
    Acquire,
    Command,
    Complete,
    CompletedOutcome,
    Conflict,
    Decision,
    Granted,
    Held,
    LeaseRecord,
    LeaseState,
    Lost,
    LostReason,
    Release,
    Released,
    Renew,
    Renewed,
)
from leasekeeper._core.secrets import digests_equal

__all__ = ["decide", "effective_now", "lifecycle_over", "state_at"]


def lifecycle_over(record: LeaseRecord, now_ms: int) -> bool:
    """True once the record's lifecycle has ended; such a record may be deleted."""
    return now_ms >= record.absolute_expires_ms


def effective_now(record: LeaseRecord | None, now_ms: int) -> int:
    """The time a decision on ``record`` runs at: never before its last decision."""
    if record is None or now_ms >= record.updated_ms:
        return now_ms
    return record.updated_ms


def state_at(record: LeaseRecord | None, now_ms: int) -> LeaseState:
    """The key's state at ``now_ms`` (already passed through ``effective_now``)."""
    if record is None or lifecycle_over(record, now_ms):
        return LeaseState.ABSENT
    if record.completed_ms is not None:
        return LeaseState.COMPLETED
    if record.owner is None:
        return LeaseState.RELEASED
    if now_ms < record.lease_expires_ms:
        return LeaseState.HELD
    return LeaseState.EXPIRED


def decide(record: LeaseRecord | None, command: Command, now_ms: int) -> Decision:
    """Decide ``command`` against the key's ``record`` at store time ``now_ms``."""
    now = effective_now(record, now_ms)
    state = state_at(record, now)
    if isinstance(command, Acquire):
        decision = _acquire(record, state, command, now)
    elif isinstance(command, Renew):
        decision = _renew(record, state, command, now)
    elif isinstance(command, Release):
        decision = _release(record, state, command, now)
    else:
        decision = _complete(record, state, command, now)
    if decision.write is None and record is not None and state in _OBSERVED_EXPIRY:
        # Persist that this expiry was seen, so a clock stepping back cannot undo it.
        decision = replace(decision, write=replace(record, updated_ms=now))
    return decision


_OBSERVED_EXPIRY = frozenset({LeaseState.EXPIRED, LeaseState.ABSENT})


def _lease_expiry(now_ms: int, ttl_ms: int, absolute_expires_ms: int) -> int:
    return min(now_ms + ttl_ms, absolute_expires_ms)


def _acquire(record: LeaseRecord | None, state: LeaseState, command: Acquire, now: int) -> Decision:
    # The spec's decision order: new lifecycle, fingerprint, completed, live lease, new owner.
    if record is None or state is LeaseState.ABSENT:
        absolute = now + command.lifecycle_ms
        fresh = LeaseRecord(
            key_id=command.key_id,
            fingerprint=command.fingerprint,
            absolute_expires_ms=absolute,
            fencing_token=0,
            owner=command.owner,
            lease_expires_ms=_lease_expiry(now, command.ttl_ms, absolute),
            completed_ms=None,
            result=None,
            updated_ms=now,
        )
        return Decision(Granted(fresh, now), fresh, new_owner=True)
    if not _same_fingerprint(record.fingerprint, command.fingerprint):
        return Decision(Conflict(record))
    if state is LeaseState.COMPLETED:
        return Decision(CompletedOutcome(record))
    if state is LeaseState.HELD:
        return Decision(Held(record, now))
    # RELEASED or EXPIRED: a new owner in the same lifecycle.
    taken = replace(
        record,
        owner=command.owner,
        lease_expires_ms=_lease_expiry(now, command.ttl_ms, record.absolute_expires_ms),
        updated_ms=now,
    )
    return Decision(Granted(taken, now), taken, new_owner=True)


def _same_fingerprint(bound: bytes | None, given: bytes | None) -> bool:
    if bound is None or given is None:
        return bound is given
    return digests_equal(bound, given)


def _lost_reason(record: LeaseRecord | None, state: LeaseState, owner: bytes) -> LostReason | None:
    """Why ``owner`` may not mutate the key now, or None when it is the live owner."""
    if record is None or state is LeaseState.ABSENT:
        return LostReason.NO_LEASE
    if state is LeaseState.COMPLETED:
        return LostReason.COMPLETED
    if state is LeaseState.RELEASED:
        return LostReason.RELEASED
    if state is LeaseState.EXPIRED:
        return LostReason.EXPIRED
    if record.owner is None or not digests_equal(record.owner, owner):
        return LostReason.NOT_OWNER
    return None


def _renew(record: LeaseRecord | None, state: LeaseState, command: Renew, now: int) -> Decision:
    reason = _lost_reason(record, state, command.owner)
    if reason is not None or record is None:
        return Decision(Lost(reason or LostReason.NO_LEASE))
    renewed = replace(
        record,
        lease_expires_ms=_lease_expiry(now, command.ttl_ms, record.absolute_expires_ms),
        updated_ms=now,
    )
    return Decision(Renewed(renewed, now), renewed)


def _release(record: LeaseRecord | None, state: LeaseState, command: Release, now: int) -> Decision:
    reason = _lost_reason(record, state, command.owner)
    if reason is not None or record is None:
        return Decision(Lost(reason or LostReason.NO_LEASE))
    released = replace(record, owner=None, lease_expires_ms=now, updated_ms=now)
    return Decision(Released(released), released)


def _complete(
    record: LeaseRecord | None, state: LeaseState, command: Complete, now: int
) -> Decision:
    reason = _lost_reason(record, state, command.owner)
    if reason is not None or record is None:
        return Decision(Lost(reason or LostReason.NO_LEASE))
    done = replace(
        record,
        owner=None,
        lease_expires_ms=now,
        completed_ms=now,
        result=command.result,
        updated_ms=now,
    )
    return Decision(CompletedOutcome(done), done)
