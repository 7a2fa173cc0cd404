"""The data of a lease: stored records, commands, outcomes and decisions.

Immutable and free of I/O; times are integer Unix milliseconds, digests raw ``bytes``.
Frozen ``msgspec.Struct`` classes (a speed trick: docs/performance.md) compare like
dataclasses; they can hold no reference cycle, hence ``gc=False``.
"""

from __future__ import annotations

import enum

import msgspec

__all__ = [
    "Acquire",
    "Command",
    "Complete",
    "CompletedOutcome",
    "Conflict",
    "Decision",
    "Granted",
    "Held",
    "LeaseRecord",
    "LeaseState",
    "Lost",
    "LostReason",
    "Outcome",
    "Release",
    "Released",
    "Renew",
    "Renewed",
]


class LeaseState(enum.Enum):
    """Where a key stands at one instant. Derived from a record and ``now``; never stored."""

    #: No record, or its lifecycle is over: the key is as if never seen.
    ABSENT = "absent"
    #: An owner holds a live lease: ``now < lease_expires_ms``.
    HELD = "held"
    #: An owner had the lease and it ran out; nobody has taken it since.
    EXPIRED = "expired"
    #: The owner gave the lease up; free at once, the fingerprint binding stays.
    RELEASED = "released"
    #: A result is stored; nobody owns the key again until the lifecycle ends.
    COMPLETED = "completed"


class LeaseRecord(msgspec.Struct, frozen=True, gc=False):
    """What a store keeps for one key: digests and timing state, never a raw secret."""

    #: Keyed digest of (namespace, key); the primary key.
    key_id: bytes
    #: Keyed digest of the fingerprint the lifecycle is bound to; None = bound to "none given".
    fingerprint: bytes | None
    #: End of the lifecycle; ``now >= absolute_expires_ms`` means the key is as if never seen.
    absolute_expires_ms: int
    #: Fencing token of the current (or last) owner.
    fencing_token: int
    #: SHA-256 of the current owner token; None once released or completed.
    owner: bytes | None
    #: When the current owner's lease runs out (never after ``absolute_expires_ms``).
    lease_expires_ms: int
    #: When the result was stored; None until completed.
    completed_ms: int | None
    #: The redacted result as compact JSON text; None until completed.
    result: str | None
    #: The latest decision time that changed or observed this record: a decision
    #: never runs at an earlier time, so a clock stepping back cannot undo an expiry.
    updated_ms: int


class Acquire(msgspec.Struct, frozen=True, gc=False):
    """Take the lease for a new owner whose token digest is ``owner``."""

    key_id: bytes
    fingerprint: bytes | None
    ttl_ms: int
    owner: bytes
    lifecycle_ms: int


class Renew(msgspec.Struct, frozen=True, gc=False):
    """Move the live owner's lease expiry to ``now + ttl_ms`` (capped by the lifecycle)."""

    key_id: bytes
    owner: bytes
    ttl_ms: int


class Release(msgspec.Struct, frozen=True, gc=False):
    """End the live owner's lease now."""

    key_id: bytes
    owner: bytes


class Complete(msgspec.Struct, frozen=True, gc=False):
    """Store ``result`` (redacted compact JSON) and end ownership for the lifecycle."""

    key_id: bytes
    owner: bytes
    result: str


Command = Acquire | Renew | Release | Complete


class Granted(msgspec.Struct, frozen=True, gc=False):
    """A new owner holds the lease (HTTP 201)."""

    record: LeaseRecord
    now_ms: int


class CompletedOutcome(msgspec.Struct, frozen=True, gc=False):
    """The key's lifecycle has a stored result (HTTP 200)."""

    record: LeaseRecord


class Held(msgspec.Struct, frozen=True, gc=False):
    """Another owner holds a live lease (HTTP 409 held)."""

    record: LeaseRecord
    now_ms: int


class Conflict(msgspec.Struct, frozen=True, gc=False):
    """The lifecycle is bound to another fingerprint (HTTP 409 conflict)."""

    record: LeaseRecord


class Renewed(msgspec.Struct, frozen=True, gc=False):
    """The live owner's lease has a new expiry (HTTP 200)."""

    record: LeaseRecord
    now_ms: int


class Released(msgspec.Struct, frozen=True, gc=False):
    """The live owner gave the lease up (HTTP 200)."""

    record: LeaseRecord


class LostReason(enum.Enum):
    """Why a renew, release or complete was refused; chosen by the key's state."""

    NO_LEASE = "There is no lease on this key (never acquired, or its lifecycle is over)"
    EXPIRED = "The lease expired; acquire the key again before continuing"
    RELEASED = "The lease was released; acquire the key again before continuing"
    COMPLETED = "The work on this key was completed; acquire it to read the result"
    NOT_OWNER = "The owner token does not match the current owner of this lease"


class Lost(msgspec.Struct, frozen=True, gc=False):
    """The caller is not the live owner (HTTP 409 lost)."""

    reason: LostReason


Outcome = Granted | CompletedOutcome | Held | Conflict | Renewed | Released | Lost


class Decision(msgspec.Struct, frozen=True, gc=False):
    """What the rules decided: an outcome and the record to store, if any.

    When ``new_owner`` is true the record's ``fencing_token`` is a placeholder:
    the store must draw the next value of its store-wide counter and apply
    ``with_fence`` inside the same transaction, before writing.
    """

    outcome: Outcome
    #: The record to store in place of the old one; None leaves the store as it was.
    write: LeaseRecord | None = None
    new_owner: bool = False

    def with_fence(self, fencing_token: int) -> Decision:
        """This decision with the new owner's fencing token filled in."""
        if not self.new_owner or self.write is None or not isinstance(self.outcome, Granted):
            raise ValueError("only a decision that grants a new owner takes a fencing token")
        record = msgspec.structs.replace(self.write, fencing_token=fencing_token)
        return Decision(Granted(record, self.outcome.now_ms), record, new_owner=False)
