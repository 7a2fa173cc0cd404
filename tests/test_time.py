"""A clock that steps back never revives an expired lease or a finished lifecycle.

The guard is per key (``rules.effective_now``): every decision on a key runs at no
earlier time than the key's last decision, and a decision that sees an expiry
records the time it saw. These tests step ``FakeClock`` back underneath the HTTP
app, and across a restart of the SQLite store, after each kind of ending::

    t0        t0+5        t0+6            clock steps back to t0-4
    |--lease--|  expired   | seen expired  |  still expired: no renew, no revival
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from leasekeeper import FakeClock, LeaseHeld, LeaseService, SystemClock
from leasekeeper.store import MemoryStore, SqliteStore
from tests.conftest import Api, ApiFactory

KEY = "report:2026-09"


def body(response: Any, code: int, status: str) -> dict[str, Any]:
    assert response.status_code == code, response.text
    data: dict[str, Any] = response.json()
    assert data["status"] == status, data
    return data


def take(api: Api, ns: str, ttl: int = 5) -> dict[str, Any]:
    return body(api.acquire(namespace=ns, key=KEY, ttl_seconds=ttl), 201, "held")


def owner(ns: str, lease: dict[str, Any]) -> dict[str, Any]:
    return {"namespace": ns, "key": KEY, "owner_token": lease["owner_token"]}


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
def test_an_expiry_once_seen_survives_the_clock_stepping_back(
    make_api: ApiFactory, clock: FakeClock, store_kind: str
) -> None:
    """After a refused renew saw the expiry, stepping back neither lets the owner renew nor
    keeps others out."""
    api = make_api(store_kind)
    ns = api.namespace()
    old = take(api, ns)
    clock.advance(6)
    body(api.renew(**owner(ns, old)), 409, "lost")
    clock.jump_back(10)
    assert "expired" in body(api.renew(**owner(ns, old)), 409, "lost")["error"]
    assert "expired" in body(api.release(**owner(ns, old)), 409, "lost")["error"]
    new = take(api, ns)
    assert new["fencing_token"] > old["fencing_token"]
    assert new["lease_expires_at_timestamp"] >= old["lease_expires_at_timestamp"]


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
def test_a_superseded_owner_stays_superseded(
    make_api: ApiFactory, clock: FakeClock, store_kind: str
) -> None:
    """Once a new owner took an expired lease, stepping back gives the old owner nothing and
    shortens nothing of the new owner's lease."""
    api = make_api(store_kind)
    ns = api.namespace()
    old = take(api, ns)
    clock.advance(6)
    new = take(api, ns, ttl=30)
    clock.jump_back(10)
    for attempt in (api.renew, api.release):
        body(attempt(**owner(ns, old)), 409, "lost")
    held = body(api.acquire(namespace=ns, key=KEY), 409, "held")
    assert held["fencing_token"] == new["fencing_token"]
    assert held["lease_expires_at"] == new["lease_expires_at"]
    assert held["retry_after_seconds"] == 30  # counted from the last decision, not the clock
    renewed = body(api.renew(**owner(ns, new), ttl_seconds=30), 200, "held")
    assert renewed["lease_expires_at_timestamp"] == new["lease_expires_at_timestamp"]


@pytest.mark.parametrize("ending", ["release", "complete"])
def test_an_ended_lease_stays_ended(make_api: ApiFactory, clock: FakeClock, ending: str) -> None:
    """Released and completed leases stay so; a completed result is kept, not re-granted."""
    api = make_api("sqlite")
    ns = api.namespace()
    lease = take(api, ns)
    extra = {"result": {"n": 1}} if ending == "complete" else {}
    api.post(f"/lease/{ending}", {**owner(ns, lease), **extra})
    clock.advance(2)
    clock.jump_back(60)
    body(api.renew(**owner(ns, lease)), 409, "lost")
    again = api.acquire(namespace=ns, key=KEY, ttl_seconds=5)
    if ending == "complete":
        assert body(again, 200, "completed")["result"] == {"n": 1}
    else:
        assert body(again, 201, "held")["fencing_token"] > lease["fencing_token"]


