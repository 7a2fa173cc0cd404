"""Token-bucket rate limits kept in memory, one bucket per client address or namespace.

Time comes from an injected monotonic function, so tests move it by hand.
Buckets are forgotten least-recently-used first beyond ``max_keys``: a full
bucket and a forgotten one behave the same, so forgetting only ever helps a client.

Namespace minting is limited per client address wherever a client can mint over
the network: the HTTP route and the MCP tool at ``/mcp`` both call ``take_mint``
with the one limiter that ``leasekeeper serve`` makes (``mint_limiter``), so
mints from one address add up across the two.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from leasekeeper._errors import RateLimited
from leasekeeper._settings import Settings

__all__ = ["RateLimiter", "client_address", "mint_limiter", "take_mint"]


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

    def enforce(self, key: Hashable, what: str) -> None:
        """Spend one token for ``key``, or raise ``RateLimited`` ("Too many {what}; ...")."""
        wait = self.take(key)
        if wait is not None:
            raise RateLimited(
                f"Too many {what}; retry after {wait} seconds", retry_after_seconds=wait
            )


def client_address(scope: Mapping[str, Any]) -> str:
    """The key of per-address limits: the ASGI scope's client host, else ``"unknown"``."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def mint_limiter(
    settings: Settings, *, monotonic: Callable[[], float] = time.monotonic
) -> RateLimiter:
    """The namespace-mint limiter (``LEASEKEEPER_NAMESPACE_RATE`` / ``_BURST``).

    Make one per server and hand it to every adapter that mints over the network.
    """
    return RateLimiter(settings.namespace_rate, settings.namespace_burst, monotonic=monotonic)


def take_mint(limiter: RateLimiter, scope: Mapping[str, Any]) -> None:
    """Spend one mint of the ASGI ``scope``'s client address, or raise ``RateLimited``."""
    limiter.enforce(client_address(scope), "namespaces minted from this address")
