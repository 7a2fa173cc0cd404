"""The bench's processes under test: a failure to start says what the process logged,
since its log is in the run's temporary directory, gone once the bench has stopped; a
server's CPU time and memory include its children's (the SQLite store's syncer)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench._procs import children, cpu_seconds, memory_mb, start


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


def test_a_servers_cpu_time_and_memory_include_its_childrens(tmp_path: Path) -> None:
    """A parent that sleeps while its child spins: the parent's figure counts the
    child's CPU seconds and adds its memory."""
    ready = tmp_path / "ready"
    child = (
        f"import pathlib, time\npathlib.Path({str(ready)!r}).touch()\n"
        "end = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
        "time.sleep(30)"
    )
    spawn = f"subprocess.Popen([sys.executable, '-c', {child!r}])"
    parent = f"import subprocess, sys, time\n{spawn}\ntime.sleep(30)"
    process = subprocess.Popen([sys.executable, "-c", parent])
    try:
        deadline = time.monotonic() + 20
        while not ready.exists() or not children(process.pid):
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        (kid,) = children(process.pid)
        while cpu_seconds(kid) < 0.5:  # the child spins for half a second of CPU
            assert time.monotonic() < deadline, "the child never spun"
            time.sleep(0.05)
        own = Path(f"/proc/{process.pid}/stat").read_text().rpartition(")")[2].split()
        ticks = os.sysconf("SC_CLK_TCK")
        assert cpu_seconds(process.pid) >= 0.5 > (int(own[11]) + int(own[12])) / ticks
        both, _ = memory_mb(process.pid)
        alone = int(
            next(
                line.split()[1]
                for line in Path(f"/proc/{process.pid}/status").read_text().splitlines()
                if line.startswith("VmRSS:")
            )
        )
        assert both > alone / 1024 + 1  # the child's few MiB on top
    finally:
        for pid in children(process.pid):
            subprocess.run(["kill", str(pid)], check=False)
        process.kill()
        process.wait()
