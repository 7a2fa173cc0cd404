"""Owner tokens' randomness: the OS's CSPRNG, read in blocks, never shared across a fork."""

from __future__ import annotations

import os

from leasekeeper._randomness import BlockRandom


def test_reads_the_os_a_block_at_a_time_and_never_repeats_bytes() -> None:
    calls: list[int] = []
    counter = iter(range(1_000_000))

    def urandom(n: int) -> bytes:
        calls.append(n)
        return bytes(next(counter) % 256 for _ in range(n))

    random_bytes = BlockRandom(block=64, urandom=urandom)
    drawn = [random_bytes(32) for _ in range(4)]
    assert calls == [64, 64]
    assert drawn == [
        bytes(range(32)),
        bytes(range(32, 64)),
        bytes(range(64, 96)),
        bytes(range(96, 128)),
    ]
    assert random_bytes(100) == bytes(range(128, 228))  # more than a block: read as asked
    assert calls == [64, 64, 100]


def test_a_forked_child_does_not_hand_out_its_parents_bytes() -> None:
    random_bytes = BlockRandom()
    random_bytes(32)  # the parent has 4,064 unread bytes now
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_end)
        os.write(write_end, random_bytes(32))
        os._exit(0)
    os.close(write_end)
    child = os.read(read_end, 64)
    os.close(read_end)
    os.waitpid(pid, 0)
    assert len(child) == 32
    assert child != random_bytes(32)
