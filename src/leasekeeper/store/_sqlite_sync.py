"""What keeps the SQLite store's WAL durable and short, off the event loop: ``Syncer``,
the loop's end of the WAL's fsync (which runs in ``_syncer``: why a process, and the
protocol), and ``Checkpointer``, which copies the WAL into the database file.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from leasekeeper._errors import ServiceUnavailable
from leasekeeper.store import _syncer

__all__ = ["Checkpointer", "Files", "Syncer", "open_wal", "report_failure"]

log = logging.getLogger("leasekeeper.store.sqlite")

#: The database and WAL files as opened: (path, (device, inode)) each (``_syncer.moved``).
Files = list[tuple[str, tuple[int, int]]]

#: How long ``Syncer.close(kill=True)`` waits for its killed process, in seconds.
_KILLED_WAIT = 1.0


def open_wal(path: Path) -> tuple[int, Files]:
    """A descriptor of the store's WAL (there from the first read in WAL mode on) for
    the syncer to fsync, and the files' identities; once it is open, nothing may fail."""
    database = str(path.resolve())
    found = os.stat(database)
    wal = os.open(f"{database}-wal", os.O_RDONLY)
    opened = os.fstat(wal)
    return wal, [
        (database, (found.st_dev, found.st_ino)),
        (f"{database}-wal", (opened.st_dev, opened.st_ino)),
    ]


#: What the log says, once, when nothing more can be made durable, by ``kind``.
_REFUSING_ALL = {
    _syncer.MOVED.decode(): "the SQLite store's files were deleted or replaced while it was "
    "open (%s): the lease store refuses every request until leasekeeper is restarted. Put "
    "the file back, or before restarting raise the fencing counter above every token "
    "handed out (leasekeeper fence --raise-to): a new file starts it again",
    _syncer.FSYNC_FAILED.decode(): "fsync of the SQLite WAL failed (%s): the lease store "
    "refuses every request until leasekeeper is restarted; check the disk first",
    "": "the SQLite store's fsync %s: the lease store refuses every request until "
    "leasekeeper is restarted",
}


def report_failure(error: Exception | str, kind: str) -> None:
    """Say why the store refuses every call from now on (``kind``: as ``Syncer``'s)."""
    log.critical(_REFUSING_ALL.get(kind, _REFUSING_ALL[""]), error)


