"""End to end with a real ``leasekeeper serve``: many processes, the lifecycle end.

These start subprocesses (the server on a free 127.0.0.1 port, the CLI) and
take seconds, so they are marked slow.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

pytestmark = pytest.mark.slow

LEASEKEEPER = str(Path(sys.executable).parent / "leasekeeper")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve(directory: Path, **env: str) -> Iterator[str]:
    """A ``leasekeeper serve`` subprocess on a fresh SQLite store; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (directory / "server.log").open("wb")
    process = subprocess.Popen(
        [LEASEKEEPER, "serve", "--port", str(port), "--store", f"sqlite:///{directory}/lk.db"],
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((directory / "server.log").read_text())
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(tmp_path_factory.mktemp("server")) as url:
        yield url


def cli_env(url: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "LEASEKEEPER_URL": url, **extra}
    env["PATH"] = f"{Path(LEASEKEEPER).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def mint(url: str) -> str:
    out = subprocess.run(
        [LEASEKEEPER, "namespace"], env=cli_env(url), capture_output=True, check=True
    )
    return str(orjson.loads(out.stdout)["namespace"])


def test_many_processes_run_the_job_exactly_once(server: str, tmp_path: Path) -> None:
    """Four `run --complete` processes: the job runs once, three report the stored result."""
    env = cli_env(server, LEASEKEEPER_NAMESPACE=mint(server))
    ran = tmp_path / "ran.log"
    command = [LEASEKEEPER, "run", "--key", "nightly", "--fingerprint", "v1", "--ttl", "30",
               "--wait", "60", "--complete", "--",
               "sh", "-c", f"echo ran >> {ran}; sleep 0.5"]  # fmt: skip
    processes = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(4)
    ]
    outputs = [process.communicate(timeout=120) for process in processes]
    assert [p.returncode for p in processes] == [0] * 4, outputs
    assert ran.read_text().splitlines() == ["ran"]
    reports = [orjson.loads(out) for out, _ in outputs if out.strip()]
    assert len(reports) == 3
    for report in reports:
        assert report["skipped"] is True
        assert report["status"] == "completed"
        assert report["result"] == {"exit_code": 0}
    assert all(err == b"" for _, err in outputs)  # quiet in pipes


def test_first_run_errors_name_the_url_and_the_command(server: str, tmp_path: Path) -> None:
    """No service at the URL: the error names the URL tried, never its password (exit 14);
    a command that does not exist: run names it (exit 127)."""
    port = free_port()
    down = subprocess.run(
        [LEASEKEEPER, "run", "--key", "nightly-report", "--", "true"],
        env=cli_env(f"http://cron:hunter2@127.0.0.1:{port}"),
        capture_output=True,
    )
    assert down.returncode == 14, down
    error = orjson.loads(down.stderr)["error"]
    assert error == (
        f"Could not reach the lease service at http://127.0.0.1:{port}"
        "/services/v1/lease (ConnectError)"
    )
    assert b"hunter2" not in down.stdout + down.stderr
    missing = subprocess.run(
        [LEASEKEEPER, "run", "--key", "nightly-report", "--", "nonexistent-cmd"],
        env=cli_env(server, LEASEKEEPER_NAMESPACE=mint(server)),
        capture_output=True,
    )
    assert missing.returncode == 127, missing
    error = orjson.loads(missing.stderr)["error"]
    assert error == 'cannot run "nonexistent-cmd": No such file or directory'


