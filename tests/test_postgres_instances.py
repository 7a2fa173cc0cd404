"""Real ``leasekeeper serve`` processes on one PostgreSQL schema, under load and under faults.

Clients pick an instance at random for every request. Every grant and every
accepted renew, release and complete is recorded with the client's send and
receive times; the checks below use only what is certain from those windows, so
they never report a violation that did not happen::

    send ─────[ the server decided somewhere in here ]───── recv
    a holder certainly holds from its grant's recv until the earliest its lease
    can end: min(send + ttl, reported expiry) or the send of its release/complete.

The database runs on this machine, so its clock and the client's agree; the
measured offset (and its uncertainty) is applied anyway.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import drop_schema, import_or_skip, new_schema_name, postgres_url

psycopg = import_or_skip("psycopg")

BASE = "/services/v1"


# -- running servers -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def store_url(url: str, schema: str) -> str:
    """``url`` with the schema as search_path and the schema as application_name."""
    joiner = "&" if "?" in url else "?"
    return f"{url}{joiner}options=-csearch_path%3D{schema}&application_name={schema}"


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen[bytes]
    log: Path


@pytest.fixture
def pg_url() -> str:
    url = postgres_url()
    if url is None:
        pytest.skip("PostgreSQL tests need LEASEKEEPER_TEST_POSTGRES_URL (make test sets it)")
    return url


@pytest.fixture
def schema(pg_url: str) -> Iterator[str]:
    """A schema of this test's own, created empty and dropped at the end."""
    name = new_schema_name()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    yield name
    drop_schema(pg_url, name)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., list[Server]]]:
    """``serve(n, store, **env)`` starts n servers on free 127.0.0.1 ports, ready to serve."""
    started: list[Server] = []
    executable = Path(sys.executable).with_name("leasekeeper")

    def start(count: int, store: str, **env: str) -> list[Server]:
        servers = []
        for _ in range(count):
            port = free_port()
            log = tmp_path / f"server-{port}.log"
            with log.open("wb") as stderr:
                process = subprocess.Popen(
                    [str(executable), "serve", "--host", "127.0.0.1", "--port", str(port)],
                    env={
                        **os.environ,
                        "LEASEKEEPER_STORE": store,
                        "LEASEKEEPER_LOG_LEVEL": "WARNING",
                        **env,
                    },
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )
            server = Server(f"http://127.0.0.1:{port}", process, log)
            started.append(server)
            servers.append(server)
        for server in servers:
            wait_ready(server)
        return servers

    yield start
    for server in started:
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
    for server in started:
        try:
            server.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


def wait_ready(server: Server, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"the server exited:\n{server.log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.base_url}/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    pytest.fail(f"the server did not become ready:\n{server.log.read_text()[-3000:]}")


def clock_offset_ms(url: str) -> tuple[float, float]:
    """(database clock - client clock, uncertainty), both in milliseconds."""
    with psycopg.connect(url) as conn:
        best: tuple[float, float] | None = None
        for _ in range(5):
            sent = time.time() * 1000
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp()) * 1000").fetchone()
            received = time.time() * 1000
            assert row is not None
            estimate = (float(row[0]) - (sent + received) / 2, (received - sent) / 2)
            if best is None or estimate[1] < best[1]:
                best = estimate
        assert best is not None
        return best


# -- the multi-instance run ------------------------------------------------------------------


@dataclass
class Tenure:
    """One grant and what its owner did with it. Times are client milliseconds."""

    key: str
    fence: int
    token: str
    sent: float
    received: float
    #: Bounds on the lease expiry now in force (after the latest accepted renew).
    expiry_low: float
    expiry_high: float
    #: The send time of the accepted release or complete that ended it, if any.
    ended: float | None = None
    #: Each accepted mutation: (kind, sent, received, expiry_high before it).
    mutations: list[tuple[str, float, float, float]] = field(default_factory=list)

    def certain_end(self) -> float:
        return self.expiry_low if self.ended is None else min(self.expiry_low, self.ended)


def expiry_bounds(body: dict[str, Any], sent: float, received: float) -> tuple[float, float]:
    """Bounds on the real lease expiry from a 'held' reply and its request window."""
    # ttl_seconds is the real remaining time rounded down, at the decision instant,
    # which lies in [sent, received]; the reported expiry is the real one rounded down.
    ttl = body["ttl_seconds"] * 1000
    lease = body["lease_expires_at_timestamp"] * 1000
    absolute = body["absolute_expires_at_timestamp"] * 1000
    low = max(lease, sent + ttl)
    high = min(lease + 1000, received + ttl + 1000, absolute + 1000)
    return low, high


