"""docs/middleware.md's curl session, run against examples/webhook_middleware.py.

Every ``$ curl`` command of the page's console blocks runs, in order, against the
example (on a free port instead of 8000) in front of a real ``leasekeeper serve``;
every line the page shows after it must appear in what curl printed, in that order
(the page leaves out the ``date``, ``server`` and ``content-length`` headers).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests._server import Server, free_port, start_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "middleware.md"
EXAMPLE = ROOT / "examples" / "webhook_middleware.py"


def session(page: str) -> list[tuple[str, list[str]]]:
    """The page's curl commands (continuation lines joined) and the lines shown after each."""
    steps: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```console[^\n]*\n(.*?)```", page, re.DOTALL):
        command: list[str] | None = None
        for line in block.splitlines():
            if line.startswith("$ ") or (command and command[-1].endswith("\\")):
                if line.startswith("$ "):
                    command = [line[2:]]
                    steps.append(("", []))
                else:
                    assert command is not None
                    command.append(line)
                steps[-1] = ("\n".join(command), steps[-1][1])
            elif steps:
                steps[-1][1].append(line)
    return [(cmd, shown) for cmd, shown in steps if cmd.startswith("curl ")]


def test_the_page_holds_a_session_worth_running() -> None:
    steps = session(PAGE.read_text())
    assert len(steps) >= 6
    assert all("127.0.0.1:8000" in command for command, _ in steps)


def shown_in(shown: list[str], printed: str) -> None:
    """Each non-empty line of ``shown`` is a line of ``printed``, in order; a status line
    matches on its code (the reason phrase depends on the server's Python)."""
    lines = printed.replace("\r\n", "\n").split("\n")
    at = 0
    for want in (line for line in shown if line.strip()):
        for index in range(at, len(lines)):
            got = lines[index]
            if got == want or (want.startswith("HTTP/") and got.split()[:2] == want.split()[:2]):
                at = index + 1
                break
        else:
            pytest.fail(f"{want!r} is not in what curl printed (in order):\n{printed}")


@pytest.fixture
def example(tmp_path: Path) -> Iterator[str]:
    """The example on a free port, in front of its own leasekeeper; yields its URL."""
    server: Server = start_server(f"sqlite:///{tmp_path / 'lk.db'}", tmp_path / "lk.log")
    port = free_port()
    log = (tmp_path / "example.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--port", str(port)],
        env={**os.environ, "LEASEKEEPER_URL": server.url},
        stdout=log,
        stderr=log,
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, (tmp_path / "example.log").read_text()
            assert time.monotonic() < deadline, "the example did not start"
            try:
                if httpx.get(url + "/charges", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(10)
        log.close()
        server.stop()


@pytest.mark.skipif(shutil.which("curl") is None, reason="the session is run with curl")
def test_the_curl_session_of_the_docs_runs_as_shown(example: str) -> None:
    for command, shown in session(PAGE.read_text()):
        done = subprocess.run(
            ["bash", "-c", command.replace("http://127.0.0.1:8000", example)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        shown_in(shown, done.stdout)