def test_store_output_shows_the_output_as_it_comes_and_later_runs_print_it(
    server: str, tmp_path: Path
) -> None:
    """``run --complete --store-output``: what the command prints reaches run's stdout
    while the command still runs; a later run (another machine) prints the stored output
    without running the command, and exits 0."""
    env = cli_env(server, LEASEKEEPER_NAMESPACE=mint(server))
    go = tmp_path / "go"
    script = f"echo started; while [ ! -e {go} ]; do sleep 0.05; done; echo done"
    command = [LEASEKEEPER, "run", "--key", "teed", "--complete", "--store-output", "--"]
    process = subprocess.Popen(
        [*command, "sh", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None
    readable, _, _ = select.select([process.stdout], [], [], 30)
    assert readable, "nothing on stdout while the command runs"
    assert process.stdout.readline() == b"started\n"
    go.touch()
    rest, errors = process.communicate(timeout=60)
    assert process.returncode == 0, errors
    assert rest == b"done\n"
    later = subprocess.run([*command, "false"], env=env, capture_output=True, timeout=60)
    assert later.returncode == 0, later.stderr
    assert later.stdout == b"started\ndone\n"
    assert orjson.loads(later.stderr)["skipped"] is True


def test_commands_started_with_a_standard_stream_closed(server: str, tmp_path: Path) -> None:
    """Started with stdout closed (``>&-``), where Python has no stream at all, acquire
    says it cannot write the output and releases the lease whose owner token nobody got
    (exit 1), and namespace does not throw a minted secret away with exit 0; with stderr
    closed (as some supervisors start jobs) run runs its command; ``-`` with stdin closed
    is a usage error (2)."""
    env = cli_env(server, LEASEKEEPER_NAMESPACE=mint(server))
    leasekeeper = f"'{LEASEKEEPER}'"

    def shell(command: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            ["bash", "-c", command], env=env, capture_output=True, timeout=60, check=False
        )

    lost = shell(f"{leasekeeper} acquire --key closed-stdout --ttl 600 >&-")
    assert lost.returncode == 1, lost.stderr
    assert lost.stderr == b"leasekeeper: cannot write the output: it is closed\n"
    again = shell(f"{leasekeeper} acquire --key closed-stdout")
    assert again.returncode == 0, again.stderr  # released, not held for 600 s
    minted = shell(f"{leasekeeper} namespace >&-")
    assert minted.returncode == 1, minted.stderr
    ran = tmp_path / "ran"
    quiet = shell(f"{leasekeeper} run --key closed-stderr -- touch '{ran}' 2>&-")
    assert quiet.returncode == 0 and ran.exists(), quiet.stdout
    no_stdin = shell(f"{leasekeeper} acquire --key k --namespace-file - <&-")
    assert no_stdin.returncode == 2
    assert b"--namespace-file: cannot read the file (stdin is closed)" in no_stdin.stderr


# ``run`` as a subreaper (as PID 1 in a container is): orphans of the command become
# its children, and their zombies its to reap. PR_SET_CHILD_SUBREAPER is 36 (Linux).
_AS_SUBREAPER = (
    "import ctypes, sys; ctypes.CDLL(None).prctl(36, 1, 0, 0, 0); "
    "from leasekeeper.cli import main; sys.argv[0] = 'leasekeeper'; main()"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_leftovers_that_become_runs_own_zombies_are_reaped(server: str, tmp_path: Path) -> None:
    """When ``run`` inherits the command's orphans, their zombies (ended on SIGTERM) do
    not keep the group alive: cleanup ends at once instead of waiting out --grace."""
    env = cli_env(server, LEASEKEEPER_NAMESPACE=mint(server))
    pid = tmp_path / "pid"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _AS_SUBREAPER, "run", "--key", "reap", "--grace", "20", "--",
         "sh", "-c", f"sleep 60 & echo $! > {pid}; exit 0"],
        env=env, capture_output=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 15, "waited for --grace on a zombie"
    assert b"left processes in its group" in done.stderr
    assert not Path(f"/proc/{int(pid.read_text())}").exists()


def test_the_lifecycle_end_stops_the_command(tmp_path: Path) -> None:
    """A lease cannot outlive its key's lifecycle: at the end the command is stopped (11)."""
    with serve(tmp_path, LEASEKEEPER_LIFECYCLE_SECONDS="3") as url:
        env = cli_env(url, LEASEKEEPER_NAMESPACE=mint(url))
        started = time.monotonic()
        done = subprocess.run(
            [LEASEKEEPER, "run", "--key", "long", "--ttl", "30", "--grace", "1", "--",
             "sleep", "30"],
            env=env, capture_output=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 11, done.stderr
    assert time.monotonic() - started < 20
    report = orjson.loads(done.stderr.splitlines()[-1])
    assert report["status"] == "lost"
    assert "lifecycle" in report["error"]
    assert report["command"] == "stopped with SIGTERM"


def process_state(pid: int) -> str:
    """The state letter in ``/proc/PID/stat`` (``T``: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def until(condition: Any, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@contextlib.contextmanager
def run_as_a_job(
    argv: list[str], env: dict[str, str], started: Path
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``leasekeeper run ARGV``, once its command has made ``started``: the process and its
    command's pid. Killed and reaped on the way out if it still runs.

    It is started as a shell starts a job: in a process group of its own, whose parent
    (pytest) is in another group of the same session. Otherwise, under a pytest whose
    group is orphaned (``setsid make test``, cron), the kernel would discard the SIGTSTP
    that ``run`` raises on itself, as it must for a group no shell could continue."""
    run = subprocess.Popen(
        [LEASEKEEPER, "run", *argv],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0,
    )  # fmt: skip
    try:
        until(started.exists)
        (command,) = (int(pid) for pid in Path(f"/proc/{run.pid}/task/{run.pid}/children")
                      .read_text().split())  # fmt: skip
        yield run, command
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()  # reaped, its pipes closed


def test_ctrl_z_stops_the_command_with_run(server: str, tmp_path: Path) -> None:
    """SIGTSTP to ``run`` stops the command too, so that no command works on while its
    renewals are stopped; SIGCONT continues it while the lease is held, and once the
    lease expired meanwhile the command gets SIGTERM instead and run exits 11.

    That SIGTERM is the only one: a command that takes its time to stop (this one never
    does) gets SIGKILL --grace seconds after it, not a second SIGTERM from the loss."""
    env = cli_env(server, LEASEKEEPER_NAMESPACE=mint(server))
    ticks = tmp_path / "ticks"
    script = (
        f"trap 'echo term >> {ticks}; stopping=1' TERM; "
        f'while :; do [ -z "$stopping" ] && echo tick >> {ticks}; sleep 0.05; done'
    )
    argv = ["--key", "paused", "--ttl", "2", "--grace", "1", "--", "sh", "-c", script]
    with run_as_a_job(argv, env, ticks) as (run, command):
        os.kill(run.pid, signal.SIGTSTP)
        until(lambda: process_state(run.pid) == "T" and process_state(command) == "T")
        os.kill(run.pid, signal.SIGCONT)  # at once: the lease is still held
        until(lambda: process_state(command) != "T")
        count = len(ticks.read_text().splitlines())
        until(lambda: len(ticks.read_text().splitlines()) > count)
        os.kill(run.pid, signal.SIGTSTP)
        until(lambda: process_state(run.pid) == "T" and process_state(command) == "T")
        stopped_at = len(ticks.read_text().splitlines())
        time.sleep(2.5)  # real processes: the 2 s lease expires while both are stopped
        assert len(ticks.read_text().splitlines()) == stopped_at
        os.kill(run.pid, signal.SIGCONT)
        _, err = run.communicate(timeout=30)
    assert run.returncode == 11, err
    report = orjson.loads(err.splitlines()[-1])
    assert report["status"] == "lost"
    assert report["command"] == "killed with SIGKILL after the grace period"
    # SIGTERM reached the command before it ran again: no tick after it was stopped,
    # and no second SIGTERM.
    assert ticks.read_text().splitlines()[stopped_at:] == ["term"]


def test_a_command_stopping_after_the_loss_gets_no_second_sigterm(
    server: str, tmp_path: Path
) -> None:
    """Once the loss has sent SIGTERM, a Ctrl-Z and fg of run during the grace period
    send no second one (many programs take a second SIGTERM as "skip the clean-up"):
    the command gets SIGKILL --grace seconds after the first."""
    env = cli_env(server, LEASEKEEPER_NAMESPACE=mint(server))
    ticks = tmp_path / "ticks"
    argv = ["--key", "once", "--ttl", "2", "--grace", "4", "--",
            "sh", "-c", f"trap 'echo term >> {ticks}' TERM; echo ready >> {ticks}; "
                        "while :; do sleep 0.05; done"]  # fmt: skip
    with run_as_a_job(argv, env, ticks) as (run, command):
        os.kill(run.pid, signal.SIGSTOP)  # run alone: its renewals stop, the command works on
        until(lambda: process_state(run.pid) == "T")
        time.sleep(2.5)  # real processes: the 2 s lease expires
        os.kill(run.pid, signal.SIGCONT)  # run finds the lease lost: SIGTERM, grace begins
        until(lambda: "term" in ticks.read_text())
        os.kill(run.pid, signal.SIGTSTP)
        until(lambda: process_state(run.pid) == "T" and process_state(command) == "T")
        os.kill(run.pid, signal.SIGCONT)
        _, err = run.communicate(timeout=30)
    assert run.returncode == 11, err
    assert orjson.loads(err.splitlines()[-1])["command"] == (
        "killed with SIGKILL after the grace period"
    )
    assert ticks.read_text().splitlines() == ["ready", "term"]
