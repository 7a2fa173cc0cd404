"""Where leasekeeper's time comes from.

Lease decisions never read a clock themselves: a store reads its ``Clock`` once
per decision and passes ``now_ms`` (integer Unix milliseconds) to the rules.
Production uses ``SystemClock``; tests use ``FakeClock`` and cross TTLs and the
24-hour boundary by calling ``advance`` instead of sleeping.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Clock", "FakeClock", "SystemClock", "elapsed_ns", "elapsed_seconds"]


class Clock(Protocol):
    """A source of Unix time in integer milliseconds that never runs backwards."""

    def now_ms(self) -> int:
        """The current time in milliseconds since the Unix epoch."""
        ...


def _elapsed_clock(clocks: Any, platform: str) -> Callable[[], int]:
    """What ``elapsed_ns`` reads (``clocks``: the ``time`` module): a clock that counts a
    suspend, where there is one: ``CLOCK_BOOTTIME`` on Linux, ``CLOCK_MONOTONIC`` on
    macOS (``time.monotonic`` stops there); else the monotonic clock."""
    if hasattr(clocks, "CLOCK_BOOTTIME"):
        return functools.partial(clocks.clock_gettime_ns, clocks.CLOCK_BOOTTIME)
    if platform == "darwin" and hasattr(clocks, "CLOCK_MONOTONIC"):
        return functools.partial(clocks.clock_gettime_ns, clocks.CLOCK_MONOTONIC)
    monotonic_ns: Callable[[], int] = clocks.monotonic_ns
    return monotonic_ns


#: Nanoseconds of elapsed time, counting a suspend of the machine where the platform
#: has a clock that does (``_elapsed_clock``).
elapsed_ns: Callable[[], int] = _elapsed_clock(time, sys.platform)


def elapsed_seconds() -> float:
    """Seconds of elapsed time (``elapsed_ns``), counting a suspend: what the client
    measures a lease's local expiry with."""
    return elapsed_ns() / 1e9


class SystemClock:
    """The wall clock, held so that it never runs backwards nor stands still.

    If the wall clock steps back, this clock goes on from the last time it handed out
    at the pace of elapsed time until the wall clock catches up: an expired lease must
    not come back to life, nor a lease outlive its TTL. A step forward is followed::

        wall clock     10:00 ──── 10:05 ╮ (stepped back an hour)   ╭ 10:10 ────
                                        ╰ 09:05 ──── 09:10 ────────╯ (put right)
        this clock     10:00 ──── 10:05 ─────────────── 10:10 ──────── 10:10 ────
    """

    def __init__(
        self,
        wall_ns: Callable[[], int] = time.time_ns,
        elapsed_ns: Callable[[], int] = elapsed_ns,
    ) -> None:
        self._wall_ns = wall_ns
        self._elapsed_ns = elapsed_ns
        self._last_ns = 0
        self._last_elapsed_ns = elapsed_ns()
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        with self._lock:
            wall, elapsed = self._wall_ns(), self._elapsed_ns()
            # The later of the wall clock and the last time plus the time elapsed since.
            now = max(wall, self._last_ns + max(elapsed - self._last_elapsed_ns, 0))
            self._last_ns, self._last_elapsed_ns = now, elapsed
            return now // 1_000_000


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
