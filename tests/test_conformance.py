"""The store conformance suite: written once against the Store interface, run on every backend.

Each test drives a store with commands and the shared fake clock, and checks the
decisions it returns. ``make_store(kind, like=store)`` stands for a restarted
process (or a second instance) over the same data.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest

from leasekeeper import FakeClock
from leasekeeper._core.model import (
    Acquire,
    Complete,
    CompletedOutcome,
    Conflict,
    Decision,
    Granted,
    Held,
    Lost,
    LostReason,
    Release,
    Released,
    Renew,
    Renewed,
)
from leasekeeper._core.validation import encode_result
from leasekeeper.store import LiveCounter, Store
from tests.conftest import STORE_KINDS, StoreFactory

T = TypeVar("T")

TTL = 60_000
LIFECYCLE = 86_400_000


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def new_id() -> bytes:
    return secrets.token_bytes(32)


@contextlib.asynccontextmanager
async def opened(store: Store) -> AsyncIterator[Store]:
    await store.open()
    try:
        yield store
    finally:
        await store.close()


Body = Callable[[Store], Awaitable[T]]


@pytest.fixture
def on_store(make_store: StoreFactory, store_kind: str) -> Callable[[Body[Any]], Any]:
    """``on_store(body)`` runs ``await body(store)`` on a fresh, opened store of the kind."""

    def run(body: Body[T]) -> T:
        async def main() -> T:
            async with opened(make_store(store_kind)) as store:
                return await body(store)

        return asyncio.run(main())

    return run


async def purge_all(store: Store, limit: int = 100) -> int:
    """One whole walk of ``purge`` steps (as a cleanup takes them): how many records went."""
    total, resume = 0, None
    while True:
        step = await store.purge(limit, resume)
        total += step.deleted
        if step.resume is None:
            return total
        resume = step.resume


async def grant(store: Store, key: bytes, owner: bytes, **fields: Any) -> Granted:
    decision = await store.apply(
        Acquire(
            key,
            fields.get("fingerprint"),
            fields.get("ttl_ms", TTL),
            owner,
            fields.get("lifecycle_ms", LIFECYCLE),
        )
    )
    assert isinstance(decision.outcome, Granted), decision.outcome
    return decision.outcome


async def acquire(
    store: Store, key: bytes, fingerprint: bytes | None = None, *, ttl_ms: int = TTL
) -> Decision:
    return await store.apply(Acquire(key, fingerprint, ttl_ms, new_id(), LIFECYCLE))


def lost(decision: Decision) -> LostReason:
    assert isinstance(decision.outcome, Lost), decision.outcome
    return decision.outcome.reason


# -- one owner at a time ---------------------------------------------------------------------


def test_first_acquire_grants_and_starts_a_lifecycle(on_store: Any, clock: FakeClock) -> None:
    """The first acquisition grants a new owner, a fence, a lease and a 24 h lifecycle."""

    async def body(store: Store) -> None:
        key, owner, fingerprint = new_id(), new_id(), new_id()
        now = clock.now_ms()
        granted = await grant(store, key, owner, fingerprint=fingerprint)
        record = granted.record
        assert granted.now_ms == now
        assert record.key_id == key
        assert record.owner == owner
        assert record.fingerprint == fingerprint
        assert record.fencing_token >= 1
        assert record.lease_expires_ms == now + TTL
        assert record.absolute_expires_ms == now + LIFECYCLE
        assert record.completed_ms is None
        assert record.result is None

    on_store(body)


def test_live_lease_is_held_for_everyone_else(on_store: Any, clock: FakeClock) -> None:
    """While the lease is live, another acquire is told it is held, with the owner's fence."""

    async def body(store: Store) -> None:
        key = new_id()
        first = await grant(store, key, new_id())
        clock.advance(TTL / 1000 - 0.001)
        decision = await acquire(store, key)
        assert isinstance(decision.outcome, Held)
        assert decision.outcome.record.fencing_token == first.record.fencing_token
        assert decision.outcome.record.lease_expires_ms == first.record.lease_expires_ms
        assert decision.outcome.now_ms == clock.now_ms()

    on_store(body)


