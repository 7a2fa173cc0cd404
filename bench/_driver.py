"""The benchmark's command line and plan: what runs, in which order, for how long.

For each store (one server process each, a fresh database each)::

    empty store      the five workloads at 64 conns, then at 1 conn, each between two
                     runs of the reference at as many connections; then four more
                     rounds of acquire at 64 conns, each on a fresh store
    1,000,000 live   the five workloads at 64 conns, each between two references
    1,000,000 over   a server whose cleanup starts after 1 s; acquire at 64 conns in
                     windows until the cleanup has deleted every record

then the memory store (the empty-store runs only: the ceiling the durable stores are
measured against, ``MemoryTarget``), then etcd 3.4 (acquire at 64 and 1 connections),
then one client's calls through the SDK beside redis-py's Lock on a Redis that fsyncs
every write (``bench.latency``; ``--no-latency`` skips it), what the Idempotency-Key
middleware adds to a request at one connection (``bench.middleware``, on a SQLite
leasekeeper of its own; ``--no-middleware`` skips it), and last how fast a freed key
reaches a waiting worker, waiting on the service against polling (``bench.handover``;
``--no-handover`` skips it).
The ratio of a run is its rate over the reference's rate measured around it: the mean
of the reference runs just before and just after it (``reference_ops_per_s`` in the
run's ``extra``). A VM's speed can drift within minutes, so every workload gets its
own pair; a cleanup window is compared with the store's empty-store references. The
acquire targets take the median ratio of the five rounds and the p99 of all their
requests: one run's ratio moved by up to 20 % from one run to the next on a shared VM.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from bench import _plot, _report, handover, latency, middleware
from bench._procs import Process, start_etcd, start_leasekeeper, start_reference
from bench._stores import (
    MemoryTarget,
    PostgresTarget,
    SqliteTarget,
    StoreTarget,
    Unavailable,
)
from bench._wrk import Run, run_wrk

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("acquire", "idempotency", "cycle", "contention", "heartbeat")
STORES = ("sqlite", "postgresql", "memory")
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
APT = "apt-get install -y wrk etcd-server"


@dataclass(frozen=True)
class Plan:
    """How long and how big; ``--quick`` shrinks everything for a smoke run."""

    seconds: int  # one run at 64 connections
    seconds_one: int  # one run at 1 connection
    seconds_reference: int  # one reference run between two workload runs
    warmup: int
    records: int  # pre-filled records for growth and cleanup
    holders: int  # leases renewed by the heartbeat workload
    cleanup_window: int
    cleanup_windows: int  # at most this many windows while the cleanup runs
    #: Acquire runs at 64 connections on each empty store: the acquire target is
    #: their median ratio (one run's ratio moves by up to 20 % on a shared VM).
    rounds: int = 5
    connections: int = 64
    keys: int = 10_000  # key space of the acquire -> release cycles
    hot_keys: int = 10  # contention
    #: Rounds of the middleware stage, each a request of every kind (``bench.middleware``).
    middleware_rounds: int = 500
    #: Calls of each measure in the one-client stage, and its wrk run (``bench.latency``).
    latency_pairs: int = 2000
    latency_seconds: int = 8
    #: Hand-overs per mode and store in the hand-over stage (``bench.handover``).
    handover_rounds: int = 40

    @classmethod
    def make(cls, quick: bool, records: int | None) -> Plan:
        if quick:
            return cls(
                2, 1, 1, 1, records or 100_000, 1_000, 2, 15, rounds=1, middleware_rounds=30,
                latency_pairs=300, latency_seconds=2, handover_rounds=10,
            )  # fmt: skip
        return cls(8, 4, 4, 2, records or 1_000_000, 10_000, 4, 60)


def _positive(text: str) -> int:
    """A whole number of at least 1 (``--records 0`` would read as not given)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1 (--no-growth skips them): {value}")
    return value


