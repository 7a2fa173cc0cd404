"""``Deadlines``: a store call not answered within its seconds gets 503, with one timer;
one claimed by a batch is that batch's to answer (``Batcher``).

The loop's clock is replaced by a number the test moves: nothing sleeps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from leasekeeper import OutcomeUnknown, ServiceUnavailable
from leasekeeper.store._batcher import Batcher, Deadlines, Request


class ManualLoop:
    """An asyncio loop whose ``time()`` is ``now``, moved by the test.

    Always asyncio's own loop, whatever the event loop policy: uvloop's timers run on
    libuv's clock and never read ``time()``, and uvicorn before 0.36 makes uvloop's
    policy the process's when a test runs a server in process.
    """

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop = asyncio.SelectorEventLoop()
        self.now = 1_000.0
        self.loop.time = lambda: self.now  # type: ignore[method-assign]

    def advance_to(self, when: float) -> None:
        """Set the clock and run whatever that makes due."""
        self.now = when
        for _ in range(3):  # a timer may set the next one: give each its turn
            self.loop.run_until_complete(asyncio.sleep(0))


@pytest.fixture
def manual() -> Iterator[ManualLoop]:
    manual = ManualLoop()
    yield manual
    manual.loop.close()


def expired(future: asyncio.Future[object]) -> bool:
    """Answered 503 with nothing written (not "outcome unknown")."""
    return (
        future.done()
        and isinstance(future.exception(), ServiceUnavailable)
        and not isinstance(future.exception(), OutcomeUnknown)
    )


def watch(deadlines: Deadlines, future: asyncio.Future[object]) -> Request[None]:
    request = Request(None, future)
    deadlines.watch(request)
    return request


def test_each_call_expires_at_its_own_deadline_and_answered_calls_are_left_alone(
    manual: ManualLoop,
) -> None:
    deadlines = Deadlines(5.0)
    first, answered, third = (manual.loop.create_future() for _ in range(3))
    watch(deadlines, first)  # due at 1005
    manual.now = 1_001.0
    watch(deadlines, answered)  # due at 1006
    manual.now = 1_002.0
    watch(deadlines, third)  # due at 1007
    answered.set_result("granted")

    manual.advance_to(1_004.9)
    assert not first.done()
    manual.advance_to(1_005.0)
    assert expired(first)
    assert not third.done()
    manual.advance_to(1_006.5)
    assert answered.result() == "granted"
    assert not third.done()
    manual.advance_to(1_007.0)
    assert expired(third)
    assert str(third.exception()) == "The lease store did not answer in time"


def test_a_call_made_after_the_queue_emptied_sets_the_timer_again(manual: ManualLoop) -> None:
    deadlines = Deadlines(1.0)
    early = manual.loop.create_future()
    watch(deadlines, early)
    manual.advance_to(1_001.0)
    assert expired(early)

    manual.now = 1_010.0
    late = manual.loop.create_future()
    watch(deadlines, late)
    manual.advance_to(1_010.9)
    assert not late.done()
    manual.advance_to(1_011.0)
    assert expired(late)


def test_calls_answered_in_time_never_expire(manual: ManualLoop) -> None:
    deadlines = Deadlines(2.0)
    futures = []
    for step in range(100):  # one call every 0.1 s, each answered at once
        manual.now = 1_000.0 + step / 10
        future = manual.loop.create_future()
        watch(deadlines, future)
        future.set_result(step)
        futures.append(future)
    manual.advance_to(1_020.0)
    assert [future.result() for future in futures] == list(range(100))


def test_a_store_reopened_on_another_loop_expires_calls_there(manual: ManualLoop) -> None:
    deadlines = Deadlines(1.0)
    watch(deadlines, manual.loop.create_future())  # its loop is then closed unrun
    other = ManualLoop()
    try:
        future = other.loop.create_future()
        watch(deadlines, future)
        other.advance_to(1_001.0)
        assert expired(future)
    finally:
        other.loop.close()


def test_a_call_claimed_by_a_batch_is_left_to_it_past_its_deadline(manual: ManualLoop) -> None:
    """At its deadline a claimed call is not answered 503 (its batch may be committing
    it); the batch's own answer, even a late one, is what its caller gets."""
    deadlines = Deadlines(5.0)
    future = manual.loop.create_future()
    request = watch(deadlines, future)
    request.claimed = True
    manual.advance_to(1_006.0)
    assert not future.done()
    future.set_result("granted")
    manual.advance_to(1_020.0)
    assert future.result() == "granted"


def test_a_claimed_call_unanswered_a_timeout_after_its_deadline_has_an_unknown_outcome(
    manual: ManualLoop,
) -> None:
    """A batch stuck past its own bounds (an fsync that hangs) may yet commit: its caller
    is told the outcome is unknown, a second timeout after its deadline, not 503."""
    deadlines = Deadlines(5.0)
    claimed, queued = manual.loop.create_future(), manual.loop.create_future()
    watch(deadlines, claimed).claimed = True
    watch(deadlines, queued)
    manual.advance_to(1_005.0)
    assert expired(queued) and not claimed.done()
    manual.advance_to(1_009.9)
    assert not claimed.done()
    manual.advance_to(1_010.0)
    assert isinstance(claimed.exception(), OutcomeUnknown)
    assert claimed.exception().body()["outcome"] == "unknown"  # type: ignore[union-attr]


def test_a_batch_takes_no_call_past_its_deadline_and_gives_back_only_calls_with_time_left(
    manual: ManualLoop,
) -> None:
    """``take`` answers 503 to a call whose deadline passed before its timer ran, and
    claims the others; given back (nothing written), a call past its deadline gets 503
    and the others wait again, unclaimed, to be answered 503 at their deadline."""
    log = logging.getLogger("test")

    async def run(batch: list[Request[str]]) -> None:
        raise AssertionError("no runner is expected to run here")

    async def main() -> None:
        batcher: Batcher[str] = Batcher(run, timeout_seconds=5.0, max_batch=10, log=log)
        batcher._running = batcher._max_runners  # no runner: the test takes the batches
        old = batcher.submit("old")
        manual.now = 1_002.0
        young = batcher.submit("young")
        manual.now = 1_005.5  # the old call's timer has not run yet
        batch = batcher.take()
        assert [request.item for request in batch] == ["young"]
        assert batch[0].claimed and expired(old)
        manual.now = 1_006.0
        batcher.retry(batch, limit=20)
        assert not young.done() and not batch[0].claimed
        assert list(batcher.pending) == batch
        manual.now = 1_006.5
        again = batcher.take()
        manual.now = 1_007.5  # past its deadline, given back: nothing was written
        batcher.retry(again, limit=20)
        assert expired(young) and not batcher.pending

    manual.loop.run_until_complete(main())
