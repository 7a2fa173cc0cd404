"""Prometheus metrics. Labels are routes, statuses and outcomes: never a key or namespace."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]


class Metrics:
    """One registry per application, so several apps in one process do not collide."""

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
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "leasekeeper_requests_in_flight", "Requests being handled", registry=self.registry
        )
        self.cleanup_runs = Counter(
            "leasekeeper_cleanup_runs", "Cleanup runs", ["result"], registry=self.registry
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