@dataclass
class Section:
    """The runs of one store, or of etcd; ``notes`` say what was skipped and why."""

    target: str
    runs: list[Run] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="leasekeeper's benchmark (see docs/performance.md). Needs wrk; etcd-server "
        f"for the peer. On Debian: {APT}",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of about a minute")
    parser.add_argument(
        "--stores",
        default=None,
        help="comma-separated: sqlite,postgresql,memory (default: all three; sqlite with "
        "--quick). memory is the ceiling: the same server with no durable store",
    )
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("LEASEKEEPER_TEST_POSTGRES_URL") or DEFAULT_POSTGRES,
        help="a database the bench may create and drop schemas in [%(default)s]",
    )
    parser.add_argument("--out", type=Path, default=None, help="the JSON results file")
    parser.add_argument(
        "--records", type=_positive, default=None, help="records for growth/cleanup"
    )
    parser.add_argument(
        "--only",
        default=",".join(WORKLOADS),
        help="comma-separated workloads to run [%(default)s]",
    )
    parser.add_argument("--no-growth", action="store_true", help="skip the 1M-record runs")
    parser.add_argument("--no-etcd", action="store_true", help="skip the etcd peer")
    parser.add_argument("--no-single", action="store_true", help="skip the 1-connection runs")
    parser.add_argument("--no-middleware", action="store_true", help="skip the middleware stage")
    parser.add_argument("--no-handover", action="store_true", help="skip the hand-over stage")
    parser.add_argument(
        "--no-latency", action="store_true", help="skip the one-client stage (bench.latency)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check tools and stores, print the plan, exit"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = Plan.make(args.quick, args.records)
    stores = (args.stores or ("sqlite" if args.quick else ",".join(STORES))).split(",")
    workloads = [w for w in args.only.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS] + [s for s in stores if s not in STORES]
    if unknown:
        print(f"unknown workloads or stores: {', '.join(unknown)}", file=sys.stderr)
        return 2
    wrk = shutil.which("wrk")
    etcd = None if args.no_etcd else shutil.which("etcd")
    print(f"plan: {plan}; stores {stores}; workloads {workloads}")
    if wrk is None:
        print(f"wrk is not installed: the benchmark needs it ({APT})", file=sys.stderr)
        return 0 if args.dry_run else 1
    if etcd is None and not args.no_etcd:
        print(f"etcd is not installed, the peer is skipped ({APT})")
    if args.dry_run:
        for name in stores:
            with _target(name, Path(tempfile.gettempdir()), args.postgres_url) as (target, why):
                print(f"store {name}: {'ready' if target else why}")
        return 0

    try:
        return _bench(args, plan, stores, workloads, wrk, etcd)
    except (RuntimeError, httpx.HTTPError) as exc:
        # A server that died or would not start, wrk failing: what went wrong, once.
        print(f"\nbench stopped: {exc}", file=sys.stderr)
        return 1


def _bench(
    args: argparse.Namespace,
    plan: Plan,
    stores: list[str],
    workloads: list[str],
    wrk: str,
    etcd: str | None,
) -> int:
    out = args.out or ROOT / "bench" / "results" / time.strftime("bench-%Y%m%d-%H%M%S.json")
    started = time.time()
    sections: list[Section] = []
    with tempfile.TemporaryDirectory(prefix="leasekeeper-bench-") as tmp:
        workdir = Path(tmp)
        machine = _machine(workdir)
        reference = start_reference(workdir)
        bench = Bench(wrk, plan, workdir, reference, workloads, single=not args.no_single)
        try:
            for name in stores:
                section = Section(name)
                sections.append(section)
                with _target(name, workdir, args.postgres_url) as (target, why):
                    if target is None:
                        section.notes.append(f"{name}: {why}")
                        print(f"\n== {name}: skipped: {why}")
                        continue
                    bench.store(target, section, growth=not args.no_growth)
            if etcd is not None:
                section = Section("etcd")
                sections.append(section)
                bench.etcd(etcd, section)
            elif not args.no_etcd:
                sections.append(Section("etcd", notes=[f"etcd is not installed ({APT})"]))
        finally:
            reference.stop()
        one_client = None
        if not args.no_latency:
            one_client = latency.stage(
                workdir / "latency", plan.latency_pairs, plan.latency_seconds, wrk
            )
        overhead = None
        if not args.no_middleware:
            overhead = middleware.stage(workdir / "middleware", plan.middleware_rounds)
        handovers = None
        if not args.no_handover:
            postgres = args.postgres_url if "postgresql" in stores else None
            handovers = handover.stage(workdir / "handover", plan.handover_rounds, postgres)
    machine["loadavg_after"] = os.getloadavg()
    results = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "minutes": round((time.time() - started) / 60, 1),
        "machine": machine,
        "plan": plan.__dict__,
        "sections": [
            {"target": s.target, "notes": s.notes, "runs": [r.as_dict() for r in s.runs]}
            for s in sections
        ],
    }
    if one_client is not None:
        results["latency"] = one_client
    if overhead is not None:
        results["middleware"] = overhead
    if handovers is not None:
        results["handover"] = handovers
    results["targets"] = _report.targets(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print()
    print(_report.render(results))
    print(f"\nresults: {out}")
    try:
        print(f"plot: {_plot.plot(results, out.with_suffix('.png'))}")
    except ImportError:
        print("plot: skipped, matplotlib is not installed (pip install -e '.[bench]')")
    return 0


@contextlib.contextmanager
def _target(
    name: str, workdir: Path, postgres_url: str
) -> Iterator[tuple[StoreTarget | None, str]]:
    if name == "sqlite":
        yield SqliteTarget(workdir), ""
        return
    if name == "memory":
        yield MemoryTarget(), ""
        return
    try:
        target = PostgresTarget(postgres_url)
    except Unavailable as exc:
        yield None, str(exc)
        return
    try:
        yield target, ""
    finally:
        target.close()


class Bench:
    """Runs the plan against servers; every run is appended to its section."""

    def __init__(
        self,
        wrk: str,
        plan: Plan,
        workdir: Path,
        reference: Process,
        workloads: list[str],
        *,
        single: bool,
    ) -> None:
        self.wrk = wrk
        self.plan = plan
        self.workdir = workdir
        self.reference = reference
        self.workloads = workloads
        self.single = single

    # -- one store -------------------------------------------------------------------------

    def store(self, target: StoreTarget, section: Section, *, growth: bool) -> None:
        plan = self.plan
        print(f"\n== {target.name}: empty store")
        url = target.fresh()
        with self._server(url) as server:
            holders = self._holders(server) if "heartbeat" in self.workloads else None
            self._warm(server)
            runs = self._between_references(server, target.name, plan.connections, holders)
            if self.single:
                runs += self._between_references(server, target.name, 1, holders)
        target.discard(url)
        if "acquire" in self.workloads:
            runs += self._more_rounds(target)
        section.runs += runs
        if not growth:
            return

        print(f"\n== {target.name}: {plan.records:,} records already stored")
        url = target.fresh()
        try:
            seconds = _timed(lambda: target.prefill(url, plan.records, expired=False))
        except Unavailable as exc:
            section.notes.append(f"growth: {exc}")
            print(f"   skipped: {exc}")
            target.discard(url)
            return
        print(f"   pre-filled {plan.records:,} records in {seconds:.1f} s")
        with self._server(url) as server:
            holders = self._holders(server) if "heartbeat" in self.workloads else None
            self._warm(server)
            label = f"{target.name}+{plan.records}"
            runs = self._between_references(server, label, plan.connections, holders)
        target.discard(url)
        section.runs += runs

        print(f"\n== {target.name}: cleanup of {plan.records:,} expired records under load")
        url = target.fresh()
        seconds = _timed(lambda: target.prefill(url, plan.records, expired=True))
        print(f"   pre-filled {plan.records:,} expired records in {seconds:.1f} s")
        env = {"LEASEKEEPER_CLEANUP_INTERVAL_SECONDS": "1"}
        name = f"{target.name}:cleanup"
        with self._server(url, env) as server:
            began = time.monotonic()
            for window in range(plan.cleanup_windows):
                run = self._run(
                    server, name, "acquire", plan.connections, None, plan.cleanup_window, True
                )
                left = target.expired(url)
                run.extra.update(
                    expired_left=left, window=window, elapsed_s=round(time.monotonic() - began, 1)
                )
                section.runs.append(run)
                print(f"   expired records left: {left:,}")
                if left == 0:
                    break
            else:
                section.notes.append(
                    f"cleanup not finished after {plan.cleanup_windows} windows of "
                    f"{plan.cleanup_window} s"
                )
        target.discard(url)

    # -- etcd ------------------------------------------------------------------------------

    def etcd(self, etcd: str, section: Section) -> None:
        print("\n== etcd 3.4: lease grant + put-if-absent transaction (JSON gateway)")
        etcd_dir = self.workdir / "etcd"
        etcd_dir.mkdir()
        try:
            server = start_etcd(etcd, etcd_dir)
        except RuntimeError as exc:  # the peer is optional: keep every store's results
            section.notes.append(f"etcd did not start: {exc}")
            print(f"   skipped: etcd did not start: {exc}")
            return
        try:
            version = httpx.get(server.url + "/version", timeout=5).json()
            section.notes.append(f"etcd {version.get('etcdserver', '?')}, one member, fsync on")
            # Arguments: a fresh run tag each time (keys never repeat), no namespace.
            warm = self.plan.warmup
            self._wrk(server, "warm-up", "etcd_acquire", self.plan.connections, warm, [_tag(), "-"])
            for connections in (
                (self.plan.connections, 1) if self.single else (self.plan.connections,)
            ):
                seconds = self.plan.seconds if connections > 1 else self.plan.seconds_one
                run = self._wrk(
                    server, "etcd", "etcd_acquire", connections, seconds, [_tag(), "-"], "acquired"
                )
                section.runs.append(run)
        finally:
            server.stop()

    # -- helpers ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _server(self, url: str, env: dict[str, str] | None = None) -> Iterator[Process]:
        server = start_leasekeeper(url, self.workdir, env)
        try:
            yield server
        finally:
            server.stop()

    def _warm(self, server: Process) -> None:
        self._run(server, "warm-up", "acquire", self.plan.connections, None, self.plan.warmup)

    def _between_references(
        self,
        server: Process,
        label: str,
        connections: int,
        holders: tuple[str, Path] | None,
    ) -> list[Run]:
        """The workloads on ``server``, each between two reference runs; each run's
        ``extra["reference_ops_per_s"]`` is the mean rate of the two around it."""
        before = self._reference(label, connections)
        runs = [before]
        for workload in self.workloads:
            # Acquire keeps its latency quantiles: the target's p99 is over every round.
            quantiles = workload == "acquire"
            run = self._run(server, label, workload, connections, holders, None, quantiles)
            after = self._reference(label, connections)
            run.extra["reference_ops_per_s"] = (before.ops_per_s + after.ops_per_s) / 2
            runs += [run, after]
            before = after
        return runs

    def _more_rounds(self, target: StoreTarget) -> list[Run]:
        """Rounds 2 to ``plan.rounds`` of acquire at 64 connections, each on a fresh store
        made as round 1's was (the heartbeat's holders, a warm-up), between two reference
        runs. A fresh store each time: every round adds some 60,000 records, and with one
        store for all five, SQLite's ratio fell from 0.46 in the first round to 0.32-0.36
        in the next four."""
        connections = self.plan.connections
        runs: list[Run] = []
        for number in range(2, self.plan.rounds + 1):
            url = target.fresh()
            with self._server(url) as server:
                if "heartbeat" in self.workloads:
                    self._holders(server)
                self._warm(server)
                before = self._reference(target.name, connections)
                run = self._run(server, target.name, "acquire", connections, None, None, True)
                after = self._reference(target.name, connections)
            target.discard(url)
            run.extra["reference_ops_per_s"] = (before.ops_per_s + after.ops_per_s) / 2
            run.extra["round"] = number
            runs += [before, run, after]
        return runs

    def _reference(self, label: str, connections: int) -> Run:
        args = [_tag(), "ns_" + "A" * 43]
        seconds = self.plan.seconds_reference
        return self._wrk(
            self.reference, f"reference@{label}", "reference", connections, seconds, args
        )

    def _run(
        self,
        server: Process,
        target: str,
        workload: str,
        connections: int,
        holders: tuple[str, Path] | None,
        seconds: int | None = None,
        quantiles: bool = False,
    ) -> Run:
        if seconds is None:
            seconds = self.plan.seconds if connections > 1 else self.plan.seconds_one
        args = [_tag(), _mint(server)]
        if workload == "cycle":
            args.append(str(self.plan.keys))
        elif workload == "contention":
            args.append(str(self.plan.hot_keys))
        elif workload == "heartbeat":
            if holders is None:
                raise RuntimeError("the heartbeat workload needs holders")
            args = [args[0], holders[0], str(holders[1]), str(connections)]
        return self._wrk(server, target, workload, connections, seconds, args, None, quantiles)

    def _wrk(
        self,
        process: Process,
        target: str,
        script: str,
        connections: int,
        seconds: int,
        args: list[str],
        ops_counter: str | None = None,
        quantiles: bool = False,
    ) -> Run:
        run = run_wrk(
            self.wrk,
            process,
            "/",
            script,
            target=target,
            connections=connections,
            seconds=seconds,
            args=args,
            ops_counter=ops_counter,
            quantiles=quantiles,
        )
        if target != "warm-up":
            print("   " + _report.line(run))
        return run

    def _holders(self, server: Process) -> tuple[str, Path]:
        """Acquire ``plan.holders`` leases for an hour; their keys and tokens, in a file."""
        namespace = _mint(server)
        path = self.workdir / f"holders-{_tag()}.txt"
        started = time.monotonic()
        tokens = _acquire_many(server.url, namespace, self.plan.holders)
        path.write_text("".join(f"{key} {token}\n" for key, token in tokens))
        print(f"   {len(tokens):,} holders acquired in {time.monotonic() - started:.1f} s")
        return namespace, path


def _acquire_many(url: str, namespace: str, count: int, workers: int = 16) -> list[tuple[str, str]]:
    """Acquire keys ``holder-0`` to ``holder-<count - 1>`` for an hour; (key, owner token).

    Through the standard library's ``http.client``, one keep-alive connection per
    thread: httpx's async client made about 430 acquires a second here, which took
    some 25 s for the heartbeat's 10,000 holders, six times per store; this makes
    about 3,500 a second.
    """
    host = urllib.parse.urlsplit(url).netloc  # host:port

    def acquire(first: int) -> list[tuple[str, str]]:
        connection = http.client.HTTPConnection(host, timeout=30)
        tokens = []
        try:
            for number in range(first, count, workers):
                key = f"holder-{number}"
                body = json.dumps({"namespace": namespace, "key": key, "ttl_seconds": 3600})
                connection.request("POST", "/services/v1/lease", body, _JSON)
                response = connection.getresponse()
                answer = response.read()
                if response.status != 201:
                    raise RuntimeError(f"acquiring a holder: {response.status} {answer[:200]!r}")
                tokens.append((key, json.loads(answer)["owner_token"]))
        finally:
            connection.close()
        return tokens

    with ThreadPoolExecutor(workers) as pool:
        return [token for part in pool.map(acquire, range(workers)) for token in part]


_JSON = {"content-type": "application/json"}


def _mint(server: Process) -> str:
    server.check_running("between two runs")
    response = httpx.post(server.url + "/services/v1/lease/namespace", json={}, timeout=10)
    response.raise_for_status()
    return str(response.json()["namespace"])


def _tag() -> str:
    return secrets.token_hex(4)


def _timed(work: Any) -> float:
    started = time.monotonic()
    work()
    return time.monotonic() - started


def _fsync_ms(workdir: Path, count: int = 100) -> dict[str, float]:
    """How long the disk under the databases takes to fsync 4 KiB (p50, p99): the floor
    of an acknowledged write at 1 connection, since every commit waits for one."""
    path = workdir / "fsync-probe"
    times = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for _ in range(count):
            os.write(fd, b"x" * 4096)
            began = time.perf_counter()
            os.fsync(fd)
            times.append((time.perf_counter() - began) * 1000)
    finally:
        os.close(fd)
        path.unlink()
    times.sort()
    return {"p50": round(times[count // 2], 3), "p99": round(times[count * 99 // 100], 3)}


def _machine(workdir: Path) -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    versions = {}
    for package in ("leasekeeper", "starlette", "uvicorn", "uvloop", "httptools", "pydantic"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": versions,
        "wrk": wrk_version.split("[")[0].strip() or "wrk",
        "commit": commit,
        "loadavg_before": os.getloadavg(),
        "fsync_ms": _fsync_ms(workdir),
    }
