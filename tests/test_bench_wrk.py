"""``bench._wrk.run_wrk`` turns the line ``lua/common.lua`` prints into a ``Run``. No
load here: a stand-in for wrk prints a given line, and the process under test is a
sleeping child whose CPU time and memory are read as a server's would be."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bench._procs import Process
from bench._wrk import run_wrk


@pytest.fixture
def process(tmp_path: Path) -> Iterator[Process]:
    popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield Process("server", popen, "http://127.0.0.1:1", tmp_path / "server.log")
    finally:
        popen.kill()
        popen.wait()


def fake_wrk(tmp_path: Path, counters: dict[str, int], **errors: int) -> str:
    """An executable that prints what wrk with ``lua/common.lua`` would, once."""
    line = {
        "requests": sum(v for k, v in counters.items() if k.isdigit()),
        "samples": sum(v for k, v in counters.items() if k.isdigit()),
        "duration_us": 2_000_000,
        "bytes": 0,
        "errors": {"connect": 0, "read": 0, "write": 0, "status": 0, "timeout": 0, **errors},
        "latency_us": {"min": 1, "mean": 1.0, "p50": 1, "p90": 1, "p99": 1, "p999": 1, "max": 1},
        "counters": counters,
        "quantiles": [[50, 1], [100, 1]],
    }
    path = tmp_path / "wrk"
    path.write_text(f"#!{sys.executable}\nprint('BENCH_JSON ' + {json.dumps(line)!r})\n")
    path.chmod(0o755)
    return str(path)


def run(wrk: str, process: Process, script: str, **options: Any) -> Any:
    return run_wrk(
        wrk, process, "/", script, target="t", connections=64, seconds=2, args=[], **options
    )


def test_answers_a_workload_never_expects_are_errors_not_operations(
    tmp_path: Path, process: Process
) -> None:
    """A store that answers 503 at once must not gain throughput by failing."""
    wrk = fake_wrk(tmp_path, {"201": 900, "503": 300}, status=300)
    found = run(wrk, process, "acquire")
    assert (found.requests, found.ops, found.errors) == (1_200, 900, 300)
    assert found.ops_per_s == 450
    assert found.requests_per_s == 600


def test_socket_errors_count_as_errors(tmp_path: Path, process: Process) -> None:
    wrk = fake_wrk(tmp_path, {"200": 1_000, "201": 500, "409": 100}, read=2, timeout=3)
    found = run(wrk, process, "cycle")
    assert (found.requests, found.ops, found.errors) == (1_600, 1_600, 5)


def test_a_named_counter_counts_the_operations_when_it_is_given(
    tmp_path: Path, process: Process
) -> None:
    """etcd's acquire is two requests, and only a transaction that succeeded counts."""
    wrk = fake_wrk(tmp_path, {"200": 1_000, "acquired": 480, "404": 10}, status=10)
    found = run(wrk, process, "etcd_acquire", ops_counter="acquired")
    assert (found.requests, found.ops, found.errors) == (1_010, 480, 10)
    assert found.counters == {"acquired": 480}


def test_a_server_that_died_is_reported_with_the_end_of_its_log(
    tmp_path: Path, process: Process
) -> None:
    """Not as a run of connection errors followed by a bare 'connection refused'."""
    process.log.write_text("the store's disk is full\n")
    wrk = fake_wrk(tmp_path, {"201": 10})
    process.popen.kill()
    process.popen.wait()
    with pytest.raises(RuntimeError, match=r"(?s)server exited with -9 before a run.*disk is full"):
        run(wrk, process, "acquire")


def hanging_wrk(tmp_path: Path, hangs: int) -> str:
    """A wrk that hangs its first ``hangs`` runs, then prints a line as ``fake_wrk``'s."""
    printing = fake_wrk(tmp_path, {"201": 100})
    runs = tmp_path / "runs"
    path = tmp_path / "hanging-wrk"
    path.write_text(
        f"#!{sys.executable}\n"
        "import os, pathlib, time\n"
        f"runs = pathlib.Path({str(runs)!r})\n"
        "runs.write_text(runs.read_text() + 'x' if runs.exists() else 'x')\n"
        f"if len(runs.read_text()) <= {hangs}:\n"
        "    time.sleep(60)\n"
        f"os.execv({printing!r}, [{printing!r}])\n"
    )
    path.chmod(0o755)
    return str(path)


def test_a_wrk_that_hangs_is_killed_and_run_once_more(
    tmp_path: Path, process: Process, capsys: pytest.CaptureFixture[str]
) -> None:
    """One hung wrk (it happened once in a whole bench) costs a run again, not the
    quarter of an hour of results before it."""
    found = run(hanging_wrk(tmp_path, hangs=1), process, "acquire", overrun=0.5)
    assert (found.requests, found.ops) == (100, 100)
    assert (
        "wrk ran over its 2 s by 0.5 s and was killed; running it again" in capsys.readouterr().err
    )
    assert (tmp_path / "runs").read_text() == "xx"


def test_a_wrk_that_hangs_twice_fails_the_run(tmp_path: Path, process: Process) -> None:
    with pytest.raises(RuntimeError, match=r"wrk ran over its 2 s by 0\.5 s twice"):
        run(hanging_wrk(tmp_path, hangs=2), process, "acquire", overrun=0.5)
    assert (tmp_path / "runs").read_text() == "xx"
