"""Token-bucket rate limits kept in memory, one bucket per client address or namespace.

Time comes from an injected monotonic function, so tests move it by hand.
Buckets are forgotten least-recently-used first beyond ``max_keys``: a full
bucket and a forgotten one behave the same, so forgetting only ever helps a client.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable

__all__ = ["RateLimiter"]


class RateLimiter:
    """``rate`` tokens per second, bursts of up to ``burst``; ``rate == 0`` is off."""

    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        max_keys: int = 100_000,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self._monotonic = monotonic
        self._max_keys = max_keys
        self._buckets: dict[Hashable, tuple[float, float]] = {}

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def take(self, key: Hashable) -> int | None:
        """Spend one token for ``key``: None when allowed, else whole seconds to wait (≥ 1)."""
        if self.rate <= 0:
            return None
        now = self._monotonic()
        tokens, last = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            allowed = True
        else:
            self._buckets[key] = (tokens, now)
            allowed = False
        if len(self._buckets) > self._max_keys:
            del self._buckets[next(iter(self._buckets))]
        if allowed:
            return None
        return max(1, math.ceil((1.0 - tokens) / self.rate))
