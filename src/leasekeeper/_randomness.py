"""Secret random bytes for namespaces and owner tokens, read from the OS in blocks.

``os.urandom`` is cheap by itself, but it releases the GIL for its system call, and
under load another thread (the SQLite writer) takes the GIL at that moment: the
request then waits for the writer's turn to end. Reading 4 KiB at a time makes
that once per 128 owner tokens instead of once per token. The bytes are the
kernel's CSPRNG output all the same; unread ones stay only in this process's
memory (where the tokens made from them live anyway), are never reused, and are
discarded in a child after ``fork`` so that two processes never hand out the same
token.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

__all__ = ["BlockRandom"]

_INSTANCES: weakref.WeakSet[BlockRandom] = weakref.WeakSet()


class BlockRandom:
    """A ``random_bytes(n)`` callable over ``urandom``, which it calls for ``block`` bytes
    at a time (or ``n``, when more). Thread-safe and fork-safe."""

    def __init__(self, block: int = 4096, urandom: Callable[[int], bytes] = os.urandom) -> None:
        self._block = block
        self._urandom = urandom
        self._lock = threading.Lock()
        self._buffer = b""
        self._at = 0
        _INSTANCES.add(self)

    def __call__(self, n: int) -> bytes:
        with self._lock:
            at = self._at
            if at + n > len(self._buffer):
                self._buffer, at = self._urandom(max(self._block, n)), 0
            self._at = at + n
            return self._buffer[at : at + n]

    def _discard(self) -> None:
        self._lock = threading.Lock()  # a parent's thread may have held it at the fork
        self._buffer, self._at = b"", 0


def _discard_all_in_child() -> None:
    for instance in list(_INSTANCES):
        instance._discard()


os.register_at_fork(after_in_child=_discard_all_in_child)
