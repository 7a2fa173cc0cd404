"""The request path's lock-free metrics expose exactly what prometheus_client's own
Counter and Histogram would for the same updates (``leasekeeper._metrics``)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from leasekeeper._metrics import LoopCounter, LoopHistogram

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
LABELS = st.sampled_from(["acquire", "renew", "release"])
#: Bucket bounds themselves (an observation equal to a bound is in that bucket), zero,
#: and values between and beyond them.
AMOUNTS = st.one_of(
    st.sampled_from((0.0, *BUCKETS)),
    st.floats(min_value=0, max_value=10, allow_nan=False),
)


def exposition(registry: CollectorRegistry) -> str:
    text = generate_latest(registry).decode()
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", text)


@given(
    counts=st.lists(st.tuples(LABELS, st.sampled_from(["200", "409"]), st.integers(1, 3))),
    observations=st.lists(st.tuples(LABELS, AMOUNTS)),
    plain=st.lists(AMOUNTS),
)
def test_the_exposition_is_prometheus_clients_own(
    counts: list[tuple[str, str, int]],
    observations: list[tuple[str, float]],
    plain: list[float],
) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop_counter = LoopCounter("t_requests", "Requests", ["route", "status"], ours)
    loop_histogram = LoopHistogram("t_seconds", "Seconds", ["route"], ours, BUCKETS)
    loop_plain = LoopHistogram("t_wait_seconds", "Wait", [], ours, BUCKETS)
    counter = Counter("t_requests", "Requests", ["route", "status"], registry=theirs)
    histogram = Histogram("t_seconds", "Seconds", ["route"], buckets=BUCKETS, registry=theirs)
    unlabelled = Histogram("t_wait_seconds", "Wait", buckets=BUCKETS, registry=theirs)
    for route, status, amount in counts:
        loop_counter.labels(route, status).inc(amount)
        counter.labels(route, status).inc(amount)
    for route, amount in observations:
        loop_histogram.labels(route).observe(amount)
        histogram.labels(route).observe(amount)
    for amount in plain:
        loop_plain.observe(amount)
        unlabelled.observe(amount)
    assert exposition(ours) == exposition(theirs)


def test_label_values_are_strings_and_must_be_complete() -> None:
    registry = CollectorRegistry()
    counter = LoopCounter("t_requests", "Requests", ["route", "status"], registry)
    counter.labels("acquire", 201).inc()
    counter.labels("acquire", "201").inc()
    assert registry.get_sample_value("t_requests_total", {"route": "acquire", "status": "201"}) == 2
    with pytest.raises(ValueError, match="takes labels"):
        counter.labels("acquire")
