"""Processes under test: start them on free loopback ports, read their CPU time and memory."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stat(pid: int) -> list[str]:
    """``/proc/<pid>/stat``'s fields after the command name (state first)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` now (leasekeeper's SQLite store runs its
    fsync in one: ``store/_syncer.py``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):  # gone meanwhile
                if int(_stat(int(entry.name))[1]) == pid:
                    found.append(int(entry.name))
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of every thread of ``pid`` and of its children
    still running (``/proc/<pid>/stat``): a server's CPU is its helpers' too."""

    def cpu(fields: list[str]) -> float:
        # After the command name: state is field 3, utime field 14, stime field 15.
        return (int(fields[11]) + int(fields[12])) / _TICKS

    total = cpu(_stat(pid))
    for child in children(pid):
        with contextlib.suppress(OSError):  # a child that ended meanwhile
            total += cpu(_stat(child))
    return total


def memory_mb(pid: int) -> tuple[float, float]:
    """(resident set size now, its peak) in MiB of ``pid`` and its children together,
    from ``/proc/<pid>/status`` (the peak is the sum of each one's own)."""

    def read(each: int) -> tuple[float, float]:
        values = {}
        for line in Path(f"/proc/{each}/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                values[name] = int(rest.split()[0]) / 1024
        return values.get("VmRSS", 0.0), values.get("VmHWM", 0.0)

    rss, peak = read(pid)
    for child in children(pid):
        with contextlib.suppress(OSError):  # a child that ended meanwhile
            child_rss, child_peak = read(child)
            rss, peak = rss + child_rss, peak + child_peak
    return rss, peak


@dataclass
class Process:
    """A process under test, its base URL and its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    url: str
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def memory_mb(self) -> tuple[float, float]:
        return memory_mb(self.pid)

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the process's log: the log lives in the run's temporary directory,
        which is gone by the time a message that named it is read."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(its log {self.log} could not be read: {exc})"

    def check_running(self, when: str) -> None:
        """Raise, with the end of the log, if the process has exited."""
        if self.popen.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.popen.returncode} {when}; the end of its "
                f"log:\n{self.log_tail()}"
            )

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def start(
    name: str,
    argv: Sequence[str],
    url: str,
    ready_path: str,
    log: Path,
    env: Mapping[str, str] | None = None,
    *,
    wait: float = 60.0,
    ready_method: str = "GET",
) -> Process:
    """Start ``argv`` and wait until ``url + ready_path`` answers 200."""
    with log.open("ab") as sink:
        popen = subprocess.Popen(
            list(argv), stdout=sink, stderr=sink, env={**os.environ, **(env or {})}
        )
    process = Process(name, popen, url, log)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        process.check_running("before it was ready")
        with contextlib.suppress(httpx.TransportError):
            if httpx.request(ready_method, url + ready_path, timeout=2).status_code == 200:
                return process
        time.sleep(0.1)
    process.stop()
    raise RuntimeError(
        f"{name} did not become ready within {wait:.0f} s; the end of its log:\n"
        f"{process.log_tail()}"
    )


def start_leasekeeper(store: str, workdir: Path, env: Mapping[str, str] | None = None) -> Process:
    """``leasekeeper serve`` on ``store``, as a user would run it (default settings)."""
    port = free_port()
    argv = [sys.executable, "-m", "leasekeeper.cli", "serve", "--port", str(port)]
    argv += ["--store", store]
    url = f"http://127.0.0.1:{port}"
    return start("leasekeeper", argv, url, "/readyz", workdir / "leasekeeper.log", env)


def start_reference(workdir: Path) -> Process:
    """The empty Starlette endpoint on the same uvicorn options (``bench._reference``)."""
    port = free_port()
    argv = [sys.executable, "-m", "bench._reference", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    return start("reference", argv, url, "/ref", workdir / "reference.log")


def start_etcd(etcd: str, workdir: Path) -> Process:
    """One etcd member on loopback with a temporary data directory (fsync on, the default)."""
    client, peer = free_port(), free_port()
    client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    argv = [
        etcd,
        "--name=bench",
        f"--data-dir={workdir / 'etcd-data'}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=bench={peer_url}",
        "--log-level=error",
    ]
    return start("etcd", argv, client_url, "/health", workdir / "etcd.log")
