"""``python -m bench.latency``: one client's latency through the SDK, beside redis-py's Lock.

Starts ``leasekeeper serve`` on SQLite in a temporary directory and a Redis that keeps
every write on disk before answering it (``--appendonly yes --appendfsync always``, its
own directory, no snapshots; never the machine's Redis), then times, one call at a
time over one keep-alive connection each, in blocks that take turns so that a busy
machine slows every figure alike:

- ``redis lock``: redis-py's ``Lock`` acquire (``SET NX PX``) and release (a script),
- ``sync pair`` / ``async pair``: ``LeaseClient.acquire`` then ``release`` (and the
  ``AsyncLeaseClient`` twins) on a new key,
- ``stdlib pair``: the same two requests over the standard library's ``http.client``
  and ``json``, no SDK: what the leanest Python client of this server takes, the floor
  under the SDK's pair (``FLOOR``),
- ``sync lease`` / ``async lease``: a ``with client.lease(...)`` block entered and left
  (acquire, the renewal worker started and stopped, release),
- ``sync once`` / ``async once``: a ``once`` function called on a key already completed
  (one acquire, answered with the stored result),
- ``fdatasync``: a 4 KiB write to a file beside both stores and its ``fdatasync``, the
  floor of a durable write on that disk at that moment.

Then, in the same run, the server's acquire at one connection (wrk,
``bench/lua/acquire.lua``). It prints p50 and p99 of each and each p50's ratio to
Redis's pair. ``--quick`` is a smaller run of about half a
minute; ``make bench`` runs it as a stage (``stage``), and its report shows the table
and the targets (``targets``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from bench._procs import Process, free_port, start_leasekeeper
from bench._wrk import run_wrk

REDIS = "redis lock"
FLOOR = "stdlib pair"
FDATASYNC = "fdatasync"
#: The measures, in the order each block visits them.
MEASURES = (
    REDIS,
    "sync pair",
    "async pair",
    FLOOR,
    "sync lease",
    "async lease",
    "sync once",
    "async once",
    FDATASYNC,
)
#: The one-client targets of docs/performance.md (ratios of p50s in one run; the wrk p50 in ms).
PAIR_OVER_REDIS = 1.5
ASYNC_OVER_SYNC = 1.2
WRK_P50_MS = 0.40


def summary(samples: list[float]) -> dict[str, float]:
    """p50 and p99 of ``samples`` (seconds), in milliseconds, and how many."""
    ordered = sorted(samples)

    def at(fraction: float) -> float:
        return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))] * 1000

    return {"p50": at(0.5), "p99": at(0.99), "n": len(ordered)}


def report(stage: dict[str, Any]) -> str:
    """The table: each measure's p50 and p99 and its p50 over Redis's pair, then the
    server's acquire at one connection of the same run."""
    results = stage["results"]
    redis = results.get(REDIS, {}).get("p50")
    lines = [f"{'one client':<14}{'p50 ms':>8}{'p99 ms':>8}{'x redis':>9}"]
    for name in MEASURES:
        if name not in results:
            continue
        s = results[name]
        ratio = f"{s['p50'] / redis:.2f}" if redis else "-"
        lines.append(f"{name:<14}{s['p50']:>8.2f}{s['p99']:>8.2f}{ratio:>9}")
    wrk = stage.get("wrk")
    if wrk:
        lines.append(
            f"{'server acquire, 1 conn (wrk)':<30} p50 {wrk['p50_ms']:.2f} ms, "
            f"p99 {wrk['p99_ms']:.2f} ms, {wrk['ops_per_s']:,.0f}/s"
        )
    return "\n".join(lines)


