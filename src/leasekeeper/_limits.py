"""Token-bucket rate limits kept in memory, one bucket per client address or namespace.

Time comes from an injected monotonic function. Buckets beyond ``max_keys`` are
forgotten least-recently-used first (a forgotten bucket is a full one). One ``Limits``
serves the HTTP routes and ``/mcp`` alike, so both spend one budget. A namespace's
bucket is keyed by its SHA-256 digest, and the limits log nothing.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from leasekeeper._errors import RateLimited
from leasekeeper._settings import Settings

__all__ = ["Limits", "RateLimiter", "client_address", "namespace_digest"]


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
        # Least recently used first; OrderedDict evicts the first in O(1).
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()

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
            self._buckets.popitem(last=False)
        if allowed:
            return None
        return max(1, math.ceil((1.0 - tokens) / self.rate))

    def enforce(self, key: Hashable, what: str) -> None:
        """Spend one token for ``key``, or raise ``RateLimited`` ("Too many {what}; ...")."""
        wait = self.take(key)
        if wait is not None:
            seconds = "1 second" if wait == 1 else f"{wait} seconds"
            raise RateLimited(f"Too many {what}; retry after {seconds}", retry_after_seconds=wait)


def client_address(scope: Mapping[str, Any]) -> str:
    """The key of per-address limits: the ASGI scope's client host as an IP address;
    IPv6 as its /64 (one host usually holds it whole), IPv4-mapped as IPv4. A host that
    is no IP address is ``"invalid"`` (one bucket for all); no client, ``"unknown"``.
    """
    client = scope.get("client")
    if not client:
        return "unknown"
    try:
        ip = ipaddress.ip_address(client[0])
    except ValueError:
        return "invalid"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip)


def namespace_digest(namespace: str) -> bytes:
    """The key of per-namespace limits: SHA-256 of the namespace (UTF-8, "replace")."""
    return hashlib.sha256(namespace.encode("utf-8", "replace")).digest()


@dataclass(frozen=True, slots=True)
class Limits:
    """The rate limits of one server, shared by every network adapter: requests per
    client ``address``, namespace ``mint``s per address, requests per ``namespace``."""

    address: RateLimiter
    mint: RateLimiter
    namespace: RateLimiter

    @classmethod
    def from_settings(
        cls, settings: Settings, *, monotonic: Callable[[], float] = time.monotonic
    ) -> Limits:
        """The three limiters ``settings`` describe, all on ``monotonic``."""
        address = RateLimiter(settings.address_rate, settings.address_burst, monotonic=monotonic)
        mint = RateLimiter(settings.namespace_rate, settings.namespace_burst, monotonic=monotonic)
        namespace = RateLimiter(
            settings.namespace_request_rate, settings.namespace_request_burst, monotonic=monotonic
        )
        return cls(address=address, mint=mint, namespace=namespace)

    def enforce_address(self, scope: Mapping[str, Any]) -> None:
        """Spend one request of the ASGI ``scope``'s client address, when that limit is on."""
        if self.address.enabled:
            self.address.enforce(client_address(scope), "requests from this address")

    def enforce(
        self,
        scope: Mapping[str, Any],
        operation: str,
        data: Mapping[str, Any],
        *,
        address: bool = True,
    ) -> None:
        """Spend what one request costs, or raise ``RateLimited`` at the first refusal:
        one request of the ``scope``'s address (unless ``address`` is false: taken
        already), one mint for ``"namespace"``, one request of ``data``'s namespace.
        """
        if address:
            self.enforce_address(scope)
        if operation == "namespace":
            self.mint.enforce(client_address(scope), "namespaces minted from this address")
        if self.namespace.enabled:
            namespace = data.get("namespace")
            if isinstance(namespace, str):
                self.namespace.enforce(namespace_digest(namespace), "requests for this namespace")