def test_renew_moves_expiry_and_keeps_fence(on_store: Any, clock: FakeClock) -> None:
    """Renew moves the expiry to now + ttl, capped by the lifecycle, and keeps the fence."""

    async def body(store: Store) -> None:
        key, owner = new_id(), new_id()
        first = await grant(store, key, owner, lifecycle_ms=150_000)
        clock.advance(50)
        decision = await store.apply(Renew(key, owner, TTL))
        assert isinstance(decision.outcome, Renewed)
        renewed = decision.outcome.record
        assert renewed.lease_expires_ms == clock.now_ms() + TTL
        assert renewed.fencing_token == first.record.fencing_token
        clock.advance(50)
        capped = await store.apply(Renew(key, owner, TTL))
        assert isinstance(capped.outcome, Renewed)
        assert capped.outcome.record.lease_expires_ms == first.record.absolute_expires_ms
        assert capped.outcome.record.absolute_expires_ms == first.record.absolute_expires_ms

    on_store(body)


def test_release_frees_the_key_and_keeps_the_binding(on_store: Any, clock: FakeClock) -> None:
    """After release anyone may acquire at once, with a higher fence, same fingerprint only."""

    async def body(store: Store) -> None:
        key, owner, fingerprint = new_id(), new_id(), new_id()
        first = await grant(store, key, owner, fingerprint=fingerprint)
        clock.advance(1)
        released = await store.apply(Release(key, owner))
        assert isinstance(released.outcome, Released)
        assert released.outcome.record.owner is None
        assert released.outcome.record.fencing_token == first.record.fencing_token
        assert isinstance((await acquire(store, key, new_id())).outcome, Conflict)
        second = await grant(store, key, new_id(), fingerprint=fingerprint)
        assert second.record.fencing_token > first.record.fencing_token
        assert second.record.absolute_expires_ms == first.record.absolute_expires_ms

    on_store(body)


def test_expired_lease_goes_to_a_new_owner_with_a_higher_fence(
    on_store: Any, clock: FakeClock
) -> None:
    """Once the lease runs out, the next acquire is a new owner in the same lifecycle."""

    async def body(store: Store) -> None:
        key = new_id()
        first = await grant(store, key, new_id())
        clock.advance(TTL / 1000)
        second = await grant(store, key, new_id())
        assert second.record.fencing_token > first.record.fencing_token
        assert second.record.absolute_expires_ms == first.record.absolute_expires_ms

    on_store(body)


def test_complete_stores_the_result_and_replays_it(on_store: Any, clock: FakeClock) -> None:
    """Complete ends ownership for good; the same fingerprint gets the result, another conflicts."""

    async def body(store: Store) -> None:
        key, owner, fingerprint = new_id(), new_id(), new_id()
        first = await grant(store, key, owner, fingerprint=fingerprint)
        clock.advance(2)
        done = await store.apply(Complete(key, owner, '{"receipt_id":4817}'))
        assert isinstance(done.outcome, CompletedOutcome)
        assert done.outcome.record.completed_ms == clock.now_ms()
        assert done.outcome.record.owner is None
        clock.advance(TTL / 1000 * 5)
        replay = await acquire(store, key, fingerprint)
        assert isinstance(replay.outcome, CompletedOutcome)
        assert replay.outcome.record.result == '{"receipt_id":4817}'
        assert replay.outcome.record.fencing_token == first.record.fencing_token
        assert isinstance((await acquire(store, key, None)).outcome, Conflict)
        assert lost(await store.apply(Renew(key, owner, TTL))) is LostReason.COMPLETED

    on_store(body)


def test_mutations_by_anyone_but_the_live_owner_are_lost(on_store: Any, clock: FakeClock) -> None:
    """Renew, release and complete are refused for the reason the key's state gives."""

    async def body(store: Store) -> None:
        key, owner = new_id(), new_id()
        assert lost(await store.apply(Renew(key, owner, TTL))) is LostReason.NO_LEASE
        await grant(store, key, owner)
        assert lost(await store.apply(Release(key, new_id()))) is LostReason.NOT_OWNER
        assert lost(await store.apply(Complete(key, new_id(), "1"))) is LostReason.NOT_OWNER
        clock.advance(TTL / 1000)
        assert lost(await store.apply(Renew(key, owner, TTL))) is LostReason.EXPIRED
        other = new_id()
        await grant(store, key, other)
        assert lost(await store.apply(Complete(key, owner, "1"))) is LostReason.NOT_OWNER
        await store.apply(Release(key, other))
        assert lost(await store.apply(Renew(key, other, TTL))) is LostReason.RELEASED
        clock.advance(LIFECYCLE / 1000)
        assert lost(await store.apply(Release(key, other))) is LostReason.NO_LEASE

    on_store(body)


