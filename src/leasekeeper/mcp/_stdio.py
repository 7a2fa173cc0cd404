"""MCP over stdio, for desktop agents: ``leasekeeper mcp``.

The SDK's stdio transport (mcp 2.3) is handed ``StrictStdin`` in place of stdin: its
own reading is lenient and unbounded, and at the end of stdin it cancels the calls
still running, where ``StrictStdin`` waits for their answers first.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import gc
import io
import logging
import os
import sys
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, cast

import anyio
from mcp import types
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage

from leasekeeper._core.validation import UTF8_BOM
from leasekeeper._service import LeaseService, clean_up_every
from leasekeeper._settings import Settings
from leasekeeper.mcp._jsonrpc import Refusal, id_from_start, id_of, read_message
from leasekeeper.mcp._server import create_mcp_server

__all__ = ["StrictStdin", "serve_stdio"]

log = logging.getLogger("leasekeeper.mcp")


async def serve_stdio(
    service: LeaseService,
    *,
    cleanup_interval_seconds: float | None,
    max_message_bytes: int = Settings().max_body_bytes,
) -> None:
    """Serve MCP over stdin and stdout until stdin closes; opens and closes ``service``.

    With ``cleanup_interval_seconds``, finished lifecycles are deleted that often. Each
    line is checked as ``/mcp`` checks a body, up to ``max_message_bytes``.
    """
    server = create_mcp_server(service)
    stdin = StrictStdin(sys.stdin.fileno(), max_message_bytes)
    peer_gone = False
    await service.start()
    try:
        async with anyio.create_task_group() as tasks:
            if cleanup_interval_seconds is not None:
                tasks.start_soon(
                    functools.partial(
                        clean_up_every, service, cleanup_interval_seconds, sleep=anyio.sleep
                    )
                )
            # stdin is duck-typed: the SDK only iterates it, line by line, as text.
            lines = cast("anyio.AsyncFile[str]", stdin)
            async with stdio_server(stdin=lines) as (read_stream, write_stream):
                answers = stdin.answer_through(write_stream)
                await server.run(read_stream, answers, server.create_initialization_options())
            tasks.cancel_scope.cancel()
    except* BrokenPipeError:  # the peer closed our stdout: nobody reads the answers
        log.warning("stdout is closed (the MCP client went away); stopping")
        peer_gone = True
    except* (anyio.BrokenResourceError, anyio.ClosedResourceError):
        # Stopped (Ctrl-C) with answers on their way: the stop asked for, not a failure.
        if not _stopping():
            raise
    finally:
        await service.stop()
    if peer_gone:
        _drop_unsendable_answers()


def _drop_unsendable_answers() -> None:
    """Collect the SDK's stdout writer now, dropping the ``BrokenPipeError`` its
    finalizer's flush would print to stderr (not the log's JSON); any other is reported.
    """
    report = sys.unraisablehook

    def dropping(unraisable: sys.UnraisableHookArgs) -> None:
        if not (
            issubclass(unraisable.exc_type, BrokenPipeError)
            and isinstance(unraisable.object, io.BufferedWriter | io.TextIOWrapper)
        ):
            report(unraisable)

    sys.unraisablehook = dropping
    try:
        gc.collect()
    finally:
        sys.unraisablehook = report


def _stopping() -> bool:
    """Whether the current task is being cancelled (``asyncio.run`` on Ctrl-C)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class StrictStdin:
    """What the SDK's stdio transport reads instead of stdin (whose reading is lenient,
    unbounded and silent on bad lines): lines read as ``/mcp`` reads a body
    (``read_message``); a refused one, or one over ``max_bytes`` (-32600), is answered
    here with its ``id`` where readable. Blank lines are skipped, a BOM ignored.
    """

    def __init__(self, fd: int, max_bytes: int) -> None:
        self._reader = _FdLines(fd, max_bytes)
        self._max_bytes = max_bytes
        self._answers: Any = None
        self._ready = anyio.Event()
        # Requests handed on, not yet answered, by id (a client may reuse an id).
        self._unanswered: collections.Counter[int | str] = collections.Counter()
        self._answered = anyio.Event()

    def answer_through(self, write_stream: Any) -> _Watched:
        """Send refusals on the SDK's write stream; the returned stream tells each
        answer here."""
        self._answers = write_stream.clone()
        self._ready.set()
        return _Watched(write_stream, self._settled)

    def _settled(self, request_id: object) -> None:
        """One request ``request_id`` (any value a client sent) is answered or cancelled."""
        if (
            isinstance(request_id, int | str)
            and not isinstance(request_id, bool)  # True would settle id 1
            and self._unanswered[request_id] > 0
        ):
            self._unanswered[request_id] -= 1
            if not self._unanswered[request_id]:
                del self._unanswered[request_id]
            self._answered.set()

    async def _drain(self) -> None:
        """Wait, up to ``_DRAIN_SECONDS``, for every request handed on to be answered:
        at the end of stdin the SDK cancels running calls, even ones already decided."""
        with anyio.move_on_after(_DRAIN_SECONDS):
            while self._unanswered:
                await self._answered.wait()
                self._answered = anyio.Event()

    def __aiter__(self) -> AsyncIterator[str]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[str]:
        # A daemon thread of our own: one blocked on stdin must not hold up exit.
        lines: asyncio.Queue[bytes | _TooLong] = asyncio.Queue(maxsize=8)
        loop = asyncio.get_running_loop()

        def deliver(line: bytes | _TooLong) -> bool:
            """Hand ``line`` to the loop; False once the loop is closed or closing."""
            put = lines.put(line)
            try:
                asyncio.run_coroutine_threadsafe(put, loop).result()
            except RuntimeError:  # closed: the coroutine never ran
                put.close()
                return False
            except concurrent.futures.CancelledError:
                return False
            return True

        def pump() -> None:
            line: bytes | _TooLong = _TooLong(b"")
            try:
                while line != b"":
                    try:
                        line = self._reader.readline()
                    except OSError:
                        line = b""
                    if not deliver(line):
                        return
            except Exception:  # never leave the reader waiting for a line that won't come
                log.exception("reading stdin failed")
                deliver(b"")

        threading.Thread(target=pump, name="leasekeeper-mcp-stdin", daemon=True).start()
        try:
            while True:
                line = await lines.get()
                if line == b"":
                    await self._drain()
                    return
                if isinstance(line, _TooLong):
                    too_big = f"Invalid request: the message is larger than {self._max_bytes} bytes"
                    await self._refuse(id_from_start(line.start), types.INVALID_REQUEST, too_big)
                    continue
                line = line.removeprefix(UTF8_BOM)  # ignored, as before a body; the SDK would not
                if not line.strip():
                    continue
                read = read_message(line)
                if isinstance(read, Refusal):
                    await self._refuse(read.id, read.code, read.message)
                    continue
                self._note(read)
                yield line.decode("utf-8")
        finally:
            if self._answers is not None:
                self._answers.close()

    def _note(self, message: Mapping[str, Any]) -> None:
        """Count a request handed on as unanswered; a cancelled one is never answered."""
        request_id = id_of(message)
        if "method" in message and request_id is not None:
            self._unanswered[request_id] += 1
        if message.get("method") == "notifications/cancelled":
            params = message.get("params")
            if isinstance(params, dict):
                self._settled(params.get("requestId"))

    async def _refuse(self, request_id: int | str | None, code: int, message: str) -> None:
        await self._ready.wait()
        error = types.ErrorData(code=code, message=message)
        reply = types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error)
        await self._answers.send(SessionMessage(reply))