class Worker(threading.Thread):
    """Contends for a few keys through random instances until the deadline."""

    def __init__(
        self,
        servers: list[Server],
        namespace: str,
        keys: list[str],
        deadline: float,
        offset: float,
        seed: int,
    ) -> None:
        super().__init__(daemon=True)
        self.clients = [httpx.Client(base_url=s.base_url, timeout=30) for s in servers]
        self.namespace = namespace
        self.keys = keys
        self.deadline = deadline
        self.offset = offset
        self.random = random.Random(seed)
        self.tenures: list[Tenure] = []
        self.operations = 0
        self.statuses: dict[int, int] = defaultdict(int)
        self.stale_refused = 0
        self.failure: BaseException | None = None

    def now(self) -> float:
        """Client time in milliseconds, on the database's clock."""
        return time.time() * 1000 + self.offset

    def post(self, route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], float, float]:
        client = self.random.choice(self.clients)
        sent = self.now()
        response = client.post(f"{BASE}{route}", json={"namespace": self.namespace, **body})
        received = self.now()
        self.operations += 1
        self.statuses[response.status_code] += 1
        return response.status_code, response.json(), sent, received

    def run(self) -> None:
        try:
            while time.monotonic() < self.deadline:
                self.round()
        except BaseException as exc:  # reported by the test
            self.failure = exc
        finally:
            for client in self.clients:
                client.close()

    def round(self) -> None:
        key = self.random.choice(self.keys)
        ttl = self.random.choice([1, 2])
        status, body, sent, received = self.post("/lease", {"key": key, "ttl_seconds": ttl})
        if status != 201:
            time.sleep(self.random.uniform(0.005, 0.05))
            return
        low, high = expiry_bounds(body, sent, received)
        tenure = Tenure(key, body["fencing_token"], body["owner_token"], sent, received, low, high)
        self.tenures.append(tenure)
        for _ in range(self.random.choice([0, 1, 1, 2])):
            time.sleep(self.random.uniform(0.05, 0.4) * ttl)
            before = tenure.expiry_high
            status, body, sent, received = self.post(
                "/lease/renew", {"key": key, "owner_token": tenure.token, "ttl_seconds": ttl}
            )
            if status != 200:
                break
            tenure.expiry_low, tenure.expiry_high = expiry_bounds(body, sent, received)
            tenure.mutations.append(("renew", sent, received, before))
        (ending,) = self.random.choices(["release", "complete", "abandon"], weights=[6, 1, 3])
        if ending != "abandon":
            time.sleep(self.random.uniform(0.0, 0.1))
            route = f"/lease/{ending}"
            extra = {"result": {"fence": tenure.fence}} if ending == "complete" else {}
            before = tenure.expiry_high
            status, _, sent, received = self.post(
                route, {"key": key, "owner_token": tenure.token, **extra}
            )
            if status == 200:
                tenure.ended = sent
                tenure.mutations.append((ending, sent, received, before))
        if self.random.random() < 0.3:
            # A stale owner wakes up: its lease is over (ended or expired) by now.
            time.sleep(max(0.0, (tenure.expiry_high - self.now()) / 1000) + 0.05)
            route = self.random.choice(["/lease/renew", "/lease/release", "/lease/complete"])
            extra = {"result": "stale"} if route.endswith("complete") else {}
            before = tenure.expiry_high
            status, _, sent, received = self.post(
                route, {"key": key, "owner_token": tenure.token, **extra}
            )
            if status == 200:
                tenure.mutations.append((route.rsplit("/", 1)[1], sent, received, before))
            else:
                self.stale_refused += 1


@dataclass
class Verdict:
    double_holders: int = 0
    fence_regressions: int = 0
    stale_mutations: int = 0


def check(tenures: list[Tenure], tolerance: float) -> Verdict:
    """Count violations that the recorded windows prove (never a mere possibility)."""
    verdict = Verdict()
    fences = [t.fence for t in tenures]
    verdict.fence_regressions += len(fences) - len(set(fences))
    by_key: dict[str, list[Tenure]] = defaultdict(list)
    for tenure in tenures:
        by_key[tenure.key].append(tenure)
    for group in by_key.values():
        group.sort(key=lambda t: t.received)
        for a, b in itertools.combinations(group, 2):
            # Two owners certainly holding the key at one instant.
            if max(a.received, b.received) + tolerance < min(a.certain_end(), b.certain_end()):
                verdict.double_holders += 1
            # Grants certainly in this order must have increasing fences.
            for first, then in ((a, b), (b, a)):
                if first.received + tolerance < then.sent and first.fence >= then.fence:
                    verdict.fence_regressions += 1
        for tenure in group:
            ended_at: float | None = None
            for _kind, sent, _received, expiry_high in tenure.mutations:
                newer_owner = any(
                    other.fence > tenure.fence and other.received + tolerance < sent
                    for other in group
                )
                expired = sent > expiry_high + tolerance
                after_end = ended_at is not None and sent > ended_at + tolerance
                if newer_owner or expired or after_end:
                    verdict.stale_mutations += 1
                if _kind in ("release", "complete") and ended_at is None:
                    ended_at = _received
    return verdict