def test_a_clock_stepping_back_does_not_revive_an_expired_lease(
    on_store: Any, clock: FakeClock
) -> None:
    """The store keeps the latest decision time, so a wall clock going back changes nothing."""

    async def body(store: Store) -> None:
        key, owner = new_id(), new_id()
        await grant(store, key, owner, ttl_ms=10_000)
        clock.advance(11)
        assert lost(await store.apply(Renew(key, owner, TTL))) is LostReason.EXPIRED
        clock.jump_back(5)
        assert lost(await store.apply(Renew(key, owner, TTL))) is LostReason.EXPIRED

    on_store(body)


# -- lifecycles, fences, cleanup, restarts ---------------------------------------------------


def test_a_new_lifecycle_starts_fresh_with_a_higher_fence(on_store: Any, clock: FakeClock) -> None:
    """After absolute expiry the key is as if never seen: new binding, no result, higher fence."""

    async def body(store: Store) -> None:
        key, owner, fingerprint = new_id(), new_id(), new_id()
        first = await grant(store, key, owner, fingerprint=new_id())
        await store.apply(Complete(key, owner, '"done"'))
        clock.advance(LIFECYCLE / 1000 + 7)  # later than the end: counted from now, not from it
        fresh = await grant(store, key, new_id(), fingerprint=fingerprint)
        assert fresh.record.fencing_token > first.record.fencing_token
        assert fresh.record.absolute_expires_ms == clock.now_ms() + LIFECYCLE
        assert fresh.record.completed_ms is None
        assert fresh.record.result is None
        # What was stored is that fresh record, not one with the old completion left in.
        again = await store.apply(Acquire(key, fingerprint, TTL, new_id(), LIFECYCLE))
        assert isinstance(again.outcome, Held), again.outcome
        assert again.outcome.record == fresh.record

    on_store(body)


def test_fences_increase_store_wide(on_store: Any, clock: FakeClock) -> None:
    """Every new owner, on any key, gets a token higher than every token before it."""

    async def body(store: Store) -> None:
        keys = [new_id() for _ in range(5)]
        fences = []
        for _ in range(3):
            for key in keys:
                fences.append((await grant(store, key, new_id(), ttl_ms=1000)).record.fencing_token)
            clock.advance(1)
        assert fences == sorted(fences)
        assert len(set(fences)) == len(fences)

    on_store(body)


def test_purge_deletes_exactly_the_records_whose_lifecycle_is_over(
    on_store: Any, clock: FakeClock
) -> None:
    """Purge takes records at or past their absolute expiry, up to the limit, and no others."""

    async def body(store: Store) -> None:
        assert await purge_all(store) == 0
        early, completed, later = new_id(), new_id(), new_id()
        await grant(store, early, new_id(), lifecycle_ms=10_000)
        owner = new_id()
        await grant(store, completed, owner, lifecycle_ms=20_000)
        await store.apply(Complete(completed, owner, "[1]"))
        clock.advance(5)
        await grant(store, later, new_id(), lifecycle_ms=10_000)
        clock.advance(4.999)
        assert await purge_all(store) == 0
        clock.advance(ms=1)  # exactly at the first absolute expiry: over
        assert await purge_all(store) == 1
        assert await purge_all(store) == 0
        replay = await acquire(store, completed)
        assert isinstance(replay.outcome, CompletedOutcome)
        clock.advance(5)
        assert await purge_all(store) == 1
        clock.advance(5)
        assert await purge_all(store) == 1
        assert await purge_all(store) == 0

    on_store(body)


def test_purge_walks_in_bounded_steps(on_store: Any, clock: FakeClock) -> None:
    """Each step deletes at most ``limit`` records and says where the next one starts; the
    walk ends with every finished record gone and the live one kept."""

    async def body(store: Store) -> None:
        for _ in range(5):
            await grant(store, new_id(), new_id(), lifecycle_ms=1000)
        live = new_id()
        await grant(store, live, new_id(), lifecycle_ms=5000)
        clock.advance(1)
        deleted: list[int] = []
        resume: bytes | None = None
        while True:
            step = await store.purge(2, resume)
            assert 0 <= step.deleted <= 2
            deleted.append(step.deleted)
            if step.resume is None:
                break
            resume = step.resume
        assert sum(deleted) == 5
        assert len(deleted) >= 3
        assert await purge_all(store) == 0
        assert isinstance((await acquire(store, live)).outcome, Held)

    on_store(body)


