"""Test doubles for the client: the in-process app behind httpx, and time that only moves when told.

- ``bridge(api)`` is an ``httpx.MockTransport`` handing each request to the app's
  Starlette ``TestClient`` (which is built on ``httpx2``, not ``httpx``), so the
  client's real httpx code runs against the real app in-process.
- ``FakeTime`` puts the worker's monotonic clock on the store's ``FakeClock``;
  its ``event()`` waits by *advancing* that clock, so a renewal turn of ten
  seconds takes none, and the service sees the same ten seconds pass.
- ``ManualThread`` is a thread that never starts: tests call ``worker.step()``.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, ClassVar

import httpx

from leasekeeper import FakeClock

BASE_URL = "http://testserver"


def bridge(
    api: Any, fault: Callable[[httpx.Request], httpx.Response | None] | None = None
) -> httpx.MockTransport:
    """An httpx transport into ``api``'s app; ``fault(request)`` may answer instead."""

    def handle(request: httpx.Request) -> httpx.Response:
        if fault is not None:
            answer = fault(request)
            if answer is not None:
                return answer
        response = api.client.request(
            request.method,
            request.url.raw_path.decode(),
            content=request.content,
            headers={"content-type": request.headers.get("content-type", "")},
        )
        return httpx.Response(
            response.status_code,
            headers=list(response.headers.multi_items()),
            content=response.content,
        )

    return httpx.MockTransport(handle)


def answer_lost_after_complete(
    api: Any,
) -> Callable[[httpx.Request], httpx.Response | None]:
    """A ``bridge`` fault: the first /lease/complete reaches the app (and is stored), and
    its answer is lost on the way back (a read timeout); everything else is as usual."""
    inner = bridge(api)
    left = [1]

    def fault(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith("/complete") and left[0]:
            left[0] -= 1
            inner.handle_request(request)
            raise httpx.ReadTimeout("the answer was lost", request=request)
        return None

    return fault


class FakeTime:
    """Monotonic seconds on a shared ``FakeClock``; events that wait by advancing it."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        #: Extra seconds the next wait oversleeps (a paused process).
        self.oversleep = 0.0
        self.waits: list[float | None] = []

    def monotonic(self) -> float:
        return self.clock.now_ms() / 1000

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def signal(self) -> FakeSignal:
        return FakeSignal(self)


class FakeEvent:
    """``threading.Event``'s shape; ``wait(t)`` moves the fake clock by ``t`` unless set."""

    def __init__(self, time: FakeTime) -> None:
        self._time = time
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        self._time.waits.append(timeout)
        if not self._set and timeout:
            self._time.clock.advance(timeout + self._time.oversleep)
            self._time.oversleep = 0.0
        return self._set


class FakeSignal(FakeEvent):
    """The async worker's signal on fake time."""

    async def wait(self, seconds: float | None = None) -> bool:  # type: ignore[override]
        return FakeEvent.wait(self, seconds)


def manual_task(coroutine: Coroutine[Any, Any, None]) -> None:
    """A task factory that runs nothing: the test turns the async worker with ``step()``."""
    coroutine.close()


class ManualThread:
    """A thread that never runs by itself: the test turns the worker with ``step()``."""

    instances: ClassVar[list[ManualThread]] = []

    def __init__(self, *, target: Callable[[], object], name: str, daemon: bool) -> None:
        self.target = target
        self.started = False
        ManualThread.instances.append(self)

    def start(self) -> None:
        self.started = True

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return False