def targets(stage: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """The one-client targets from a stage's figures: (name, measured, goal, met)."""
    results = stage["results"]
    out = []
    pair, redis = results.get("sync pair"), results.get(REDIS)
    if pair and redis:
        r = pair["p50"] / redis["p50"]
        floor = results.get(FLOOR)
        under = f"; over http.client, no SDK: {floor['p50'] / redis['p50']:.2f}x" if floor else ""
        out.append(
            (
                "SDK acquire + release at one client, SQLite, vs redis-py Lock",
                f"p50 {pair['p50']:.2f} vs {redis['p50']:.2f} ms ({r:.2f}x{under})",
                f"<= {PAIR_OVER_REDIS}x",
                r <= PAIR_OVER_REDIS,
            )
        )
    apair = results.get("async pair")
    if pair and apair:
        r = apair["p50"] / pair["p50"]
        out.append(
            (
                "async client's acquire + release vs the sync client's",
                f"p50 {apair['p50']:.2f} vs {pair['p50']:.2f} ms ({r:.2f}x)",
                f"<= {ASYNC_OVER_SYNC}x",
                r <= ASYNC_OVER_SYNC,
            )
        )
    wrk = stage.get("wrk")
    if wrk:
        sync = results.get(FDATASYNC, {}).get("p50", 0.0)
        out.append(
            (
                "sqlite acquire, 1 connection (wrk, latency stage)",
                f"p50 {wrk['p50_ms']:.2f} ms (4 KiB fdatasync p50 {sync:.2f} ms)"
                + (f"; {wrk['errors']:,} requests failed" if wrk["errors"] else ""),
                f"p50 <= {WRK_P50_MS:.2f} ms",
                wrk["p50_ms"] <= WRK_P50_MS and not wrk["errors"],
            )
        )
    return out


# -- the processes --------------------------------------------------------------------------


def start_redis(workdir: Path, wait: float = 30.0) -> tuple[Process, Any]:
    """A Redis of the bench's own on a free port that fsyncs every write before answering
    it (``appendfsync always``) into ``workdir``, and a redis-py client of it."""
    import redis

    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    data = workdir / "redis"
    data.mkdir()
    argv = [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)]
    argv += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
    log = workdir / "redis.log"
    with log.open("ab") as sink:
        popen = subprocess.Popen(argv, stdout=sink, stderr=sink)
    process = Process("redis", popen, f"redis://127.0.0.1:{port}", log)
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + wait
    while True:
        process.check_running("before it was ready")
        try:
            client.ping()
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                process.stop()
                raise RuntimeError(f"redis-server did not start: {process.log_tail()}") from None
            time.sleep(0.05)
        else:
            break
    settings = client.config_get("appendfsync")
    if settings.get("appendfsync") != "always":  # never compare with a Redis that may lose it
        process.stop()
        raise RuntimeError(f"redis-server is not fsyncing every write: {settings}")
    return process, client


# -- the measures -----------------------------------------------------------------------------


def _steps(
    lk: Any, alk: Any, namespace: str, redis: Any, probe: int, plain: Callable[[str, bytes], Any]
) -> dict[str, Callable[[], Any]]:
    """Each measure as one call: a plain function, or a coroutine function (async);
    ``probe`` is the descriptor of the file the fdatasync measure writes, ``plain``
    posts a body to a route over ``http.client`` (``_stdlib_poster``)."""
    count = iter(range(10**12))
    page = b"x" * 4096
    done = f"done-{uuid.uuid4().hex}"

    def fresh() -> str:
        return f"k-{next(count)}"

    def pair() -> None:
        key = fresh()
        held = lk.acquire(namespace, key, ttl=30)
        lk.release(namespace, key, held.owner_token)

    async def apair() -> None:
        key = fresh()
        held = await alk.acquire(namespace, key, ttl=30)
        await alk.release(namespace, key, held.owner_token)

    def stdlib_pair() -> None:
        key = fresh()
        body = {"namespace": namespace, "key": key, "ttl_seconds": 30}
        held = plain("/lease/acquire", json.dumps(body).encode())
        body = {"namespace": namespace, "key": key, "owner_token": held["owner_token"]}
        plain("/lease/release", json.dumps(body).encode())

    def lease() -> None:
        with lk.lease(namespace, fresh(), ttl=30):
            pass

    async def alease() -> None:
        async with alk.lease(namespace, fresh(), ttl=30):
            pass

    @lk.once(namespace, key=done)
    def once() -> dict[str, int]:
        return {"charged": 1}

    @alk.once(namespace, key=done)
    async def aonce() -> dict[str, int]:
        return {"charged": 1}

    steps: dict[str, Callable[[], Any]] = {}
    if redis is not None:

        def lock() -> None:
            held = redis.lock(fresh(), timeout=30)
            if not held.acquire(blocking=False):
                raise RuntimeError("redis-py's Lock was not acquired on a new key")
            held.release()

        steps[REDIS] = lock
    steps |= {
        "sync pair": pair,
        "async pair": apair,
        FLOOR: stdlib_pair,
        "sync lease": lease,
        "async lease": alease,
        "sync once": once,
        "async once": aonce,
        FDATASYNC: lambda: (os.write(probe, page), os.fdatasync(probe)),
    }
    once()  # the key is completed from now on: every call after is a replay
    return steps