def test_grants_decided_together_on_one_key_get_rising_fences(on_store: Any) -> None:
    """Acquire, release, acquire, release, acquire of one key, submitted together (one
    batch on the stores that batch): three owners, each with a higher fence than the
    one before, and the key is held by the last of them."""

    async def body(store: Store) -> None:
        key, owners = new_id(), [new_id() for _ in range(3)]
        decisions = await asyncio.gather(
            store.apply(Acquire(key, None, TTL, owners[0], LIFECYCLE)),
            store.apply(Release(key, owners[0])),
            store.apply(Acquire(key, None, TTL, owners[1], LIFECYCLE)),
            store.apply(Release(key, owners[1])),
            store.apply(Acquire(key, None, TTL, owners[2], LIFECYCLE)),
        )
        grants = [d.outcome for d in decisions[::2] if isinstance(d.outcome, Granted)]
        assert len(grants) == 3, decisions
        assert all(isinstance(d.outcome, Released) for d in decisions[1::2])
        fences = [g.record.fencing_token for g in grants]
        assert fences[0] < fences[1] < fences[2], fences
        held = await acquire(store, key)
        assert isinstance(held.outcome, Held)
        assert held.outcome.record.fencing_token == fences[2]
        assert held.outcome.record.owner == owners[2]

    on_store(body)


def test_instances_sharing_a_store_draw_fences_from_one_counter(
    make_store: StoreFactory, store_kind: str
) -> None:
    """Two store instances over the same data (two servers on one SQLite file, two
    service instances on one database) take turns granting: every grant is above every
    grant before it, whichever instance made it, on the same key and on others."""

    async def main() -> None:
        first = make_store(store_kind)
        second = make_store(store_kind, like=first)
        async with opened(first), opened(second):
            key, fences = new_id(), []
            for store in (first, second, first, second, second, first):
                owner = new_id()
                fences.append((await grant(store, key, owner)).record.fencing_token)
                await store.apply(Release(key, owner))
                fences.append((await grant(store, new_id(), new_id())).record.fencing_token)
            assert fences == sorted(fences), fences
            assert len(set(fences)) == len(fences), fences

    asyncio.run(main())


def test_a_purge_walk_goes_on_past_steps_that_delete_nothing(
    on_store: Any, clock: FakeClock
) -> None:
    """A step that finds only live records is not the end of the walk: a cleanup that
    stopped there would leave every finished record behind it in the store for good.
    (Key ids that sort first hold live leases, the last one a finished lifecycle.)"""

    async def body(store: Store) -> None:
        for n in range(1, 7):
            await grant(store, bytes([n]) + new_id()[1:], new_id(), lifecycle_ms=60_000)
        finished = b"\xff" + new_id()[1:]
        await grant(store, finished, new_id(), lifecycle_ms=1000)
        clock.advance(1)
        assert await purge_all(store, limit=2) == 1
        assert await purge_all(store, limit=2) == 0
        assert isinstance(store, LiveCounter)
        assert await store.count_live() == 6

    on_store(body)


def test_fences_never_go_back_after_purge_or_restart(
    make_store: StoreFactory, store_kind: str, clock: FakeClock
) -> None:
    """Deleting every record and restarting the store keeps the counter above every fence."""

    async def main() -> None:
        key, owner = new_id(), new_id()
        store = make_store(store_kind)
        async with opened(store):
            highest = (await grant(store, key, owner, lifecycle_ms=1000)).record.fencing_token
            await store.apply(Complete(key, owner, '{"kept":true}'))
            other_key, other_owner = new_id(), new_id()
            await grant(store, other_key, other_owner)
            clock.advance(1)
            assert await purge_all(store) == 1
            regrant = await grant(store, key, new_id(), lifecycle_ms=1000)
            assert regrant.record.fencing_token > highest + 1
            highest = regrant.record.fencing_token
        async with opened(make_store(store_kind, like=store)) as again:
            renewed = await again.apply(Renew(other_key, other_owner, TTL))
            assert isinstance(renewed.outcome, Renewed)
            clock.advance(1)
            assert await purge_all(again) == 1
            assert (await grant(again, key, new_id())).record.fencing_token > highest

    asyncio.run(main())


