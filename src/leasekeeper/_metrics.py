"""Prometheus metrics. Labels are routes, statuses, operations and outcomes: never a key
or a namespace. Live leases are counted by the store, periodically (a count of grants
minus ends would drift across restarts and instances).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from leasekeeper._core.model import (
    CompletedOutcome,
    Granted,
    Held,
    Lost,
    Outcome,
    Renewed,
)

__all__ = ["Children", "LoopCounter", "LoopHistogram", "Metrics"]

#: How prometheus_client writes a bucket's bound ("0.0005", "1.0", "+Inf").
_go_float: Callable[[float], str] = floatToGoString
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
_LEASE_SECONDS = (1, 5, 15, 30, 60, 120, 300, 900, 3600, 14_400, 86_400)


class Children(dict[Hashable, Callable[..., None]]):
    """One method (``"inc"``, ``"observe"``) of a labelled metric's children, by label
    value (a tuple for several), looked up once (a speed trick: docs/performance.md).
    For small fixed label sets only: entries are never dropped.
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


class _CounterChild:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _HistogramChild:
    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # The first bucket whose upper bound is >= amount (Prometheus' "le").
        self.counts[bisect.bisect_left(self._bounds, amount)] += 1
        self.sum += amount


class _LoopMetric(Collector):
    """What ``LoopCounter`` and ``LoopHistogram`` share: children by label values, made
    on first use, and registration as a collector."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Any] = {}
        registry.register(self)

    def labels(self, *values: object) -> Any:
        """The child for these label values (as prometheus_client's ``labels``)."""
        key = tuple(str(value) for value in values)
        if len(key) != len(self._labelnames):
            raise ValueError(f"{self._name} takes labels {self._labelnames}")
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._child()
        return child

    def _child(self) -> Any:
        raise NotImplementedError

    def describe(self) -> list[Metric]:
        return [self._family()]

    def _family(self) -> Metric:
        raise NotImplementedError


class LoopCounter(_LoopMetric):
    """A labelled Prometheus counter updated without a lock (a speed trick:
    docs/performance.md), exposed as prometheus_client's would be. Only for metrics
    updated on the event loop's thread: two threads adding at once could lose a count.
    """

    def _child(self) -> _CounterChild:
        return _CounterChild()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value, created=child.created)
        yield family


class LoopHistogram(_LoopMetric):
    """A Prometheus histogram for the request path, updated without a lock (see
    ``LoopCounter``); without label names, ``observe`` is its one child's."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        bounds = tuple(float(bound) for bound in buckets)
        self._bounds = bounds if bounds[-1] == math.inf else (*bounds, math.inf)
        self._les = [_go_float(bound) for bound in self._bounds]
        super().__init__(name, documentation, labelnames, registry)
        if not self._labelnames:
            self.observe = self.labels().observe

    def _child(self) -> _HistogramChild:
        return _HistogramChild(self._bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            cumulative, total = [], 0
            for le, count in zip(self._les, child.counts, strict=True):
                total += count
                cumulative.append((le, float(total)))
            family.add_metric(values, cumulative, child.sum)
            family.samples.append(
                Sample(
                    self._name + "_created",
                    dict(zip(self._labelnames, values, strict=True)),
                    child.created,
                )
            )
        yield family


class Metrics:
    """One registry per application; also the service's observer (``store_call``,
    ``decided``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = LoopCounter(
            "leasekeeper_requests",
            "HTTP requests by route and HTTP status code",
            ["route", "status"],
            self.registry,
        )
        self.latency = LoopHistogram(
            "leasekeeper_request_seconds",
            "HTTP request handling time by route",
            ["route"],
            self.registry,
            _SECONDS,
        )
        self.in_flight = Gauge(
            "leasekeeper_requests_in_flight", "Requests being handled", registry=self.registry
        )
        self.decisions = LoopCounter(
            "leasekeeper_decisions",
            "Lease decisions by operation and outcome",
            ["operation", "outcome"],
            self.registry,
        )
        self.store_latency = LoopHistogram(
            "leasekeeper_store_seconds",
            "Time for the store to decide and durably commit, by operation",
            ["operation"],
            self.registry,
            _SECONDS,
        )
        self.store_failures = LoopCounter(
            "leasekeeper_store_failures",
            "Store calls that failed (503 unavailable or 500 internal), by operation",
            ["operation"],
            self.registry,
        )
        self.lease_seconds = LoopHistogram(
            "leasekeeper_lease_granted_seconds",
            "Lease length granted by acquire and renew (capped by the lifecycle)",
            ["operation"],
            self.registry,
            _LEASE_SECONDS,
        )
        self.wait_seconds = LoopHistogram(
            "leasekeeper_lease_wait_seconds",
            "Wait told to callers that found a lease held (until its current expiry)",
            [],
            self.registry,
            _LEASE_SECONDS,
        )
        self.work_seconds = LoopHistogram(
            "leasekeeper_work_seconds",
            "From a key's first acquire (its lifecycle start) to its completed result",
            [],
            self.registry,
            _LEASE_SECONDS,
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
