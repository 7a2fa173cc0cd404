"""Where leasekeeper's time comes from.

Lease decisions never read a clock themselves: a store reads its ``Clock`` once
per decision and passes ``now_ms`` (integer Unix milliseconds) to the rules.
Production uses ``SystemClock``; tests use ``FakeClock`` and cross TTLs and the
24-hour boundary by calling ``advance`` instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["Clock", "FakeClock", "SystemClock"]


class Clock(Protocol):
    """A source of Unix time in integer milliseconds that never runs backwards."""

    def now_ms(self) -> int:
        """The current time in milliseconds since the Unix epoch."""
        ...


class SystemClock:
    """The wall clock, held so that it never runs backwards within this process.

    If the system clock steps back (an NTP correction, a VM restore), this clock
    stands still until the wall clock passes the highest time already handed out:
    an expired lease must not come back to life because the clock moved.
    """

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        wall = time.time_ns() // 1_000_000
        with self._lock:
            if wall > self._last:
                self._last = wall
            return self._last


class FakeClock:
    """A clock that only moves when told to; for tests.

    Like trio's MockClock it refuses to go backwards: ``advance`` takes a
    non-negative step and ``set`` refuses an earlier time. Use ``jump_back``
    only to simulate a broken wall clock underneath a guard.
    """

    def __init__(self, start_ms: int = 1_788_602_400_000) -> None:
        # Default start: 2026-09-05T10:00:00Z, the seed's own example instant.
        self._now = start_ms
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        with self._lock:
            return self._now

    def advance(self, seconds: float = 0.0, *, ms: int = 0) -> int:
        """Move forward by ``seconds`` plus ``ms``; returns the new time."""
        step = round(seconds * 1000) + ms
        if step < 0:
            raise ValueError("FakeClock.advance takes a non-negative step")
        with self._lock:
            self._now += step
            return self._now

    def set(self, now_ms: int) -> None:
        """Move to ``now_ms``, which must not be earlier than the current time."""
        with self._lock:
            if now_ms < self._now:
                raise ValueError("FakeClock does not go backwards; use jump_back")
            self._now = now_ms

    def jump_back(self, seconds: float) -> None:
        """Step the clock back, as a misbehaving wall clock would (fault tests only)."""
        with self._lock:
            self._now -= round(seconds * 1000)
