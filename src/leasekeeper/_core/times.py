"""How millisecond times are reported: expiries round down, waits round up.

A client that trusts a reported expiry must never act after the real one, and
a client that waits ``retry_after_seconds`` must never come back too early::

    now        real expiry
     |------------|----->
     |  reported  |        lease_expires_at_timestamp = floor(expiry)
     |<-----------+--->|   retry_after_seconds = max(1, ceil(expiry - now))
"""

from __future__ import annotations

import functools
import time

__all__ = ["floor_seconds", "iso", "retry_after_seconds", "ttl_seconds"]


def floor_seconds(ms: int) -> int:
    """Unix seconds for ``ms``, rounded down."""
    return ms // 1000


def iso(ms: int) -> str:
    """``YYYY-MM-DDTHH:MM:SSZ`` for ``ms``, rounded down to the second."""
    return _iso_second(ms // 1000)


# Replies carry two or three such times, and under load most fall in the same few
# seconds: each second is formatted once (a speed trick: docs/performance.md).
@functools.lru_cache(maxsize=4096)
def _iso_second(second: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(second))


def retry_after_seconds(expires_ms: int, now_ms: int) -> int:
    """Seconds to wait until ``expires_ms``: rounded up, at least 1."""
    return max(1, -(-(expires_ms - now_ms) // 1000))


def ttl_seconds(expires_ms: int, now_ms: int) -> int:
    """Whole seconds granted from ``now_ms`` to ``expires_ms``, rounded down."""
    return max(0, (expires_ms - now_ms) // 1000)