def test_the_checker_finds_what_it_looks_for() -> None:
    """Each kind of violation, planted in a clean history, is counted once."""

    def tenure(fence: int, sent: float, **fields: Any) -> Tenure:
        return Tenure("k", fence, f"t{fence}", sent, sent + 10, sent + 1000, sent + 1010, **fields)

    clean = [tenure(1, 0), tenure(2, 1100, ended=1500), tenure(3, 1600)]
    assert check(clean, tolerance=2) == Verdict()
    overlapping = [tenure(1, 0), tenure(2, 500)]
    assert check(overlapping, tolerance=2).double_holders == 1
    backwards = [tenure(2, 0), tenure(1, 1100)]
    assert check(backwards, tolerance=2).fence_regressions == 1
    late = tenure(1, 0, mutations=[("renew", 1200.0, 1210.0, 1010.0)])
    assert check([late], tolerance=2).stale_mutations == 1
    superseded = tenure(1, 0, mutations=[("release", 900.0, 910.0, 1010.0)])
    assert check([superseded, tenure(2, 500, ended=600)], tolerance=2).stale_mutations == 1


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.parametrize(
    "seconds",
    [pytest.param(8.0, id="8s"), pytest.param(120.0, id="soak-120s", marks=pytest.mark.soak)],
)
def test_two_instances_keep_every_guarantee(
    serve: Callable[..., list[Server]],
    pg_url: str,
    schema: str,
    seconds: float,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two servers on one database, many workers on a few keys: no double holder, ever."""
    servers = serve(
        2,
        store_url(pg_url, schema),
        LEASEKEEPER_LIFECYCLE_SECONDS="3",
        LEASEKEEPER_CLEANUP_INTERVAL_SECONDS="1",
    )
    namespace = httpx.post(f"{servers[0].base_url}{BASE}/lease/namespace", json={}).json()[
        "namespace"
    ]
    keys = [f"job:{n}" for n in range(4)]
    offset, uncertainty = clock_offset_ms(pg_url)
    deadline = time.monotonic() + seconds
    workers = [Worker(servers, namespace, keys, deadline, offset, seed) for seed in range(12)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=seconds + 60)
    for worker in workers:
        assert worker.failure is None, repr(worker.failure)

    tenures = [t for w in workers for t in w.tenures]
    statuses: dict[int, int] = defaultdict(int)
    for worker in workers:
        for status, count in worker.statuses.items():
            statuses[status] += count
    verdict = check(tenures, tolerance=uncertainty + 2)
    operations = sum(w.operations for w in workers)
    accepted = sum(len(t.mutations) for t in tenures)
    with capsys.disabled():
        print(
            f"\nmulti-instance: 2 instances, {len(workers)} workers, {len(keys)} keys, "
            f"{seconds:.0f} s: operations={operations} grants={len(tenures)} "
            f"accepted mutations={accepted} stale attempts refused="
            f"{sum(w.stale_refused for w in workers)} "
            f"double holders={verdict.double_holders} "
            f"fence regressions={verdict.fence_regressions} "
            f"stale mutations accepted={verdict.stale_mutations} "
            f"statuses={dict(sorted(statuses.items()))}"
        )
    assert verdict == Verdict()
    assert not [s for s in statuses if s >= 500]
    assert len(tenures) >= 2 * seconds  # real contention happened
    fences_by_key: dict[str, list[int]] = defaultdict(list)
    for tenure in sorted(tenures, key=lambda t: t.fence):
        fences_by_key[tenure.key].append(tenure.fence)
    assert all(len(f) > 1 for f in fences_by_key.values())


# -- faults under load -----------------------------------------------------------------------


@dataclass
class Call:
    route: str
    status: int
    sent: float
    seconds: float
    retry_after: str | None
    word: str | None


class JobWorker(threading.Thread):
    """Acquires fresh keys and completes them, recording every answer and every ack."""

    def __init__(self, server: Server, namespace: str, number: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.client = httpx.Client(base_url=server.base_url, timeout=30)
        self.namespace = namespace
        self.number = number
        self.stop = stop
        self.calls: list[Call] = []
        self.acknowledged: dict[str, Any] = {}
        self.failure: BaseException | None = None

    def post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        started = time.monotonic()
        response = self.client.post(f"{BASE}{route}", json={"namespace": self.namespace, **body})
        word = response.json().get("status") if response.status_code >= 400 else None
        self.calls.append(
            Call(
                route,
                response.status_code,
                started,
                time.monotonic() - started,
                response.headers.get("retry-after"),
                word,
            )
        )
        return response

    def run(self) -> None:
        try:
            for job in itertools.count():
                if self.stop.is_set():
                    return
                key = f"job:{self.number}:{job}"
                acquired = self.post("/lease", {"key": key, "ttl_seconds": 30})
                if acquired.status_code != 201:
                    time.sleep(0.05)
                    continue
                result = {"job": key, "n": job, "nested": {"b": 2**70, "a": "\u0000"}}
                token = acquired.json()["owner_token"]
                done = self.post(
                    "/lease/complete", {"key": key, "owner_token": token, "result": result}
                )
                if done.status_code == 200:
                    self.acknowledged[key] = done.json()["result"]
        except BaseException as exc:  # reported by the test
            self.failure = exc
        finally:
            self.client.close()


def terminate_backends(url: str, application_name: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s",
            (application_name,),
        ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.postgres
@pytest.mark.slow
def test_killed_and_blocked_database_answers_503_and_recovers(
    serve: Callable[..., list[Server]],
    pg_url: str,
    schema: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Connections killed and the table blocked under load: 503 on time, never 500, no ack lost."""
    timeout = 2.0
    (server,) = serve(1, store_url(pg_url, schema), LEASEKEEPER_STORE_TIMEOUT_SECONDS=str(timeout))
    namespace = httpx.post(f"{server.base_url}{BASE}/lease/namespace", json={}).json()["namespace"]
    stop = threading.Event()
    workers = [JobWorker(server, namespace, n, stop) for n in range(8)]
    for worker in workers:
        worker.start()

    killed = 0
    time.sleep(1.0)
    kill_started = time.monotonic()
    for _ in range(3):
        killed += terminate_backends(pg_url, schema)
        time.sleep(0.7)
    kill_ended = time.monotonic()
    time.sleep(0.5)  # a gap, so that each answer belongs to one fault
    block_started = time.monotonic()
    with psycopg.connect(pg_url) as blocker:
        blocker.execute(f"LOCK TABLE {schema}.leasekeeper_leases IN ACCESS EXCLUSIVE MODE")
        time.sleep(0.5)
        ready_while_blocked = httpx.get(f"{server.base_url}/readyz", timeout=10).status_code
        time.sleep(timeout + 0.5)
        blocker.rollback()
    block_ended = time.monotonic()
    time.sleep(3.0)
    stop.set()
    for worker in workers:
        worker.join(timeout=30)
    for worker in workers:
        assert worker.failure is None, repr(worker.failure)
    ready_after = httpx.get(f"{server.base_url}/readyz", timeout=10).status_code

    calls = sorted((c for w in workers for c in w.calls), key=lambda c: c.sent)
    unavailable = [c for c in calls if c.status == 503]
    others = [c for c in calls if c.status not in (200, 201, 503)]
    recovered = min(
        (c.sent + c.seconds for c in calls if c.sent >= block_ended and c.status < 300),
        default=float("inf"),
    )
    acknowledged = {k: v for w in workers for k, v in w.acknowledged.items()}
    lost = 0
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for key, result in acknowledged.items():
            reply = client.post(f"{BASE}/lease", json={"namespace": namespace, "key": key})
            if reply.status_code != 200 or reply.json().get("result") != result:
                lost += 1
    with capsys.disabled():
        print(
            f"\nfault: requests={len(calls)} ok={sum(c.status < 300 for c in calls)} "
            f"unavailable={len(unavailable)} (while killing "
            f"{sum(kill_started <= c.sent < kill_ended for c in unavailable)}, while blocked "
            f"{sum(block_started <= c.sent < block_ended for c in unavailable)}) "
            f"other errors={len(others)} backends killed={killed} "
            f"max latency={max(c.seconds for c in calls):.2f}s "
            f"recovered {recovered - block_ended:.2f}s after the block "
            f"acknowledged completes verified={len(acknowledged) - lost}/{len(acknowledged)}"
        )
    assert others == []
    assert all(c.retry_after is not None and c.word == "unavailable" for c in unavailable)
    assert max(c.seconds for c in calls) <= timeout + 1.5
    assert any(block_started <= c.sent < block_ended for c in unavailable)
    assert ready_while_blocked == 503
    assert ready_after == 200
    assert recovered - block_ended < 3.0
    assert lost == 0
    assert len(acknowledged) > 50
    # The last second of load was served normally.
    assert all(c.status < 300 for c in calls if c.sent > block_ended + 2.0)
