"""Instructions per request, counted by valgrind: a yardstick that does not move with the VM.

``python -m bench`` measures what the issue's targets are stated in (requests a second,
as a ratio to the empty endpoint), but on a shared VM the same code measures up to
±20 % apart from one run to the next, more than most single changes are worth. This
counts instead the CPU instructions that one request costs in process (the ASGI app
called with fake messages: no sockets, no uvicorn, no kernel) under valgrind's
callgrind, which counts the same for the same code whatever else the machine does::

    python -m bench._instructions                     # all targets, 1,920 requests each
    python -m bench._instructions --targets reference,memory
    python -m bench._instructions --targets bare      # acquires without a namespace

Each target runs twice in a fresh interpreter, with N and then 3N requests from 64
concurrent tasks after the same warm-up; the difference over 2N is one request's
count, so start-up and imports cancel out. Every thread counts (SQLite's commit and
checkpoint threads, SQLite's own C code); the kernel does not. The garbage collector
is set as ``leasekeeper serve`` sets it, for the reference too. About a minute per
target on a 2-core VM; ``valgrind`` must be installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("reference", "memory", "sqlite", "bare")
#: What runs without --targets: "bare" only measures the guard on keys without a namespace.
DEFAULT_TARGETS = ("reference", "memory", "sqlite")
LABELS = {
    "reference": "reference (the empty endpoint)",
    "memory": "acquire, memory store",
    "sqlite": "acquire, SQLite",
    "bare": "acquire, memory, no namespace",
}
TASKS = 64
WARM_UP = 5 * TASKS
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")

Request = Callable[[], Awaitable[int]]


def _scope(path: str, body: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }


def _caller(app: Any, path: str, bodies: Callable[[], bytes]) -> Request:
    """One POST to ``app`` per call, with the next of ``bodies``; returns its status."""

    async def call() -> int:
        body = bodies()
        status = 0

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await app(_scope(path, body), receive, send)
        return status

    return call


async def drive(target: str, requests: int, workdir: Path) -> Counter[int]:
    """Warm up, then send ``requests`` requests to ``target`` from 64 tasks; the statuses."""
    from leasekeeper._core import secrets
    from leasekeeper._server_cli import _tune_gc

    service = None
    if target == "reference":
        from bench._reference import app

        ref_body = b'{"namespace":"ns_%s","key":"k-000000","ttl_seconds":60}' % (b"A" * 43)
        call = _caller(app, "/ref", lambda: ref_body)
    else:
        from leasekeeper._server_cli import _service, _settings, serve_app

        store = f"sqlite:///{workdir / 'bench.db'}" if target == "sqlite" else "memory://"
        settings = _settings(host=None, port=None, store=store)
        service = _service(settings)
        app = serve_app(service, settings, run_cleanup=False)
        await service.start()
        namespace = secrets.format_namespace(os.urandom(32)).encode()
        numbers = iter(range(10**12))

        def acquire_body() -> bytes:
            number = next(numbers)
            return b'{"namespace":"%s","key":"k-%d","ttl_seconds":60}' % (namespace, number)

        # The same uuid4 keys in every run (a seeded generator), made as each request is.
        uuids = random.Random(0)

        def bare_body() -> bytes:
            key = uuid.UUID(bytes=uuids.randbytes(16), version=4)
            return b'{"key":"%s","ttl_seconds":60}' % str(key).encode()

        bodies = bare_body if target == "bare" else acquire_body

        call = _caller(app, "/services/v1/lease", bodies)
    statuses: Counter[int] = Counter()

    async def task(count: int) -> None:
        for _ in range(count):
            statuses[await call()] += 1

    try:
        await asyncio.gather(*(task(WARM_UP // TASKS) for _ in range(TASKS)))
        _tune_gc()
        statuses.clear()
        await asyncio.gather(*(task(requests // TASKS) for _ in range(TASKS)))
    finally:
        if service is not None:
            await service.stop()
    return statuses


def _inner(target: str, requests: int) -> None:
    """The process valgrind runs: one target, ``requests`` requests, statuses on stdout."""
    with tempfile.TemporaryDirectory(prefix="lk-instructions-") as workdir:
        statuses = _run(drive(target, requests, Path(workdir)))
    print(json.dumps({str(status): n for status, n in statuses.items()}))


def _run(coroutine: Awaitable[Counter[int]]) -> Counter[int]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(coroutine)  # type: ignore[arg-type]
    return uvloop.run(coroutine)  # type: ignore[arg-type]


def collected(stderr: str) -> int:
    """The instruction count in callgrind's summary on ``stderr``."""
    found = _COLLECTED.search(stderr)
    if found is None:
        raise RuntimeError(f"no instruction count from valgrind: {stderr[-2000:]}")
    return int(found.group(1))


def count(valgrind: str, target: str, requests: int) -> int:
    """Instructions that a process sending ``requests`` requests to ``target`` ran."""
    argv = [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable]
    argv += ["-m", "bench._instructions", "--inner", target, "--requests", str(requests)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{target} failed under valgrind: {done.stderr[-2000:]}")
    statuses = json.loads(done.stdout.strip().splitlines()[-1])
    expected = "200" if target == "reference" else "201"
    if statuses != {expected: requests}:
        raise RuntimeError(f"{target}: expected {requests} answers {expected}, got {statuses}")
    return collected(done.stderr)


def per_request(low: int, high: int, requests: int) -> float:
    """One request's instructions from runs of ``requests`` and ``3 * requests``."""
    return (high - low) / (2 * requests)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench._instructions", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="comma-separated")
    parser.add_argument("--requests", type=int, default=1920, help="N (a multiple of 64)")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--valgrind", default="valgrind", help="the valgrind to run")
    parser.add_argument("--inner", choices=TARGETS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    requests = args.requests - args.requests % TASKS or TASKS
    if args.inner:
        _inner(args.inner, requests)
        return 0
    targets = [t for t in args.targets.split(",") if t]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown targets {unknown}; choose from {', '.join(TARGETS)}")
    valgrind = shutil.which(args.valgrind)
    if valgrind is None:
        print("valgrind is not installed (apt-get install -y valgrind)", file=sys.stderr)
        return 2
    results: dict[str, float] = {}
    for target in targets:
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(count, valgrind, target, n) for n in (requests, 3 * requests)]
            low, high = (run.result() for run in runs)
        results[target] = per_request(low, high, requests)
        took = time.monotonic() - started
        print(f"  {LABELS[target]}: {results[target]:,.0f} instructions/request ({took:.0f} s)")
    print(report(results))
    out = args.results / time.strftime("instructions-%Y%m%d-%H%M%S.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"requests": requests, "per_request": results}, indent=2))
    print(f"results: {out}")
    return 0


def report(results: dict[str, float]) -> str:
    """The table: each target's instructions per request, and the reference's over it."""
    reference = results.get("reference")
    lines = [f"{'target':<34}{'instructions/request':>22}{'reference/target':>18}"]
    for target, value in results.items():
        share = f"{reference / value:.2f}" if reference else ""
        lines.append(f"{LABELS[target]:<34}{value:>22,.0f}{share:>18}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
