"""The client's pure timing decisions: waiting for a held key, and the renewal plan."""

from __future__ import annotations

import math
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from leasekeeper import AsyncLeaseClient, LeaseClient
from leasekeeper._clock import _elapsed_clock, elapsed_seconds
from leasekeeper.client import RenewalPlan
from leasekeeper.client._timing import (
    MAX_HOLD_OFF_SECONDS,
    MAX_POLL_SECONDS,
    acquire_delay,
    as_seconds,
)


def test_as_seconds_accepts_numbers_timedeltas_none_and_infinity() -> None:
    """None is no wait, a timedelta is its seconds, math.inf waits for ever."""
    assert as_seconds(None) == 0
    assert as_seconds(timedelta(minutes=1)) == 60
    assert as_seconds(2) == 2.0
    assert as_seconds(math.inf) == math.inf
    for bad in (-1, math.nan, timedelta(seconds=-1)):
        with pytest.raises(ValueError, match="wait"):
            as_seconds(bad)


def test_acquire_delay_doubles_and_is_capped() -> None:
    """Delays double from 0.25 s, never exceed Retry-After, 30 s, or the time left."""
    delays = [acquire_delay(n, 60, 1000, 0.0) for n in range(10)]
    assert delays[:4] == [0.25, 0.5, 1.0, 2.0]
    assert max(d for d in delays if d is not None) == MAX_POLL_SECONDS
    assert acquire_delay(5, 3, 1000, 0.0) == 3
    assert acquire_delay(5, 60, 1.5, 0.0) == 1.5
    assert acquire_delay(0, 60, 0, 0.0) is None
    assert acquire_delay(10_000, 60, 1000, 0.0) == MAX_POLL_SECONDS  # no overflow


def test_a_limit_or_an_outage_waits_at_least_retry_after() -> None:
    """Not held: the wait doubles as for a held key but is never below Retry-After."""
    delays = [acquire_delay(n, 3, 1000, 0.0, held=False) for n in range(6)]
    assert delays == [3, 3, 3, 3, 4.0, 8.0]
    assert acquire_delay(0, 3, 1000, 0.999, held=False) == pytest.approx(3.6, abs=0.01)
    assert acquire_delay(0, 3, 1.5, 0.0, held=False) == 1.5  # the deadline still bounds it


def test_a_retry_after_no_service_means_is_obeyed_for_300_s_at_most() -> None:
    """A proxy's Retry-After of a year (or a day) does not put a waiting worker to sleep
    for that long: the hold-off is at most MAX_HOLD_OFF_SECONDS, plus the jitter."""
    assert MAX_HOLD_OFF_SECONDS == 300
    assert acquire_delay(0, 999_999_999, math.inf, 0.0, held=False) == 300
    assert acquire_delay(0, 86_400, math.inf, 0.999, held=False) == pytest.approx(360, abs=0.1)
    assert acquire_delay(0, 299, math.inf, 0.0, held=False) == 299


def test_jitter_only_lengthens_the_wait() -> None:
    """Jitter adds up to 20 %, so a wait bounded by Retry-After never comes back early."""
    assert acquire_delay(9, 3, 1000, 0.0) == 3
    assert acquire_delay(9, 3, 1000, 0.999) == pytest.approx(3.6, abs=0.01)


def test_renewal_plan_renews_at_a_third_and_tracks_the_expiry() -> None:
    """A grant sent at t renews at t + ttl/3 and expires locally at t + granted."""
    plan = RenewalPlan.after_acquire(30, 30, sent_at=100.0)
    assert (plan.next_at, plan.expires_at, plan.final) == (110.0, 130.0, False)
    assert plan.wait_seconds(104.0) == 6.0
    plan.renewed(30, sent_at=110.5)
    assert (plan.next_at, plan.expires_at) == (120.5, 140.5)
    assert not plan.expired(140.4)
    assert plan.expired(140.5)


def test_a_shortened_grant_is_final() -> None:
    """Granted less than asked means the lifecycle ends: the next step is the expiry."""
    plan = RenewalPlan.after_acquire(30, 12, sent_at=0.0)
    assert plan.final
    assert plan.next_at == plan.expires_at == 12.0


def test_failures_retry_sooner_and_never_past_the_expiry() -> None:
    """After a failure the retry comes after Retry-After, within half the time left."""
    plan = RenewalPlan.after_acquire(30, 30, sent_at=0.0)
    plan.failed(10.0, retry_after=1)
    assert plan.next_at == 11.0
    assert plan.failures == 1
    plan.failed(10.0, retry_after=60)  # a long Retry-After is cut to the interval
    assert plan.next_at == 20.0
    plan.failed(29.0, retry_after=5)
    assert plan.next_at == 29.5
    plan.failed(29.99, retry_after=5)
    assert plan.next_at == 30.0  # capped at the expiry
    plan.renewed(30, sent_at=30.0)
    assert plan.failures == 0


@pytest.mark.parametrize(
    ("platform", "names", "read"),
    [
        ("linux", ("CLOCK_BOOTTIME", "CLOCK_MONOTONIC"), "clock 7"),
        ("darwin", ("CLOCK_MONOTONIC",), "clock 6"),
        ("win32", (), "monotonic"),
        ("freebsd14", ("CLOCK_MONOTONIC",), "monotonic"),
    ],
)
def test_elapsed_time_is_read_from_a_clock_that_counts_a_suspend(
    platform: str, names: tuple[str, ...], read: str
) -> None:
    """CLOCK_BOOTTIME where there is one (Linux); on macOS CLOCK_MONOTONIC, which goes
    on while the machine sleeps, where time.monotonic (mach_absolute_time) stops; the
    monotonic clock elsewhere."""
    ids = {"CLOCK_BOOTTIME": 7, "CLOCK_MONOTONIC": 6}
    clocks = SimpleNamespace(
        clock_gettime_ns=lambda clock: f"clock {clock}",
        monotonic_ns=lambda: "monotonic",
        **{name: ids[name] for name in names},
    )
    assert _elapsed_clock(clocks, platform)() == read


def test_clients_measure_leases_on_a_clock_that_counts_a_suspend() -> None:
    """Both clients time a lease's local expiry with elapsed_seconds, which on Linux reads
    CLOCK_BOOTTIME: time.monotonic stops while the machine is suspended, after which a
    lease past its expiry would still look held."""
    with LeaseClient("http://127.0.0.1:9") as client:
        assert client._monotonic is elapsed_seconds
    assert AsyncLeaseClient("http://127.0.0.1:9")._monotonic is elapsed_seconds
    if hasattr(time, "CLOCK_BOOTTIME"):
        boottime = time.clock_gettime(time.CLOCK_BOOTTIME)
        assert boottime <= elapsed_seconds() < boottime + 1.0
