"""A store in a dict: for tests, and as the model other stores are compared against."""

from __future__ import annotations

import threading

from leasekeeper._clock import Clock, SystemClock
from leasekeeper._core.model import Command, Decision, LeaseRecord, LeaseState
from leasekeeper._core.rules import lifecycle_over, state_at
from leasekeeper.store._base import Purged, decide_with_fence

__all__ = ["MemoryStore"]


class MemoryStore:
    """Keeps records in memory; nothing survives the process. ``memory://``."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock or SystemClock()
        self._records: dict[bytes, LeaseRecord] = {}
        self._fence = 0
        self._lock = threading.Lock()

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    def _next_fence(self) -> int:
        self._fence += 1
        return self._fence

    async def apply(self, command: Command) -> Decision:
        with self._lock:
            record = self._records.get(command.key_id)
            decision = decide_with_fence(record, command, self._clock.now_ms(), self._next_fence)
            if decision.write is not None:
                self._records[command.key_id] = decision.write
            return decision

    async def raise_fence(self, at_least: int) -> int:
        with self._lock:
            self._fence = max(self._fence, at_least)
            return self._fence

    async def purge(self, limit: int, after: bytes | None = None) -> Purged:
        """Deletes up to ``limit`` finished records; the walk is over when fewer were left."""
        with self._lock:
            now = self._clock.now_ms()
            over = [k for k, r in self._records.items() if lifecycle_over(r, now)][:limit]
            for key_id in over:
                del self._records[key_id]
            return Purged(len(over), b"" if len(over) == limit else None)

    async def count_live(self) -> int:
        with self._lock:
            now = self._clock.now_ms()
            return sum(1 for r in self._records.values() if state_at(r, now) is LeaseState.HELD)

    def records(self) -> dict[bytes, LeaseRecord]:
        """A snapshot of every record (tests read it to look at what is stored)."""
        with self._lock:
            return dict(self._records)