def test_a_finished_lifecycle_is_not_revived(make_api: ApiFactory, clock: FakeClock) -> None:
    """A lifecycle seen to be over stays over: its result and binding do not come back."""
    api = make_api("sqlite", lifecycle_seconds=100)
    ns = api.namespace()
    lease = body(api.acquire(namespace=ns, key=KEY, fingerprint="a"), 201, "held")
    body(api.complete(**owner(ns, lease), result="old"), 200, "completed")
    clock.advance(100)
    body(api.renew(**owner(ns, lease)), 409, "lost")  # sees that the lifecycle is over
    clock.jump_back(50)
    fresh = body(api.acquire(namespace=ns, key=KEY, fingerprint="b"), 201, "held")
    assert fresh["fencing_token"] > lease["fencing_token"]
    assert fresh["absolute_expires_at_timestamp"] >= lease["absolute_expires_at_timestamp"] + 100


def test_cleanup_under_a_clock_stepped_back_deletes_nothing_live(
    make_api: ApiFactory, clock: FakeClock
) -> None:
    """Cleanup reads the clock too; stepping back makes it delete less, never more."""
    api = make_api("sqlite", lifecycle_seconds=100)
    ns = api.namespace()
    lease = take(api, ns, ttl=50)
    clock.jump_back(3600)
    deleted = api.client.portal.call(api.service.cleanup)  # type: ignore[union-attr]
    assert deleted == 0
    body(api.renew(**owner(ns, lease), ttl_seconds=50), 200, "held")


def test_a_restart_with_the_clock_stepped_back_keeps_seen_expiries(
    make_api: ApiFactory, clock: FakeClock, tmp_path: Path
) -> None:
    """The guard is stored with each record: a restarted SQLite store on a clock an hour
    behind still refuses the expired owner and the finished lifecycle."""
    path = tmp_path / "restart.db"
    api = make_api(store=SqliteStore(path, clock), lifecycle_seconds=100)
    ns = api.namespace()
    expired = body(api.acquire(namespace=ns, key="expired", ttl_seconds=5), 201, "held")
    done = body(api.acquire(namespace=ns, key="done", fingerprint="a"), 201, "held")
    body(
        api.complete(namespace=ns, key="done", owner_token=done["owner_token"], result=1),
        200,
        "completed",
    )
    clock.advance(100)
    body(api.renew(namespace=ns, key="expired", owner_token=expired["owner_token"]), 409, "lost")
    body(api.renew(namespace=ns, key="done", owner_token=done["owner_token"]), 409, "lost")
    api.client.__exit__(None, None, None)

    clock.jump_back(3600)
    again = make_api(store=SqliteStore(path, clock), lifecycle_seconds=100)
    lost = again.renew(namespace=ns, key="expired", owner_token=expired["owner_token"])
    body(lost, 409, "lost")
    fresh = body(again.acquire(namespace=ns, key="done", fingerprint="b"), 201, "held")
    assert fresh["fencing_token"] > max(done["fencing_token"], expired["fencing_token"])
    taken = body(again.acquire(namespace=ns, key="expired", ttl_seconds=5), 201, "held")
    assert taken["fencing_token"] > fresh["fencing_token"]


def test_an_expiry_nobody_saw_is_still_exclusive_after_a_restart_stepped_back(
    make_api: ApiFactory, clock: FakeClock, tmp_path: Path
) -> None:
    """The documented limit: an expiry no decision saw is not known after a restart on a clock
    that stepped back, so the owner may renew, but nobody else is let in meanwhile."""
    path = tmp_path / "unseen.db"
    api = make_api(store=SqliteStore(path, clock))
    ns = api.namespace()
    lease = take(api, ns)
    clock.advance(6)  # expired, but no decision looked at the key
    api.client.__exit__(None, None, None)

    clock.jump_back(10)
    again = make_api(store=SqliteStore(path, clock))
    held = body(again.acquire(namespace=ns, key=KEY), 409, "held")
    assert held["fencing_token"] == lease["fencing_token"]
    renewed = body(again.renew(**owner(ns, lease)), 200, "held")
    assert renewed["fencing_token"] == lease["fencing_token"]