def measure(
    url: str, namespace: str, redis: Any, pairs: int, workdir: Path, block: int = 25
) -> dict[str, dict[str, float]]:
    """Time ``pairs`` calls of every measure, in blocks of ``block`` calls that take
    turns (``MEASURES``' order); one block of each warms up first."""
    from leasekeeper import AsyncLeaseClient, LeaseClient

    samples: dict[str, list[float]] = {}
    probe = os.open(workdir / "fdatasync-probe", os.O_WRONLY | os.O_CREAT, 0o600)
    with asyncio.Runner() as runner, LeaseClient(url) as lk, _stdlib_poster(url) as plain:
        alk = AsyncLeaseClient(url)
        try:
            steps = _steps(lk, alk, namespace, redis, probe, plain)
            for name in steps:
                samples[name] = []
            blocks = -(-pairs // block)
            for number in range(1 + blocks):
                for name, step in steps.items():
                    taken = (
                        runner.run(_timed_async(step, block))
                        if asyncio.iscoroutinefunction(step)
                        else _timed(step, block)
                    )
                    if number:  # the first is the warm-up
                        samples[name] += taken
        finally:
            runner.run(alk.aclose())
            os.close(probe)
    return {name: summary(values[:pairs]) for name, values in samples.items()}


@contextlib.contextmanager
def _stdlib_poster(url: str) -> Iterator[Callable[[str, bytes], Any]]:
    """A function posting JSON to a lease route over one keep-alive ``http.client``
    connection, returning the parsed body of a success (anything else raises)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    headers = {"content-type": "application/json", "accept": "application/json"}

    def post(route: str, body: bytes) -> Any:
        connection.request("POST", "/services/v1" + route, body, headers)
        response = connection.getresponse()
        answer = json.loads(response.read())
        if response.status not in (200, 201) or answer.get("ok") is not True:
            raise RuntimeError(f"{route} answered {response.status}: {answer.get('status')}")
        return answer

    try:
        yield post
    finally:
        connection.close()


def _timed(step: Callable[[], Any], count: int) -> list[float]:
    taken = []
    clock = time.perf_counter
    for _ in range(count):
        began = clock()
        step()
        taken.append(clock() - began)
    return taken


async def _timed_async(step: Callable[[], Awaitable[Any]], count: int) -> list[float]:
    taken = []
    clock = time.perf_counter
    for _ in range(count):
        began = clock()
        await step()
        taken.append(clock() - began)
    return taken


@contextlib.contextmanager
def _redis_or_note(workdir: Path, notes: list[str]) -> Iterator[Any]:
    """redis-py's client of a Redis of our own, or None with a note saying why not."""
    try:
        process, client = start_redis(workdir)
    except ImportError:
        notes.append("redis-py is not installed (pip install -e '.[bench]'): no Redis rows")
        yield None
        return
    except (RuntimeError, OSError) as exc:
        notes.append(f"Redis did not start: {exc}")
        yield None
        return
    try:
        yield client
    finally:
        client.close()
        process.stop()


def run(workdir: Path, pairs: int, seconds: int, wrk: str | None) -> dict[str, Any]:
    """The whole stage in ``workdir``: ``{"pairs", "results", "wrk", "notes"}``, as
    ``--json`` writes it and ``make bench`` keeps it."""
    notes: list[str] = []
    server = start_leasekeeper(f"sqlite:///{workdir / 'lk.db'}", workdir)
    wrk_run = None
    try:
        namespace = _mint(server.url)
        with _redis_or_note(workdir, notes) as redis:
            results = measure(server.url, namespace, redis, pairs, workdir)
        if wrk is None:
            notes.append("wrk is not installed: no server acquire at one connection")
        else:
            run = run_wrk(
                wrk,
                server,
                "/",
                "acquire",
                target="sqlite",
                connections=1,
                seconds=seconds,
                args=[uuid.uuid4().hex[:8], _mint(server.url)],
            )
            wrk_run = {
                k: getattr(run, k) for k in ("p50_ms", "p99_ms", "ops_per_s", "errors", "requests")
            }
    finally:
        server.stop()
    return {
        "pairs": pairs,
        "results": results,
        "wrk": wrk_run,
        "notes": notes,
    }


def _mint(url: str) -> str:
    response = httpx.post(url + "/services/v1/lease/namespace", json={}, timeout=10)
    response.raise_for_status()
    return str(response.json()["namespace"])


def stage(workdir: Path, pairs: int, seconds: int, wrk: str | None) -> dict[str, Any]:
    """``make bench``'s latency stage: ``run`` in ``workdir`` (made here). A stage that
    fails is a note, as the middleware's is: the results before it are kept."""
    print(f"\n== one client: {pairs} calls of each, in turns, beside redis-py's Lock")
    workdir.mkdir()
    try:
        figures = run(workdir, pairs, seconds, wrk)
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"   skipped: {exc}")
        return {"pairs": pairs, "results": {}, "notes": [f"the latency stage failed: {exc}"]}
    for row in report(figures).splitlines():
        print("   " + row)
    return figures


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="500 calls each, wrk for 3 s")
    parser.add_argument("--pairs", type=int, default=None, help="calls of each measure [2000]")
    parser.add_argument("--seconds", type=int, default=None, help="the wrk run's length [8]")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    args.pairs = args.pairs or (500 if args.quick else 2000)
    args.seconds = args.seconds or (3 if args.quick else 8)
    if args.pairs < 1 or args.seconds < 1:
        parser.error("--pairs and --seconds take a positive number")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="leasekeeper-bench-latency-") as tmp:
        figures = run(Path(tmp), args.pairs, args.seconds, shutil.which("wrk"))
    print(report(figures))
    for note in figures["notes"]:
        print(f"note: {note}")
    for name, measured, goal, met in targets(figures):
        print(f"{'met    ' if met else 'NOT MET'} {name}: {measured} (goal {goal})")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