class Syncer:
    """Asks, on the event loop, for fsyncs of the WAL by ``_syncer`` (a process, or a
    thread where none can be started). ``request()`` asks for one that covers a batch
    just committed; they are answered in order, by ``durable(count)`` for the oldest
    ``count`` batches asked for, or else once by ``failed(error, kind)`` (``"M"``: the
    files moved, ``"F"``: an fsync failed, ``""``: the syncer ended), then never again.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        durable: Callable[[int], None],
        failed: Callable[[Exception, str], None],
    ) -> None:
        self._loop = loop
        self._durable = durable
        self._failed = failed
        self._process: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._requests = self._replies = -1
        #: Batches asked for that did not fit in the pipe yet (``request``).
        self._owed = 0
        #: What came after the last ``.``: a failure's line, perhaps not whole yet.
        self._tail = b""
        self._closing = False
        #: ``_readable`` is called when answers come (``_connect`` got that far).
        self._reading = False
        self._ended: asyncio.Future[None] = loop.create_future()

    @classmethod
    async def start(
        cls,
        loop: asyncio.AbstractEventLoop,
        wal: int,
        files: Files,
        durable: Callable[[int], None],
        failed: Callable[[Exception, str], None],
        *,
        process: bool,
        first_fsync_within: float,
    ) -> Syncer:
        """A syncer for the WAL open as ``wal``, whose first fsync has been answered, so
        that one that cannot fsync refuses the store's start (``ServiceUnavailable``).
        A process that cannot start, or ends or says nothing for ``first_fsync_within``
        seconds before its first fsync, leaves the fsync to a thread, with a warning."""

        async def greeted(in_process: bool) -> Syncer:
            syncer = cls(loop, durable, failed)
            await syncer._greet(wal, files, in_process, first_fsync_within)
            return syncer

        if process:
            try:
                return await greeted(True)
            except _NoProcess as exc:
                log.warning("the SQLite WAL is fsynced on a thread: %s", exc)
        return await greeted(False)

    async def _greet(self, wal: int, files: Files, process: bool, within: float) -> None:
        """Connect, and wait for the first fsync; the callbacks are the store's after."""
        durable, failed = self._durable, self._failed
        first: asyncio.Future[tuple[Exception, str] | None] = self._loop.create_future()

        def greeted(count: int) -> None:
            if not first.done():
                first.set_result(None)

        def refused(error: Exception, kind: str) -> None:
            if not first.done():
                first.set_result((error, kind))

        self._durable, self._failed = greeted, refused
        try:
            self._connect(wal, files, process)
            self.request()
            refusal = await asyncio.wait_for(asyncio.shield(first), within)
        except TimeoutError:
            await self.close(kill=True)
            if process:
                raise _NoProcess(f"its process said nothing within {within:g} s") from None
            raise ServiceUnavailable(
                f"Cannot fsync the SQLite store's WAL: no fsync within {within:g} s"
            ) from None
        except (OSError, RuntimeError) as exc:  # no descriptors for its pipes, no threads
            await self.close(kill=True)
            raise ServiceUnavailable(f"Cannot start the SQLite store's fsync: {exc}") from None
        except BaseException:
            await self.close(kill=True)
            raise
        if refusal is not None:
            error, kind = refusal
            await self.close()
            if process and not kind:
                raise _NoProcess(f"its process ended before its first fsync ({error})")
            raise ServiceUnavailable(f"Cannot fsync the SQLite store's WAL: {error}")
        self._durable, self._failed = durable, failed

    def _connect(self, wal: int, files: Files, process: bool) -> None:
        """The pipes, then the process or thread at their other end, then our reader;
        whatever fails on the way leaves nothing of its own open (``close`` the rest)."""
        theirs: list[int] = []
        try:
            requests, self._requests = os.pipe()
            theirs.append(requests)
            self._replies, replies = os.pipe()
            theirs.append(replies)
            if process:
                self._process = self._spawn(requests, replies, wal, files)
            else:
                theirs.append(os.dup(wal))
                thread = threading.Thread(
                    target=_serve_on_thread,
                    args=(requests, replies, theirs[-1], files),
                    name="leasekeeper-sqlite-fsync",
                    daemon=True,
                )
                thread.start()
                self._thread, theirs = thread, []  # it closes them when it ends
            os.set_blocking(self._requests, False)
            os.set_blocking(self._replies, False)
            self._loop.add_reader(self._replies, self._readable)
            self._reading = True
        finally:
            for fd in theirs:
                os.close(fd)

    @staticmethod
    def _spawn(requests: int, replies: int, wal: int, files: Files) -> subprocess.Popen[bytes]:
        script = _syncer.__file__
        if not sys.executable or not script or not script.endswith(".py"):
            raise _NoProcess(f"no Python to run {script}")
        argv = [sys.executable, "-I", "-S", script, *_syncer.arguments(wal, files)]
        try:
            # argv: this Python, our own script, numbers and the store's paths: no shell
            return subprocess.Popen(argv, stdin=requests, stdout=replies, pass_fds=(wal,))  # noqa: S603
        except OSError as exc:
            raise _NoProcess(f"no process started ({exc})") from None

    @property
    def pid(self) -> int | None:
        """The syncer's process, if it is one."""
        return None if self._process is None else self._process.pid

    def request(self) -> None:
        """Ask for an fsync covering every COMMIT so far (answered by ``durable``)."""
        if self._requests < 0:
            return  # closed: close() answers nothing more, the store refuses what waits
        if self._owed:
            self._owed += 1
            return
        try:
            os.write(self._requests, _syncer.BATCH)
        except BlockingIOError:  # the pipe is full: sent as answers make room
            self._owed = 1
        except OSError:  # BrokenPipeError: the syncer has gone
            self._end(RuntimeError(self._how_it_ended()))

    def _readable(self) -> None:
        try:
            data = os.read(self._replies, _syncer.READ_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            self._end(RuntimeError(f"pipe failed ({exc.strerror})"))
            return
        if not data:
            self._end(RuntimeError(self._how_it_ended()))
            return
        if not self._tail:
            synced = len(data) - len(data.lstrip(_syncer.BATCH))
            data = data[synced:]
            if synced:
                self._answer(synced)
        self._tail += data
        if b"\n" in self._tail:
            self._report(self._tail)

    def _answer(self, synced: int) -> None:
        if self._owed:
            owed, self._owed = self._owed, 0
            while owed:  # (answers come only while no failure line has begun)
                try:
                    owed -= os.write(self._requests, _syncer.BATCH * owed)
                except BlockingIOError:
                    break
                except OSError:
                    break  # the syncer has gone: its end of file follows
            self._owed = owed
            if self._closing and not owed:
                self._close_requests()  # close() waited for the owed to be sent
        self._durable(synced)

    def _report(self, line: bytes) -> None:
        """The syncer's line before it ends: a failure to report, once."""
        kind, text = line[:1], line[1:].partition(b"\n")[0]
        if kind == _syncer.FSYNC_FAILED:
            number, _, message = text.partition(b" ")
            error: Exception = OSError(
                int(number) if number.isdigit() else 0, message.decode("utf-8", "replace")
            )
        elif kind == _syncer.MOVED:
            error = RuntimeError(text.decode("utf-8", "surrogateescape"))
        else:
            error = RuntimeError(f"process said {line[:200]!r}")
        self._end(error, kind.decode("ascii", "replace"))

    def _how_it_ended(self) -> str:
        """For the log: the process's exit status tells a crash from a kill (-9: the
        OOM killer, say). Its pipe closes just before it can be reaped, so this waits
        for that a moment (on the loop, but only once: the syncer has gone)."""
        if self._process is None:
            return "thread ended"
        with contextlib.suppress(subprocess.TimeoutExpired):
            return f"process ended (exit status {self._process.wait(0.1)})"
        return "process ended"

    def _end(self, error: Exception, kind: str = "") -> None:
        """No more answers: tell the store why, unless the store itself closed us."""
        if self._ended.done():
            return
        with contextlib.suppress(RuntimeError, ValueError, OSError):  # a loop already closed
            self._loop.remove_reader(self._replies)
        self._ended.set_result(None)
        if not self._closing or kind:
            self._failed(error, kind)

    def _close_requests(self) -> None:
        if self._requests >= 0:
            os.close(self._requests)
            self._requests = -1

    async def close(self, *, kill: bool = False) -> None:
        """End the syncer once it has answered what it was asked (batches still owed
        are sent first), and wait for its process or thread; with ``kill``, at once."""
        self._closing = True
        on_loop = asyncio.get_running_loop() is self._loop
        if kill or not self._owed or not on_loop:
            self._close_requests()  # else _answer closes it once the owed are sent
        if self._process is not None and kill:
            self._process.kill()
        if on_loop and self._reading and not kill and not self._ended.done():
            await asyncio.shield(self._ended)
        else:  # killed, never started, or not on the loop that reads: nobody waits
            self._end(RuntimeError("closed"))
        self._close_requests()
        if self._process is not None:
            # Killed, it may still be in an fsync that waits for a hung disk, where no
            # signal reaches it: not waited for long (subprocess reaps it later).
            wait = functools.partial(self._process.wait, _KILLED_WAIT if kill else None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.get_running_loop().run_in_executor(None, wait)
        if self._thread is not None and not kill:  # (killed: it may be stuck in an fsync)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        if self._replies >= 0:
            os.close(self._replies)
            self._replies = -1


class _NoProcess(Exception):
    """The syncer's process could not be started, or did not work: use a thread."""


def _serve_on_thread(requests: int, replies: int, wal: int, files: Files) -> None:
    """``_syncer.serve`` on a thread, with descriptors of its own that it closes."""
    try:
        _syncer.serve(requests, replies, wal, files)
    except Exception:  # the store hears of it as the end of the replies
        log.exception("the SQLite WAL's fsync thread failed")
    finally:
        for fd in (requests, replies, wal):
            os.close(fd)


#: WAL frames (pages) past which the writer helps the checkpointer (``catch_up``).
_WAL_RESTART_FRAMES = 16_384


class Checkpointer:
    """Copies the WAL into the database file, on a thread and connection of its own.

    SQLite's own checkpoint runs inside the COMMIT that takes the WAL past 1,000 pages,
    and that batch waits for the copy. Instead the store pokes this thread after every
    fsync, and it runs a PASSIVE checkpoint (which neither waits for nor blocks the
    writer) at most every ``interval`` seconds. A WAL starts over only when a write
    begins with every frame checkpointed, which a busy writer never allows: past
    ``_WAL_RESTART_FRAMES`` pages, the writer copies the last few frames itself between
    two batches (``catch_up``), and its next write starts the WAL over. A checkpoint syncs
    the WAL before copying and the file after: a crash loses nothing acknowledged.
    """

    def __init__(self, path: Path, timeout: float, interval: float = 0.02) -> None:
        self._path = path
        self._timeout = timeout
        self._interval = interval
        self._wake = threading.Event()
        self._stopping = threading.Event()
        #: The WAL is long and a pass has just copied all but its newest frames: the
        #: writer should copy those itself, between two batches (``catch_up``).
        self.behind = False
        self._thread = threading.Thread(
            target=self._run, name="leasekeeper-sqlite-checkpoint", daemon=True
        )

    def start(self) -> bool:
        """Connect and start the thread; False (and logged) when it cannot connect."""
        conn: sqlite3.Connection | None = None
        try:
            conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute(f"PRAGMA busy_timeout = {int(self._timeout * 1000)}")
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            log.warning("SQLite checkpoints stay in the writer's commits: %s", exc)
            return False
        self._conn = conn
        self._thread.start()
        return True

    def poke(self) -> None:
        """Something was committed: checkpoint soon."""
        self._wake.set()

    def catch_up(self, conn: sqlite3.Connection) -> None:
        """On the writer's connection, between batches: finish the checkpoint so that the
        next write starts the WAL over."""
        if not self.behind:
            return
        self.behind = False
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as exc:
            log.warning("SQLite checkpoint failed: %s", exc)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        conn = self._conn
        try:
            while True:
                self._wake.wait()
                if self._stopping.is_set():
                    return
                self._wake.clear()
                try:
                    _, frames, _ = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    self.behind = frames > _WAL_RESTART_FRAMES
                except sqlite3.Error as exc:
                    log.warning("SQLite checkpoint failed: %s", exc)
                if self._stopping.wait(self._interval):
                    return
        finally:
            conn.close()
