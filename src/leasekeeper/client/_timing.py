"""Pure timing decisions of the client: how long to wait for a held key, when to renew.

No clock is read here: callers pass ``now`` (their monotonic seconds) and a random
number, so tests walk through every schedule without sleeping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

from leasekeeper._core.validation import MAX_WAIT_SECONDS

__all__ = [
    "FIRST_POLL_SECONDS",
    "MAX_HOLD_OFF_SECONDS",
    "MAX_POLL_SECONDS",
    "MIN_RETRY_SECONDS",
    "RenewalPlan",
    "acquire_delay",
    "as_seconds",
    "server_wait",
]

#: The first wait for a held key; a lease is often released or completed early.
FIRST_POLL_SECONDS = 0.25
#: The longest single wait, so an early release or completion is seen soon enough.
MAX_POLL_SECONDS = 30.0
#: The longest ``Retry-After`` a 429 or 503 is obeyed for (a proxy's may say a year).
MAX_HOLD_OFF_SECONDS = 300.0
#: The shortest pause between two renewal attempts after a failure.
MIN_RETRY_SECONDS = 0.1
#: Jitter added to a wait, as a fraction of it, so waiting workers spread out.
JITTER = 0.2


def as_seconds(wait: float | timedelta | None) -> float:
    """``wait`` in seconds: None is 0 (do not wait), ``math.inf`` waits for ever."""
    if wait is None:
        return 0.0
    seconds = wait.total_seconds() if isinstance(wait, timedelta) else float(wait)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError("wait must be a non-negative number of seconds, a timedelta or None")
    return seconds


def server_wait(remaining: float) -> int:
    """The ``wait_seconds`` of the next acquire with ``remaining`` seconds left to wait:
    whole seconds, at most ``MAX_WAIT_SECONDS`` (a longer wait takes several
    acquires); 0 under a second, which the client waits out itself."""
    return int(min(remaining, MAX_WAIT_SECONDS)) if remaining >= 1 else 0


def acquire_delay(
    attempt: int, retry_after: float, remaining: float, rand: float, *, held: bool = True
) -> float | None:
    """How long to wait before acquire attempt ``attempt + 1``; None when the wait is over.

    The wait doubles, plus up to ``JITTER`` at random (``rand`` in [0, 1)), and ends by
    ``remaining``. For a ``held`` key it is at most ``retry_after`` (the lease's expiry);
    otherwise (429, 503) at least ``retry_after``, up to ``MAX_HOLD_OFF_SECONDS``::

        attempt   0     1     2     3 ...
        wait    0.25  0.5   1.0   2.0 ...  held: capped by retry_after, 30 s, remaining
                                           else: at least retry_after (at most 300 s);
                                                 capped by remaining
    """
    if remaining <= 0:
        return None
    base = min(FIRST_POLL_SECONDS * 2.0 ** min(attempt, 16), MAX_POLL_SECONDS)
    if held:
        base = min(base, retry_after)
    else:
        base = max(base, min(retry_after, MAX_HOLD_OFF_SECONDS))
    return min(base * (1.0 + JITTER * rand), remaining)


@dataclass(slots=True)
class RenewalPlan:
    """When to renew one lease, in the worker's monotonic seconds.

    The local expiry counts the granted TTL from when the request was *sent*, so it is
    never later than the service's own::

        request sent        renewal due               local expiry
        |---- ttl / 3 -------|-------------------------|
        sent_at          sent_at + ttl/3        sent_at + granted ttl

    Granted less than asked, the lease is at its lifecycle's end (``final``): the next
    step is the expiry, where the worker reports the lease lost.
    """

    requested_ttl: int
    interval: float
    expires_at: float
    next_at: float
    final: bool = False
    failures: int = 0

    @classmethod
    def after_acquire(cls, requested_ttl: int, granted_ttl: int, sent_at: float) -> RenewalPlan:
        """The plan for a lease granted ``granted_ttl`` by a request sent at ``sent_at``."""
        plan = cls(requested_ttl, requested_ttl / 3.0, expires_at=sent_at, next_at=sent_at)
        plan.renewed(granted_ttl, sent_at)
        return plan

    @property
    def late_after(self) -> float:
        """A renewal this many seconds past due is logged as late."""
        return max(0.5, self.interval / 2.0)

    def renewed(self, granted_ttl: int, sent_at: float) -> None:
        """A renewal sent at ``sent_at`` succeeded with ``granted_ttl`` seconds."""
        self.expires_at = sent_at + granted_ttl
        self.final = granted_ttl < self.requested_ttl
        self.failures = 0
        due = sent_at + self.interval
        self.next_at = self.expires_at if self.final else min(due, self.expires_at)

    def failed(self, now: float, retry_after: float) -> None:
        """A renewal failed for a passing reason: the next try is after ``retry_after``, but
        no later than the interval or half the time left, so several fit before the expiry."""
        self.failures += 1
        left = self.expires_at - now
        pause = max(MIN_RETRY_SECONDS, min(retry_after, self.interval, left / 2.0))
        self.next_at = min(now + pause, self.expires_at)

    def wait_seconds(self, now: float) -> float:
        """Seconds from ``now`` until the next step is due (0 if overdue)."""
        return max(0.0, self.next_at - now)

    def expired(self, now: float) -> bool:
        """Whether the lease has run out by the local, conservative estimate."""
        return now >= self.expires_at
