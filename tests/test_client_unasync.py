"""The sync client is generated from the async one, so the two cannot drift apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_sync_client_is_what_unasync_writes_from_the_async_one() -> None:
    """client/_sync.py is what scripts/unasync.py writes from client/_async.py."""
    done = subprocess.run(
        [sys.executable, "scripts/unasync.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
