"""Contention and crash runs against real server processes, judged by tests/history.py.

Each run prints one summary line (collected in ``conftest.RUN_SUMMARIES`` and shown at
the end of the session). The fast versions run in ``make test``; the long ones are
``soak`` runs (``make soak``): the contention run to 100,000 operations on each store,
the crash loop to 200 kills on SQLite and 100 on PostgreSQL (``LEASEKEEPER_SOAK_SCALE``
does a part of each). Every run is parametrized by store: SQLite, and PostgreSQL with
two service instances.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import sqlite3
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import conftest
from tests._server import Server, free_port, start_server
from tests._stores import STORES, store_target
from tests.history import History, Op, check

ROOT = Path(__file__).resolve().parent.parent


# -- workers -----------------------------------------------------------------------------


@dataclass
class Run:
    """Worker processes writing histories, started with ``tests.workload`` configs."""

    tmp_path: Path
    processes: list[tuple[subprocess.Popen[bytes], Path]] = field(default_factory=list)
    stop_file: Path | None = None

    def start(self, count: int, **config: Any) -> None:
        self.stop_file = self.tmp_path / "stop"
        for i in range(count):
            out = self.tmp_path / f"history-{i}.jsonl"
            path = self.tmp_path / f"worker-{i}.json"
            mine = {"process": f"p{i}", "out": str(out), "stop_file": str(self.stop_file)}
            path.write_text(json.dumps({**config, **mine}))
            with (self.tmp_path / f"worker-{i}.log").open("wb") as log:
                process = subprocess.Popen(
                    [sys.executable, "-m", "tests.workload", str(path)],
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            self.processes.append((process, out))

    def stop(self) -> None:
        if self.stop_file is not None:
            self.stop_file.touch()

    def history(self, timeout: float) -> History:
        deadline = time.monotonic() + timeout
        for process, _ in self.processes:
            try:
                process.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        logs = "".join(p.read_text() for p in sorted(self.tmp_path.glob("worker-*.log")))
        assert all(process.returncode == 0 for process, _ in self.processes), logs
        return History.load([out for _, out in self.processes], offset=_offset())

    def kill_all(self) -> None:
        for process, _ in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)


def _offset() -> float:
    return time.time() - time.monotonic()


@contextlib.contextmanager
def workers(tmp_path: Path) -> Iterator[Run]:
    run = Run(tmp_path)
    try:
        yield run
    finally:
        run.kill_all()


def mint(server: Server) -> str:
    response = httpx.post(f"{server.api}/lease/namespace", timeout=10)
    assert response.status_code == 201, response.text
    return str(response.json()["namespace"])


def server_errors(log: Path) -> list[str]:
    """Log lines at ERROR or above (a 500, a failed batch): none are expected in a run."""
    lines = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            if json.loads(line).get("level") in ("ERROR", "CRITICAL"):
                lines.append(line)
    return lines


# -- contention --------------------------------------------------------------------------


@dataclass(frozen=True)
class Contention:
    processes: int
    threads: int
    #: How long the run lasts; with ``operations``, the most it may last.
    seconds: float
    keys: int
    lifecycle: int
    label: str
    #: Run until this many operations, shared out between the threads.
    operations: int | None = None


FAST_CONTENTION = Contention(processes=4, threads=3, seconds=7, keys=4, lifecycle=3, label="fast")
SOAK_CONTENTION = Contention(
    processes=6,
    threads=4,
    seconds=1500,
    keys=4,
    lifecycle=10,
    label="soak",
    operations=100_000,
)


def contention_run(kind: str, tmp_path: Path, plan: Contention) -> None:
    instances = 2 if kind == "postgres" else 1
    env = {
        "LEASEKEEPER_LIFECYCLE_SECONDS": str(plan.lifecycle),
        "LEASEKEEPER_CLEANUP_INTERVAL_SECONDS": "1",
    }
    quota = {}
    if plan.operations is not None:
        quota["max_ops"] = math.ceil(plan.operations / (plan.processes * plan.threads))
    with store_target(kind, tmp_path) as target, workers(tmp_path) as run:
        logs = [tmp_path / f"server-{i}.log" for i in range(instances)]
        servers = [start_server(target.url, log, env) for log in logs]
        try:
            ns = mint(servers[0])
            run.start(
                plan.processes,
                mode="contention",
                urls=[s.url for s in servers],
                namespace=ns,
                keys=[f"hot-{i}" for i in range(plan.keys)],
                threads=plan.threads,
                duration=plan.seconds,
                seed=random.randrange(1 << 30),
                ttl_min=1,
                ttl_max=2,
                **quota,
            )
            history = run.history(timeout=plan.seconds + 60)
            metrics = httpx.get(servers[0].url + "/metrics", timeout=10).text
        finally:
            for server in servers:
                server.stop()
    result = check(history)
    lifecycles = {
        (op.key, (op.body or {}).get("absolute_expires_at_timestamp"))
        for op in history.ops
        if op.granted
    }
    stale_refused = sum(1 for op in history.ops if op.kind != "acquire" and op.status == 409)
    # Grants to acquires that asked the server to wait and were answered after a while.
    handed_over = sum(
        1 for op in history.ops if op.granted and op.wait and op.end - op.invoke > 0.05
    )
    seconds = max((op.complete or op.invoke for op in history.ops), default=0.0) - min(
        (op.invoke for op in history.ops), default=0.0
    )
    label = (
        f"contention {plan.label} store={kind} instances={instances} processes={plan.processes} "
        f"threads={plan.threads} seconds={seconds:.0f} keys={plan.keys} "
        f"lifecycles={len(lifecycles)} lost_refused={stale_refused} handed_over={handed_over}"
    )
    conftest.RUN_SUMMARIES.append(result.summary(label))
    assert result.violations == [], [str(v) for v in result.violations[:20]]
    assert plan.operations is None or result.operations >= plan.operations, "ran out of time"
    assert result.grants > 0 and result.completes > 0
    # No faults are injected: only a machine too loaded for the 5 s timeouts loses answers.
    assert result.unknown <= result.operations // 100
    assert 'leasekeeper_cleanup_runs_total{result="ok"}' in metrics
    assert [line for log in logs for line in server_errors(log)] == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", STORES)
def test_contention_on_hot_keys_keeps_every_promise(kind: str, tmp_path: Path) -> None:
    """Processes fighting over hot keys with 1-2 s TTLs leave a history with no violation."""
    contention_run(kind, tmp_path, FAST_CONTENTION)


@pytest.mark.soak
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("kind", STORES)
def test_contention_soak(kind: str, tmp_path: Path) -> None:
    """The contention run to 100,000 operations, with more processes and lifecycles."""
    operations = round(100_000 * conftest.soak_scale())
    contention_run(kind, tmp_path, dataclasses.replace(SOAK_CONTENTION, operations=operations))


# -- crash loop --------------------------------------------------------------------------


@dataclass(frozen=True)
class Crash:
    kills: int
    processes: int
    threads: int
    label: str


FAST_CRASH = Crash(kills=3, processes=2, threads=2, label="fast")
SOAK_CRASH = {
    "sqlite": Crash(kills=200, processes=3, threads=4, label="soak"),
    "postgres": Crash(kills=100, processes=3, threads=4, label="soak"),
}


def _states(ops: list[Op]) -> tuple[set[tuple[Any, ...]], list[str]]:
    """Every state one key may be in after its (sequential) operations, and surprises.

    States: ``("free",)`` (never taken, or released), ``("held", token, fence, expiry)``
    (``expiry`` None when a renew's answer was lost), ``("held-by-unknown",)`` (an
    acquire whose answer was lost), ``("completed", result JSON, fence)``.
    """
    states: set[tuple[Any, ...]] = {("free",)}
    surprises: list[str] = []
    for op in sorted(ops, key=lambda op: op.invoke):
        if op.outcome == "fail":
            continue
        body = op.body or {}
        known = op.outcome == "ok"
        if op.kind == "acquire":
            if known and op.status == 201:
                if ("free",) not in states:
                    surprises.append(f"granted while {sorted(states)}")
                states = {("held", op.token, op.fence, body.get("lease_expires_at"))}
            elif not known and ("free",) in states:
                states = states | {("held-by-unknown",)}
            continue
        mine = {s for s in states if s[0] == "held" and s[1] == op.token}
        if not mine:
            if known:
                surprises.append(f"{op.kind} acknowledged for a token that does not hold the key")
            continue
        fence = next(iter(mine))[2]
        if op.kind == "renew":
            after = {("held", op.token, fence, body.get("lease_expires_at") if known else None)}
        elif op.kind == "release":
            after = {("free",)}
        else:
            result = body.get("result") if known else op.result
            after = {("completed", json.dumps(result), fence)}
        states = after if known else states | after
    return states, surprises


@dataclass
class Verified:
    keys: int = 0
    held: int = 0
    completed: int = 0
    free: int = 0
    problems: list[str] = field(default_factory=list)


def verify_after_crashes(history: History, server: Server, ns: str) -> Verified:
    """Probe every key and compare its state with what was acknowledged about it.

    An acknowledged complete must replay its result; an acknowledged grant or renew
    must still hold (same fence and expiry, and its token can release it); an
    acknowledged release must leave the key free; a new grant's fence must be above
    every fence ever acknowledged.
    """
    by_key: dict[str, list[Op]] = defaultdict(list)
    highest = 0
    for op in history.ops:
        by_key[op.key].append(op)
        if op.outcome == "ok" and op.fence is not None:
            highest = max(highest, op.fence)
    verified = Verified(keys=len(by_key))
    lock = threading.Lock()

    def probe(key: str, client: httpx.Client) -> None:
        states, surprises = _states(by_key[key])
        problems = [f"{key}: {s}" for s in surprises]
        body = {"namespace": ns, "key": key, "ttl_seconds": 60, "fingerprint": f"fp-{key}"}
        got = client.post(f"{server.api}/lease", json=body)
        answer = got.json()
        kind = "?"
        if got.status_code == 201:
            kind = "free"
            if ("free",) not in states:
                problems.append(f"{key}: granted, but it was {sorted(states)}")
            if answer["fencing_token"] <= highest:
                problems.append(f"{key}: new fence {answer['fencing_token']} <= {highest}")
        elif got.status_code == 409 and answer["status"] == "held":
            kind = "held"
            fence, expiry = answer["fencing_token"], answer["lease_expires_at"]
            owners = [
                s for s in states if s[0] == "held" and s[2] == fence and s[3] in (None, expiry)
            ]
            if owners:
                owner = {"namespace": ns, "key": key, "owner_token": owners[0][1]}
                released = client.post(f"{server.api}/lease/release", json=owner)
                if released.status_code != 200 or released.json()["fencing_token"] != fence:
                    problems.append(f"{key}: its owner could not release: {released.text}")
            elif ("held-by-unknown",) not in states:
                problems.append(f"{key}: held (fence {fence}), but it was {sorted(states)}")
        elif got.status_code == 200:
            kind = "completed"
            stored = ("completed", json.dumps(answer["result"]), answer["fencing_token"])
            if stored not in states:
                problems.append(f"{key}: completed {stored}, but it was {sorted(states)}")
        else:
            problems.append(f"{key}: unexpected answer {got.status_code} {got.text}")
        with lock:
            verified.problems.extend(problems)
            if kind != "?":
                setattr(verified, kind, getattr(verified, kind) + 1)

    with httpx.Client(timeout=10) as client, ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda key: probe(key, client), sorted(by_key)))
    return verified


def crash_run(kind: str, tmp_path: Path, plan: Crash) -> None:
    rng = random.Random()
    instances = 2 if kind == "postgres" else 1
    with store_target(kind, tmp_path) as target, workers(tmp_path) as run:
        ports = [free_port() for _ in range(instances)]
        log = tmp_path / "server.log"
        servers = [start_server(target.url, log, port=port) for port in ports]
        integrity: list[str] = []
        terminated = in_transaction = 0
        try:
            ns = mint(servers[0])
            run.start(
                plan.processes,
                mode="crash",
                urls=[s.url for s in servers],
                namespace=ns,
                keys=[],
                threads=plan.threads,
                duration=plan.kills * 20 + 30,
                seed=rng.randrange(1 << 30),
            )
            for _ in range(plan.kills):
                time.sleep(rng.uniform(0.3, 1.2))
                if target.kind == "postgres":
                    ended, busy = target.terminate_backends()
                    terminated += ended
                    in_transaction += busy
                    time.sleep(rng.uniform(0.05, 0.3))
                victim = rng.randrange(instances)
                servers[victim].kill()
                integrity.append(target.integrity())
                servers[victim] = start_server(target.url, log, port=ports[victim])
            time.sleep(0.5)
            run.stop()
            history = run.history(timeout=60)
            verified = verify_after_crashes(history, servers[0], ns)
        finally:
            for server in servers:
                server.stop()
    result = check(history)
    label = (
        f"crash {plan.label} store={kind} instances={instances} kills={plan.kills} "
        f"terminated_backends={terminated} (in_transaction={in_transaction}) "
        f"integrity_ok={integrity.count('ok')}/{len(integrity)} "
        f"verified_keys={verified.keys} (held={verified.held} completed={verified.completed} "
        f"free={verified.free}) verify_problems={len(verified.problems)}"
    )
    conftest.RUN_SUMMARIES.append(result.summary(label))
    assert integrity == ["ok"] * plan.kills
    assert server_errors(log) == []
    assert verified.problems == [], verified.problems[:20]
    assert result.violations == [], [str(v) for v in result.violations[:20]]
    assert result.grants > 0 and result.completes > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", STORES)
def test_crash_loop_loses_no_acknowledged_write(kind: str, tmp_path: Path) -> None:
    """SIGKILL under load, restart, repeat: every acknowledged write is still there."""
    crash_run(kind, tmp_path, FAST_CRASH)


@pytest.mark.soak
@pytest.mark.timeout(2700)
@pytest.mark.parametrize("kind", STORES)
def test_crash_loop_soak(kind: str, tmp_path: Path) -> None:
    """The crash loop with 200 kills on SQLite, 100 on PostgreSQL, and more load."""
    plan = SOAK_CRASH[kind]
    kills = max(1, round(plan.kills * conftest.soak_scale()))
    crash_run(kind, tmp_path, dataclasses.replace(plan, kills=kills))


@pytest.mark.slow
def test_the_crash_verifier_notices_lost_writes(tmp_path: Path) -> None:
    """Rows deleted and the fence counter reset behind the server's back are all reported."""
    from tests.history import Recorder

    db = tmp_path / "tampered.db"
    recorder = Recorder("t")
    port = free_port()
    server = start_server(f"sqlite:///{db}", tmp_path / "log", port=port)
    try:
        ns = mint(server)
        with httpx.Client(timeout=10) as client:

            def call(kind: Any, key: str, **body: Any) -> Op:
                body = {"namespace": ns, "key": key, **body}
                return recorder.call(client, server.url, kind, key, body)

            for key in ("done", "held", "free"):
                call("acquire", key, ttl_seconds=3600, fingerprint=f"fp-{key}")
            tokens = {op.key: op.token for op in recorder.ops}
            call("complete", "done", owner_token=tokens["done"], result={"x": 1})
            call("release", "free", owner_token=tokens["free"])
    finally:
        server.stop()
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("DELETE FROM leases")
        conn.execute("UPDATE meta SET value = 0 WHERE name = 'fence'")
        conn.commit()
    server = start_server(f"sqlite:///{db}", tmp_path / "log", port=port)
    try:
        verified = verify_after_crashes(History(recorder.ops), server, ns)
    finally:
        server.stop()
    problems = " | ".join(verified.problems)
    assert "done: granted, but it was [('completed'" in problems
    assert "held: granted, but it was [('held'" in problems
    assert "free: new fence" in problems
