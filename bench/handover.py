"""``python -m bench.handover``: how fast a freed key reaches a waiting worker, and what
waiting costs the server, server-side waiting (``wait_seconds``) against polling.

Hand-over: a holder takes a key, holds it for a random 0.2 to 1 s, and releases it,
while one worker waits for the key, either on the server (an acquire with
``wait_seconds``) or polling as the client did before (acquire, then the client's
backoff ``acquire_delay``: 0.25 s doubling, capped by ``Retry-After``). The latency is
from the moment the release's answer arrives to the moment the waiter's 201 arrives.
On SQLite both talk to one instance; on PostgreSQL the holder talks to one instance
and the waiter to another (the hand-over crosses instances: LISTEN/NOTIFY).

Contention: 64 workers, 10 hot keys; each takes a random key (waiting for as long as
it takes), holds it 20 ms, releases it; for ``seconds``. Reported: requests sent per
lease granted, and leases granted per second, polling against waiting (SQLite).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench._procs import Process, start_leasekeeper
from bench._stores import PostgresTarget, Unavailable
from leasekeeper.client._timing import acquire_delay

MODES = ("waiting", "polling")


def _acquire(http: httpx.Client, url: str, key: str, mode: str, sent: list[int]) -> str:
    """Acquire ``key`` at ``url`` however long it takes; the owner token. ``sent`` counts
    the requests."""
    attempt = 0
    while True:
        body: dict[str, Any] = {"key": key, "ttl_seconds": 30}
        if mode == "waiting":
            body["wait_seconds"] = 60
        sent[0] += 1
        response = http.post(f"{url}/services/v1/lease", json=body)
        if response.status_code == 201:
            return str(response.json()["owner_token"])
        if response.status_code != 409:
            raise RuntimeError(f"acquire answered {response.status_code}: {response.text}")
        if mode == "polling":
            retry_after = float(response.json().get("retry_after_seconds", 1))
            delay = acquire_delay(attempt, retry_after, 3600.0, random.random())
            time.sleep(delay or 0.0)
            attempt += 1


def _release(http: httpx.Client, url: str, key: str, token: str, sent: list[int]) -> None:
    sent[0] += 1
    body = {"key": key, "owner_token": token}
    response = http.post(f"{url}/services/v1/lease/release", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"release answered {response.status_code}: {response.text}")


def handover(holder_url: str, waiter_url: str, mode: str, rounds: int) -> list[float]:
    """``rounds`` hand-overs: seconds from the release's answer to the waiter's 201."""
    samples: list[float] = []
    with httpx.Client(timeout=90) as holder, httpx.Client(timeout=90) as waiter:
        for _ in range(rounds):
            key = str(uuid.uuid4())
            sent = [0]
            token = _acquire(holder, holder_url, key, "waiting", sent)
            granted: list[float] = []

            def wait_for_it(key: str = key, granted: list[float] = granted) -> None:
                owner = _acquire(waiter, waiter_url, key, mode, [0])
                granted.append(time.perf_counter())
                _release(waiter, waiter_url, key, owner, [0])

            thread = threading.Thread(target=wait_for_it)
            thread.start()
            time.sleep(random.uniform(0.2, 1.0))
            _release(holder, holder_url, key, token, sent)
            released = time.perf_counter()
            thread.join()
            samples.append(granted[0] - released)
    return samples


def contention(
    url: str, mode: str, seconds: float, workers: int = 64, keys: int = 10
) -> dict[str, float]:
    """``workers`` threads over ``keys`` hot keys for ``seconds``: requests per grant."""
    hot = [str(uuid.uuid4()) for _ in range(keys)]
    deadline = time.monotonic() + seconds
    counts = {"requests": 0, "grants": 0}
    lock = threading.Lock()

    def work() -> None:
        sent, grants = [0], 0
        with httpx.Client(timeout=90) as http:
            while time.monotonic() < deadline:
                key = random.choice(hot)
                token = _acquire(http, url, key, mode, sent)
                grants += 1
                time.sleep(0.02)
                _release(http, url, key, token, sent)
        with lock:
            counts["requests"] += sent[0]
            counts["grants"] += grants

    threads = [threading.Thread(target=work) for _ in range(workers)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    return {
        "requests": counts["requests"],
        "grants": counts["grants"],
        "requests_per_grant": counts["requests"] / max(1, counts["grants"]),
        "grants_per_second": counts["grants"] / elapsed,
    }


def summary(samples: list[float]) -> dict[str, float]:
    """Median and p99 of ``samples`` (seconds), in milliseconds."""
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50_ms": statistics.median(ordered) * 1000, "p99_ms": p99 * 1000, "n": len(ordered)}


def run(workdir: Path, rounds: int, seconds: float, postgres_url: str | None) -> dict[str, Any]:
    results: dict[str, Any] = {"handover": {}, "contention": {}, "notes": []}

    def servers(store: str, count: int) -> list[Process]:
        return [start_leasekeeper(store, workdir) for _ in range(count)]

    def each_mode(label: str, measure: Callable[[str], Any], into: dict[str, Any]) -> None:
        for mode in MODES:
            into[f"{label} {mode}"] = value = measure(mode)
            print(f"   {label} {mode}: {value}")

    sqlite = servers(f"sqlite:///{workdir / 'handover.db'}", 1)
    try:
        url = sqlite[0].url
        each_mode(
            "sqlite 1 instance",
            lambda mode: summary(handover(url, url, mode, rounds)),
            results["handover"],
        )
        each_mode(
            "sqlite 64 workers 10 keys",
            lambda mode: contention(url, mode, seconds),
            results["contention"],
        )
    finally:
        for server in sqlite:
            server.stop()
    if postgres_url is None:
        results["notes"].append("PostgreSQL: no URL given (--postgres-url)")
        return results
    try:
        target = PostgresTarget(postgres_url)
    except Unavailable as exc:
        results["notes"].append(f"PostgreSQL: {exc}")
        return results
    store = target.fresh()
    two = servers(store, 2)
    try:
        one_url, other_url = two[0].url, two[1].url
        each_mode(
            "postgres 2 instances",
            lambda mode: summary(handover(one_url, other_url, mode, rounds)),
            results["handover"],
        )
    finally:
        for server in two:
            server.stop()
        target.discard(store)
        target.close()
    return results


def stage(workdir: Path, rounds: int, postgres_url: str | None) -> dict[str, Any]:
    """``make bench``'s hand-over stage: ``run`` in ``workdir`` (made here), 10 s of
    contention. A stage that fails is a note: the results before it are kept."""
    print(f"\n== hand-over: {rounds} per mode, waiting on the service against polling")
    workdir.mkdir()
    try:
        return run(workdir, rounds, 10.0, postgres_url)
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"   skipped: {exc}")
        return {"handover": {}, "contention": {}, "notes": [f"the hand-over stage failed: {exc}"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.handover", description=__doc__)
    parser.add_argument("--rounds", type=int, default=40, help="hand-overs per mode [40]")
    parser.add_argument("--seconds", type=float, default=10.0, help="contention run [10 s]")
    parser.add_argument("--postgres-url", default=None, help="PostgreSQL for the 2-instance run")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="leasekeeper-bench-handover-") as tmp:
        results = run(Path(tmp), args.rounds, args.seconds, args.postgres_url)
    print(json.dumps(results, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