def test_raising_the_fence_counter_never_lowers_it_and_lasts(
    make_store: StoreFactory, store_kind: str, clock: FakeClock
) -> None:
    """``raise_fence`` moves the counter up, never down; the next grant is above it, and
    so is every grant after a purge or a restart."""

    async def main() -> None:
        key = new_id()
        store = make_store(store_kind)
        async with opened(store):
            assert await store.raise_fence(0) == 0  # reads a fresh store's counter
            first = (await grant(store, key, new_id(), lifecycle_ms=1000)).record.fencing_token
            assert await store.raise_fence(0) == first
            assert await store.raise_fence(first - 1) == first
            assert await store.raise_fence(first + 1000) == first + 1000
            assert await store.raise_fence(first + 10) == first + 1000
            clock.advance(1)  # the lease ends: the next acquire is a new owner
            again = (await grant(store, key, new_id(), lifecycle_ms=1000)).record
            assert again.fencing_token == first + 1001
            clock.advance(1)
            assert await purge_all(store) == 1
            assert await store.raise_fence(5) == first + 1001
        async with opened(make_store(store_kind, like=store)) as reopened:
            assert await reopened.raise_fence(first + 5000) == first + 5000
        async with opened(make_store(store_kind, like=store)) as last:
            assert await last.raise_fence(0) == first + 5000
            assert (await grant(last, key, new_id())).record.fencing_token == first + 5001

    asyncio.run(main())


def test_records_survive_a_restart(
    make_store: StoreFactory, store_kind: str, clock: FakeClock
) -> None:
    """A closed and reopened store answers from the same records."""

    async def main() -> None:
        done, held, owner = new_id(), new_id(), new_id()
        fingerprint = new_id()
        store = make_store(store_kind)
        async with opened(store):
            first = await grant(store, done, owner, fingerprint=fingerprint)
            await store.apply(Complete(done, owner, '{"b":1,"a":2}'))
            live = await grant(store, held, new_id())
        async with opened(make_store(store_kind, like=store)) as again:
            replay = await acquire(again, done, fingerprint)
            assert isinstance(replay.outcome, CompletedOutcome)
            assert replay.outcome.record.result == '{"b":1,"a":2}'
            assert replay.outcome.record.fencing_token == first.record.fencing_token
            busy = await acquire(again, held)
            assert isinstance(busy.outcome, Held)
            assert busy.outcome.record == live.record

    asyncio.run(main())


# -- the live-lease count --------------------------------------------------------------------


def test_count_live_counts_the_leases_held_at_the_stores_now(
    on_store: Any, clock: FakeClock
) -> None:
    """``count_live`` (the leasekeeper_live_leases gauge) counts the leases an owner holds
    now: not released, completed or expired ones, nor one at its very expiry."""

    async def body(store: Store) -> None:
        assert isinstance(store, LiveCounter)
        assert await store.count_live() == 0
        owners = {new_id(): new_id() for _ in range(6)}
        for key, owner in owners.items():
            await grant(store, key, owner)
        short = new_id()
        await grant(store, short, new_id(), ttl_ms=1000)
        assert await store.count_live() == 7
        keys = list(owners)
        await store.apply(Release(keys[0], owners[keys[0]]))
        await store.apply(Complete(keys[1], owners[keys[1]], "null"))
        assert await store.count_live() == 5
        clock.advance(ms=999)
        assert await store.count_live() == 5
        clock.advance(ms=1)  # exactly at its expiry: no longer held
        assert await store.count_live() == 4
        renewed = await store.apply(Renew(keys[2], owners[keys[2]], 2 * TTL))
        assert isinstance(renewed.outcome, Renewed)
        clock.advance(TTL / 1000)  # the other leases run out; the renewed one is held
        assert await store.count_live() == 1
        await grant(store, short, new_id())  # an expired lease, taken by a new owner
        assert await store.count_live() == 2
        clock.advance(LIFECYCLE / 1000)
        assert await purge_all(store) == 7
        assert await store.count_live() == 0

    on_store(body)


# -- results ---------------------------------------------------------------------------------

RESULTS = [
    '"\\u0000"',
    '{"z":1,"a":2,"m":{"y":[],"b":{}}}',
    str(2**70),
    str(-(2**70)),
    '{"a":"\\u0000x","big":1180591620717411303424,"f":-0.5,"e":1e-7,"t":true,"n":null}',
    '"é😀 \\"quoted\\" \\\\ \\n"',
    "null",
    "0",
    '""',
    "[]",
    "{}",
    '"' + "x" * 32_000 + '"',
]


