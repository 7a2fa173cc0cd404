"""Start a real ``leasekeeper serve`` subprocess for tests that need one."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    @property
    def api(self) -> str:
        return self.url + "/services/v1"

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM and wait: a graceful shutdown."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_server(
    store: str,
    log: Path,
    env: Mapping[str, str] | None = None,
    *,
    wait: float = 20.0,
    port: int | None = None,
) -> Server:
    """A server on ``port`` (default a free loopback port), ready to answer; stderr to ``log``."""
    port = port or free_port()
    environ = {**os.environ, "LEASEKEEPER_LOG_LEVEL": "INFO", **(env or {})}
    with log.open("ab") as sink:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "leasekeeper.cli",
                "serve",
                "--port",
                str(port),
                "--store",
                store,
            ],
            stdout=sink,
            stderr=sink,
            env=environ,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {log.read_text()}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return Server(process, url, log)
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"server did not become ready: {log.read_text()}")


@contextlib.contextmanager
def running_server(store: str, log: Path, env: Mapping[str, str] | None = None) -> Iterator[Server]:
    server = start_server(store, log, env)
    try:
        yield server
    finally:
        server.stop()
