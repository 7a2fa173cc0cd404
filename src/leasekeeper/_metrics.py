"""Prometheus metrics. Labels are routes, statuses, operations and outcomes: never a key
or a namespace.

What can be measured without keeping more than the store keeps (no grant time is
stored, so a lease's hold time is not knowable after the fact):

* requests by route and status, their latency, and requests in flight;
* every decision by operation and outcome (``granted``, ``held``, ``lost_expired`` …);
* store latency per operation;
* lease lengths granted (acquire and renew) and the waits callers are told
  (``retry_after`` of a ``held`` answer): together, how long leases are held and
  how long others wait for them;
* work duration: from a key's first acquire (its lifecycle start) to its result;
* live leases, counted by the store every ``LEASEKEEPER_LIVE_LEASES_INTERVAL_SECONDS``
  (a count of grants minus ends would drift across restarts and instances);
* cleanup runs, their duration and records deleted; slow clients cut off.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from leasekeeper._core.model import (
    CompletedOutcome,
    Granted,
    Held,
    Lost,
    Outcome,
    Renewed,
)

__all__ = ["Children", "Metrics"]

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
_LEASE_SECONDS = (1, 5, 15, 30, 60, 120, 300, 900, 3600, 14_400, 86_400)


class Children(dict[Hashable, Callable[..., None]]):
    """One method (``"inc"``, ``"observe"``) of a labelled metric's children, by label
    value, or by a tuple of label values for several labels.

    prometheus_client's ``labels()`` costs a lock and a tuple on every call; here a
    child is looked up once, on first use, and after that ``children[labels](...)``
    is a dict lookup. For small fixed label sets only (routes, statuses, operations,
    outcomes): entries are never dropped.
    """

    def __init__(self, metric: Any, method: str) -> None:
        super().__init__()
        self._metric = metric
        self._method = method

    def __missing__(self, labels: Hashable) -> Callable[..., None]:
        values = labels if isinstance(labels, tuple) else (labels,)
        bound: Callable[..., None] = getattr(self._metric.labels(*values), self._method)
        self[labels] = bound
        return bound


class Metrics:
    """One registry per application, so several apps in one process do not collide.

    It is also the service's observer (``LeaseService.add_observer``): the service
    reports each store call and each decision to ``store_call`` and ``decided``.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "leasekeeper_requests",
            "HTTP requests by route and response status word",
            ["route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "leasekeeper_request_seconds",
            "HTTP request handling time by route",
            ["route"],
            buckets=_SECONDS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "leasekeeper_requests_in_flight", "Requests being handled", registry=self.registry
        )
        self.decisions = Counter(
            "leasekeeper_decisions",
            "Lease decisions by operation and outcome",
            ["operation", "outcome"],
            registry=self.registry,
        )
        self.store_latency = Histogram(
            "leasekeeper_store_seconds",
            "Time for the store to decide and durably commit, by operation",
            ["operation"],
            buckets=_SECONDS,
            registry=self.registry,
        )
        self.store_failures = Counter(
            "leasekeeper_store_failures",
            "Store calls that failed (503 unavailable or 500 internal), by operation",
            ["operation"],
            registry=self.registry,
        )
        self.lease_seconds = Histogram(
            "leasekeeper_lease_granted_seconds",
            "Lease length granted by acquire and renew (capped by the lifecycle)",
            ["operation"],
            buckets=_LEASE_SECONDS,
            registry=self.registry,
        )
        self.wait_seconds = Histogram(
            "leasekeeper_lease_wait_seconds",
            "Wait told to callers that found a lease held (until its current expiry)",
            buckets=_LEASE_SECONDS,
            registry=self.registry,
        )
        self.work_seconds = Histogram(
            "leasekeeper_work_seconds",
            "From a key's first acquire (its lifecycle start) to its completed result",
            buckets=_LEASE_SECONDS,
            registry=self.registry,
        )
        self.live_leases = Gauge(
            "leasekeeper_live_leases",
            "Leases held right now, as last counted by the store",
            registry=self.registry,
        )
        self.live_leases_counted = Gauge(
            "leasekeeper_live_leases_counted_timestamp_seconds",
            "When leasekeeper_live_leases was last counted (Unix seconds)",
            registry=self.registry,
        )
        self.cleanup_runs = Counter(
            "leasekeeper_cleanup_runs", "Cleanup runs", ["result"], registry=self.registry
        )
        self.cleanup_seconds = Histogram(
            "leasekeeper_cleanup_seconds",
            "Duration of one cleanup run (every batch)",
            buckets=(0.001, 0.01, 0.1, 1.0, 10.0, 60.0, 600.0),
            registry=self.registry,
        )
        self.slow_clients = Counter(
            "leasekeeper_slow_clients",
            "Requests refused with 408 because the client sent its headers or body too slowly",
            ["stage"],
            registry=self.registry,
        )
        self.cleanup_deleted = Counter(
            "leasekeeper_cleanup_deleted_records",
            "Records deleted because their lifecycle was over",
            registry=self.registry,
        )
        self._store_observe = Children(self.store_latency, "observe")
        self._store_failed = Children(self.store_failures, "inc")
        self._decided = Children(self.decisions, "inc")
        self._lease_observe = Children(self.lease_seconds, "observe")

    # -- the service's observer ------------------------------------------------------------

    def store_call(self, operation: str, seconds: float, failed: bool) -> None:
        """One store call: its latency, and whether it failed."""
        self._store_observe[operation](seconds)
        if failed:
            self._store_failed[operation]()

    def decided(self, operation: str, outcome: Outcome, lifecycle_ms: int) -> None:
        """One decision of the rules, as returned by the store."""
        if isinstance(outcome, Lost):
            name = "lost_" + outcome.reason.name.lower()
        elif isinstance(outcome, CompletedOutcome):
            name = "completed"
        else:
            name = type(outcome).__name__.lower()
        self._decided[operation, name]()
        if isinstance(outcome, Granted | Renewed):
            seconds = max(0, outcome.record.lease_expires_ms - outcome.now_ms) / 1000
            self._lease_observe[operation](seconds)
        elif isinstance(outcome, Held):
            self.wait_seconds.observe(
                max(0, outcome.record.lease_expires_ms - outcome.now_ms) / 1000
            )
        elif isinstance(outcome, CompletedOutcome) and operation == "complete":
            record = outcome.record
            if record.completed_ms is not None:
                started = record.absolute_expires_ms - lifecycle_ms
                self.work_seconds.observe(max(0, record.completed_ms - started) / 1000)