#: The longest ``leasekeeper mcp`` waits, at the end of stdin, for answers still due.
_DRAIN_SECONDS: Final = 30.0


class _Watched:
    """The SDK's write stream, telling ``settled`` each answer's id once sent."""

    def __init__(self, stream: Any, settled: Callable[[object], None]) -> None:
        self._stream = stream
        self._settled = settled

    async def send(self, item: SessionMessage, /) -> None:
        await self._stream.send(item)
        if isinstance(item.message, types.JSONRPCResponse | types.JSONRPCError):
            self._settled(item.message.id)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def __aenter__(self) -> _Watched:
        await self._stream.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return cast("bool | None", await self._stream.__aexit__(*exc_info))


#: How much of a line too long to read whole is kept, to find its ``id`` in.
_KEPT_START: Final = 4096


@dataclass(frozen=True, slots=True)
class _TooLong:
    """A line longer than the limit: only its first ``_KEPT_START`` bytes."""

    start: bytes


class _FdLines:
    """Lines read with ``os.read`` (a buffered file's lock, held by a blocked daemon
    thread, is a fatal error at exit)."""

    def __init__(self, fd: int, max_bytes: int) -> None:
        self._fd = fd
        self._max_bytes = max_bytes
        self._buffer = bytearray()

    def readline(self) -> bytes | _TooLong:
        """The next line (``b""`` at the end), or ``_TooLong`` for one over ``max_bytes``
        (read to its end, its start kept)."""
        too_long: _TooLong | None = None
        searched = 0  # the buffer before this holds no newline: each byte is looked at once
        while True:
            end = self._buffer.find(b"\n", searched)
            if end >= 0:
                line = bytes(self._buffer[: end + 1])
                del self._buffer[: end + 1]
                if too_long is None and len(line) > self._max_bytes + 1:
                    too_long = _TooLong(line[:_KEPT_START])
                return line if too_long is None else too_long
            searched = len(self._buffer)
            if len(self._buffer) > self._max_bytes:
                if too_long is None:
                    too_long = _TooLong(bytes(self._buffer[:_KEPT_START]))
                self._buffer.clear()
                searched = 0
            chunk = os.read(self._fd, 65_536)
            if not chunk:  # the end: what is left is the last line, without its newline
                line = bytes(self._buffer)
                self._buffer.clear()
                return line if too_long is None else too_long
            self._buffer += chunk
