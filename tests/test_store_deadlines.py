"""``Deadlines``: a store call not answered within its seconds gets 503, with one timer.

The loop's clock is replaced by a number the test moves: nothing sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from leasekeeper import ServiceUnavailable
from leasekeeper.store._batcher import Deadlines


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
    return future.done() and isinstance(future.exception(), ServiceUnavailable)


def test_each_call_expires_at_its_own_deadline_and_answered_calls_are_left_alone(
    manual: ManualLoop,
) -> None:
    deadlines = Deadlines(5.0)
    first, answered, third = (manual.loop.create_future() for _ in range(3))
    deadlines.watch(first)  # due at 1005
    manual.now = 1_001.0
    deadlines.watch(answered)  # due at 1006
    manual.now = 1_002.0
    deadlines.watch(third)  # due at 1007
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
    deadlines.watch(early)
    manual.advance_to(1_001.0)
    assert expired(early)

    manual.now = 1_010.0
    late = manual.loop.create_future()
    deadlines.watch(late)
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
        deadlines.watch(future)
        future.set_result(step)
        futures.append(future)
    manual.advance_to(1_020.0)
    assert [future.result() for future in futures] == list(range(100))


def test_a_store_reopened_on_another_loop_expires_calls_there(manual: ManualLoop) -> None:
    deadlines = Deadlines(1.0)
    deadlines.watch(manual.loop.create_future())  # its loop is then closed unrun
    other = ManualLoop()
    try:
        future = other.loop.create_future()
        deadlines.watch(future)
        other.advance_to(1_001.0)
        assert expired(future)
    finally:
        other.loop.close()
