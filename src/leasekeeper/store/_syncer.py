"""The SQLite store's fsync of its WAL, in a process of its own.

The store's event loop COMMITs each batch at ``synchronous=NORMAL``, which hands the
WAL's new pages to the operating system, and answers the batch only once the WAL is
fsynced. The fsync waits for the disk, so it cannot run on the loop, and a thread of
the server would take the GIL back after each of its system calls (its wait for work,
its checks of the files, its fsync), stalling the busy loop each time. This process
holds no GIL of the server's.

The protocol, over two pipes: the store writes one byte for every batch it has
committed. The syncer reads what has arrived, checks that the store's files are still
the ones it opened (``moved``), fsyncs the WAL once for all of those batches (one
fsync covers every COMMIT made before the bytes were written), then answers with as
many ``.`` bytes. When it cannot, it writes one line instead and exits:

- ``M<what>``: the database or WAL file was deleted or replaced (``what`` says which);
- ``F<errno> <message>``: the fsync failed.

It exits at the end of its input (the store closed it, or the server died), and
ignores SIGINT, SIGTERM and SIGHUP, which a Ctrl-C or a service manager sends the whole
process group: the server, answering its last requests, needs its fsync until it
closes the store. It imports only ``os`` and ``signal`` (``sys`` run as a script), to
start fast under ``python -I -S``.
"""

from __future__ import annotations

import os
import signal

#: The largest read: at most this many batches are answered by one fsync.
READ_BYTES = 65536
#: One batch, both ways.
BATCH = b"."
MOVED, FSYNC_FAILED = b"M", b"F"


def sync_data(fd: int) -> None:
    """Make ``fd``'s writes durable as SQLite does: ``fdatasync``, or ``fsync`` where
    there is none (Python has no ``os.fdatasync`` on macOS or Windows; SQLite falls
    back to ``fsync`` where the system lacks ``fdatasync`` too)."""
    data_sync = getattr(os, "fdatasync", None)
    if data_sync is None:
        os.fsync(fd)
    else:
        data_sync(fd)


def moved(wal: int, files: list[tuple[str, tuple[int, int]]]) -> str | None:
    """What became of the store's files since they were opened (deleted, replaced), or
    None. ``wal`` is the WAL's open descriptor, ``files`` each file's path with its
    (device, inode) as opened. Writes to a file no longer at its path are lost at the
    next start, and the fencing counter with them."""
    try:
        if os.fstat(wal).st_nlink == 0:
            return "the -wal file was deleted"
        for name, identity in files:
            try:
                found = os.stat(name)
            except FileNotFoundError:
                return f"{name} was deleted"
            if (found.st_dev, found.st_ino) != identity:
                return f"{name} was replaced"
    except OSError as exc:  # the directory made unreadable, say: nothing can be proved
        return f"the store's files cannot be looked at ({exc.strerror})"
    return None


def serve(requests: int, replies: int, wal: int, files: list[tuple[str, tuple[int, int]]]) -> None:
    """Answer the store until the end of ``requests`` (the protocol: the module's
    docstring), or until a check or an fsync fails."""
    while data := os.read(requests, READ_BYTES):
        what = moved(wal, files)
        if what is not None:
            _write_all(replies, MOVED + what.encode("utf-8", "surrogateescape") + b"\n")
            return
        try:
            sync_data(wal)
        except OSError as exc:
            why = (exc.strerror or str(exc)).encode("utf-8", "backslashreplace")
            _write_all(replies, FSYNC_FAILED + b"%d %s\n" % (exc.errno or 0, why))
            return
        _write_all(replies, BATCH * len(data))


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def arguments(wal: int, files: list[tuple[str, tuple[int, int]]]) -> list[str]:
    """The command line that makes ``main`` call ``serve`` with ``wal`` and ``files``."""
    argv = [str(wal)]
    for name, (device, inode) in files:
        argv += [name, str(device), str(inode)]
    return argv


def main(argv: list[str]) -> None:
    """``python _syncer.py WAL_FD [PATH DEVICE INODE]...``: serve on stdin and stdout."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)
    wal, rest = int(argv[0]), argv[1:]
    files = [(rest[at], (int(rest[at + 1]), int(rest[at + 2]))) for at in range(0, len(rest), 3)]
    try:  # (not contextlib.suppress: the script imports only os and signal)  # noqa: SIM105
        serve(0, 1, wal, files)
    except BrokenPipeError:  # the store went away while an answer was on its way
        pass


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
