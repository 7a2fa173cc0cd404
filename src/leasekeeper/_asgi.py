"""What both adapters' POST routes share (the lease routes and ``/mcp``): reading a
request body within its size and time limits, and noticing a client gone."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable, Generator
from typing import Any

from starlette.types import Message, Receive, Scope

from leasekeeper._errors import PayloadTooLarge, RequestTimeout

__all__ = ["ClientGone", "read_body"]


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


async def read_body(
    scope: Scope,
    receive: Receive,
    max_body: int,
    body_timeout: float,
    on_slow: Callable[[], None],
) -> bytes:
    """The request's whole body: at most ``max_body`` bytes (a larger ``Content-Length``
    is refused before reading), all of it within ``body_timeout`` seconds, so that a
    client trickling its body (or lying about its length) cannot hold a connection.

    Raises ``PayloadTooLarge``, ``RequestTimeout`` (after calling ``on_slow``, which
    counts it), or ``ClientGone`` when the client disconnected first.
    """
    for name, value in scope["headers"]:
        if name == b"content-length":
            if value.isdigit() and _larger_than(value, max_body):
                raise PayloadTooLarge(f"Request body is larger than {max_body} bytes")
            break
    # The timer starts when a receive() first has to wait, before which no time has
    # passed: a body that is already there (nearly every request) costs no timer
    # (test_a_body_already_there_is_read_without_a_timer).
    deadline = None
    body = b""
    try:
        while True:
            receiving = receive().__await__()
            try:
                waits_for = receiving.send(None)
            except StopIteration as arrived:
                message = arrived.value
            else:
                if deadline is None:
                    deadline = _Deadline(body_timeout)
                message = await _resume(receiving, waits_for)
            if message["type"] != "http.request":  # http.disconnect
                raise ClientGone
            chunk: bytes = message.get("body", b"")
            body += chunk  # usually one chunk; at most max_body bytes in all
            if len(body) > max_body:
                raise PayloadTooLarge(f"Request body is larger than {max_body} bytes")
            if not message.get("more_body", False):
                return body
    except asyncio.CancelledError:
        if deadline is None or not deadline.stop():
            raise  # cancelled by someone else: never swallowed
    except TimeoutError:
        pass  # receive()'s own timeout: a slow body as well
    finally:
        if deadline is not None:
            deadline.stop()
    on_slow()
    raise RequestTimeout(f"The request body was not received within {body_timeout:g} seconds")


def _larger_than(digits: bytes, limit: int) -> bool:
    """Whether the decimal ``digits`` are a number above ``limit``. The leading zeros go
    first: HTTP allows them, and ``int()`` refuses more than 4,300 digits."""
    significant = digits.lstrip(b"0")
    return len(significant) > len(str(limit)) or int(significant or b"0") > limit


class _Deadline:
    """Cancels the current task ``seconds`` from now unless stopped first: what
    ``asyncio.timeout`` does, as an object ``read_body`` makes only when it must."""

    __slots__ = ("_cancelling", "_expired", "_handle", "_task")

    def __init__(self, seconds: float) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("_Deadline should be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            seconds, self._expire
        )

    def _expire(self) -> None:
        self._expired = True
        self._task.cancel()

    def stop(self) -> bool:
        """Stop the timer, and undo its cancellation of the task (``Task.uncancel``);
        True only when it had expired and nobody else asked to cancel the task."""
        handle = self._handle
        if handle is None:
            return False
        handle.cancel()
        self._handle = None
        if not self._expired:
            return False
        self._expired = False
        return self._task.uncancel() <= self._cancelling


@types.coroutine
def _resume(
    receiving: Generator[Any, None, Message], waits_for: Any
) -> Generator[Any, Any, Message]:
    """Await the rest of ``receiving``, which ran until it yielded ``waits_for``, as
    ``await`` would have: what it yields goes to the task, what the task sends or
    throws in (a cancellation) goes to it."""
    try:
        while True:
            try:
                sent = yield waits_for
            except GeneratorExit:
                receiving.close()
                raise
            except BaseException as exc:
                waits_for = receiving.throw(exc)
            else:
                waits_for = receiving.send(sent)
    except StopIteration as done:
        message: Message = done.value
        return message
