"""The bench's processes under test: a failure to start says what the process logged,
since its log is in the run's temporary directory, gone once the bench has stopped."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from bench._procs import start


def test_a_process_that_never_becomes_ready_is_reported_with_its_log(tmp_path: Path) -> None:
    argv = [
        sys.executable,
        "-c",
        "import time; print('waiting for the store', flush=True); time.sleep(30)",
    ]
    with pytest.raises(RuntimeError, match=r"within 1 s; the end of its log:\nwaiting for"):
        start("server", argv, "http://127.0.0.1:9", "/readyz", tmp_path / "log", wait=1)


def test_a_process_that_exits_at_start_is_reported_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; sys.exit('no such store')"]
    with pytest.raises(RuntimeError, match=r"(?s)exited with 1 before it was ready.*no such store"):
        start("server", argv, "http://127.0.0.1:9", "/readyz", tmp_path / "log", wait=10)