@pytest.mark.parametrize("result", RESULTS, ids=range(len(RESULTS)))
def test_results_round_trip_exactly(make_store: StoreFactory, store_kind: str, result: str) -> None:
    """A stored result comes back byte for byte: NUL escapes, key order, big integers."""

    async def main() -> None:
        key, owner = new_id(), new_id()
        store = make_store(store_kind)
        async with opened(store):
            await grant(store, key, owner)
            done = await store.apply(Complete(key, owner, result))
            assert isinstance(done.outcome, CompletedOutcome)
            assert done.outcome.record.result == result
        async with opened(make_store(store_kind, like=store)) as again:
            replay = await acquire(again, key)
            assert isinstance(replay.outcome, CompletedOutcome)
            assert replay.outcome.record.result == result

    asyncio.run(main())


def test_encoded_results_round_trip(on_store: Any) -> None:
    """What the service encodes for storage is exactly what the store gives back."""
    value = {"b": "\x00", "a": [2**70, {"password": "x", "y": 1.5}], "é": "😀"}
    text = encode_result(value)

    async def body(store: Store) -> None:
        key, owner = new_id(), new_id()
        await grant(store, key, owner)
        await store.apply(Complete(key, owner, text))
        replay = await acquire(store, key)
        assert isinstance(replay.outcome, CompletedOutcome)
        assert replay.outcome.record.result == text

    on_store(body)


# -- concurrency -----------------------------------------------------------------------------


async def warm_up(*stores: Store) -> None:
    """Concurrent work on other keys first, so that pooled stores have connections to race on."""
    for _ in range(3):
        await asyncio.gather(*(acquire(s, new_id()) for s in stores for _ in range(32)))


def test_concurrent_acquires_grant_exactly_one_owner(on_store: Any) -> None:
    """64 concurrent acquisitions of one key: one grant, 63 told it is held by that grant."""

    async def body(store: Store) -> None:
        key = new_id()
        await warm_up(store)
        decisions = await asyncio.gather(*(acquire(store, key) for _ in range(64)))
        grants = [d.outcome for d in decisions if isinstance(d.outcome, Granted)]
        held = [d.outcome for d in decisions if isinstance(d.outcome, Held)]
        assert len(grants) == 1
        assert len(held) == 63
        assert {h.record.fencing_token for h in held} == {grants[0].record.fencing_token}

    on_store(body)


def test_two_instances_on_one_store_grant_exactly_one_owner(
    make_store: StoreFactory, store_kind: str, clock: FakeClock
) -> None:
    """Two store instances over the same data, racing on a key, new or expired, grant it once."""

    async def race(stores: tuple[Store, Store], key: bytes) -> Granted:
        decisions = await asyncio.gather(*(acquire(s, key) for _ in range(32) for s in stores))
        grants = [d.outcome for d in decisions if isinstance(d.outcome, Granted)]
        assert len(grants) == 1
        assert sum(isinstance(d.outcome, Held) for d in decisions) == 63
        return grants[0]

    async def main() -> None:
        first = make_store(store_kind)
        second = make_store(store_kind, like=first)
        async with opened(first), opened(second):
            key = new_id()
            await warm_up(first, second)
            created = await race((first, second), key)
            clock.advance(TTL / 1000)
            taken = await race((first, second), key)
            assert taken.record.fencing_token > created.record.fencing_token

    asyncio.run(main())


def test_concurrent_owners_on_many_keys_keep_fences_unique(on_store: Any) -> None:
    """Concurrent grants on different keys never share a fencing token."""

    async def body(store: Store) -> None:
        decisions = await asyncio.gather(*(acquire(store, new_id()) for _ in range(100)))
        fences = [
            d.outcome.record.fencing_token for d in decisions if isinstance(d.outcome, Granted)
        ]
        assert len(fences) == 100
        assert len(set(fences)) == 100

    on_store(body)


def test_concurrent_acquires_of_an_expired_lease_grant_exactly_one_owner(
    on_store: Any, clock: FakeClock
) -> None:
    """64 concurrent acquisitions of a key whose lease ran out: one new owner, one new fence."""

    async def body(store: Store) -> None:
        key = new_id()
        first = await grant(store, key, new_id())
        clock.advance(TTL / 1000)
        await warm_up(store)
        decisions = await asyncio.gather(*(acquire(store, key) for _ in range(64)))
        grants = [d.outcome for d in decisions if isinstance(d.outcome, Granted)]
        assert len(grants) == 1
        assert grants[0].record.fencing_token > first.record.fencing_token
        assert sum(isinstance(d.outcome, Held) for d in decisions) == 63

    on_store(body)
