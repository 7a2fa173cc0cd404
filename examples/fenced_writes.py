"""Fenced external writes: a worker that paused past its lease cannot overwrite newer work.

Worker A takes the lease and pauses (a long garbage collection, a stalled VM) until its
lease has expired. Worker B takes the key over with a higher fencing token and writes.
When A wakes up and writes, the protected database refuses its older token, and A's
write is rolled back with the check.

    python examples/fenced_writes.py      # against `make serve`; LEASEKEEPER_URL for another
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import time
from pathlib import Path

from leasekeeper import LeaseClient, StaleFence
from leasekeeper.client import FenceGuard, Lease

URL = os.environ.get("LEASEKEEPER_URL", "http://127.0.0.1:8787")


def pay(db: sqlite3.Connection, guard: FenceGuard, worker: str, fencing_token: int) -> None:
    """The guarded write: the fence check and the write in one transaction."""
    with db:
        guard.check("invoice:4817", fencing_token)  # StaleFence if a newer owner wrote
        db.execute(
            "INSERT OR REPLACE INTO invoices (id, paid_by, fence) VALUES (4817, ?, ?)",
            (worker, fencing_token),
        )


def main() -> None:
    client = LeaseClient(URL)
    namespace = client.create_namespace()
    with tempfile.TemporaryDirectory() as scratch:
        db = sqlite3.connect(Path(scratch) / "billing.db")  # the system the workers write to
        db.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, paid_by TEXT, fence INTEGER)")
        guard = FenceGuard(db)
        guard.create_table()
        db.commit()

        a = client.acquire(namespace, "invoice:4817", ttl=1)  # worker A
        assert isinstance(a, Lease)
        time.sleep(1.5)  # A pauses past its lease
        b = client.acquire(namespace, "invoice:4817", ttl=30)  # worker B takes over
        assert isinstance(b, Lease) and b.fencing_token > a.fencing_token
        pay(db, guard, "B", b.fencing_token)
        client.complete(namespace, "invoice:4817", b.owner_token, {"paid_by": "B"})

        try:
            pay(db, guard, "A", a.fencing_token)  # A wakes up and writes
        except StaleFence as stale:
            print(f"A's write refused: fence {stale.fencing_token} < {stale.current_fence}")
        else:
            raise AssertionError("a stale write went through")

        row = db.execute("SELECT paid_by, fence FROM invoices WHERE id = 4817").fetchone()
        print("invoice 4817:", row)
        assert row == ("B", b.fencing_token)
        db.close()
    client.close()


if __name__ == "__main__":
    main()