class _Clocks:
    """A wall clock and an elapsed-time clock, in nanoseconds, moved by the test."""

    def __init__(self) -> None:
        self.wall = 1_788_602_400_000 * 1_000_000
        self.elapsed = 5_000 * 1_000_000_000

    def step(self, seconds: float) -> None:
        """Time passes: both clocks move."""
        self.wall += round(seconds * 1e9)
        self.elapsed += round(seconds * 1e9)

    def set_wall(self, seconds: float) -> None:
        """The wall clock steps by ``seconds`` (NTP, an operator); no time passes."""
        self.wall += round(seconds * 1e9)

    def system_clock(self) -> SystemClock:
        return SystemClock(wall_ns=lambda: self.wall, elapsed_ns=lambda: self.elapsed)


def test_the_system_clock_follows_the_wall_clock_and_its_steps_forward() -> None:
    """SystemClock reads the wall clock, and follows it when it steps forward."""
    clocks = _Clocks()
    clock = clocks.system_clock()
    start = clock.now_ms()
    assert start == clocks.wall // 1_000_000
    clocks.step(2.5)
    assert clock.now_ms() == start + 2_500
    clocks.set_wall(3_600)
    assert clock.now_ms() == start + 3_602_500


def test_the_system_clock_goes_on_at_the_pace_of_elapsed_time_after_a_step_back() -> None:
    """When the wall clock steps back, SystemClock neither runs back nor stands still: it
    goes on from its last time as time passes, that far ahead of the wall clock."""
    clocks = _Clocks()
    clock = clocks.system_clock()
    start = clock.now_ms()
    clocks.step(1)
    clocks.set_wall(-3_600)  # an hour back
    assert clock.now_ms() == start + 1_000
    clocks.step(5)
    assert clock.now_ms() == start + 6_000  # five seconds later, not an hour
    clocks.set_wall(-10)
    clocks.step(0.25)
    assert clock.now_ms() == start + 6_250
    clocks.step(60)
    assert clock.now_ms() == start + 66_250
    assert clock.now_ms() - clocks.wall // 1_000_000 == 3_610_000  # ahead by both steps


def test_the_system_clock_follows_a_corrected_step_back_without_a_jump() -> None:
    """A step back that is put right later is followed again from there: the clock
    does not jump ahead by the step (which would end every lease early by it)."""
    clocks = _Clocks()
    clock = clocks.system_clock()
    start = clock.now_ms()
    clocks.set_wall(-3_600)
    assert clock.now_ms() == start
    clocks.step(10)
    assert clock.now_ms() == start + 10_000
    clocks.set_wall(3_600)  # put right
    assert clock.now_ms() == start + 10_000
    clocks.step(1)
    assert clock.now_ms() == start + 11_000 == clocks.wall // 1_000_000


def test_a_lease_ends_after_its_ttl_when_the_wall_clock_steps_back() -> None:
    """A 3-second lease on a server whose wall clock steps back an hour ends 3 seconds
    after it was granted, and the held answer's retry_after_seconds says so."""
    clocks = _Clocks()
    service = LeaseService(MemoryStore(clocks.system_clock()))

    async def scenario() -> None:
        await service.start()
        try:
            namespace = (await service.create_namespace()).body["namespace"]
            acquire = {"namespace": namespace, "key": KEY, "ttl_seconds": 3}
            first = await service.handle("acquire", acquire)
            assert first.created
            clocks.step(1)
            clocks.set_wall(-3_600)
            with pytest.raises(LeaseHeld) as held:
                await service.handle("acquire", acquire)
            assert held.value.retry_after_seconds == 2
            clocks.step(2)
            second = await service.handle("acquire", acquire)
            assert second.created
            assert second.body["fencing_token"] > first.body["fencing_token"]
        finally:
            await service.stop()

    asyncio.run(scenario())
