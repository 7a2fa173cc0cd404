"""``python -m bench.middleware``: what the Idempotency-Key middleware adds to a request.

Starts ``leasekeeper serve`` (SQLite in a temporary directory, as a user runs it) and
one app per kind: a Starlette app under uvicorn (``IdempotencyMiddleware``) and a
Flask app under werkzeug's threaded server (``WSGIIdempotencyMiddleware``). Each app
serves one handler (a 201 with a small JSON body) at two paths: ``/plain/orders``,
which the middleware does not guard (``paths=["/guarded/*"]``), and
``/guarded/orders``. Over one keep-alive connection per app, requests go one at a
time, in rounds that visit both apps, so that a busy machine slows every figure alike:

- ``unguarded``: ``/plain/orders``, with an ``Idempotency-Key`` (the header lookup),
- ``first``: ``/guarded/orders`` with a new key (leasekeeper's acquire and complete),
- ``replay``: ``/guarded/orders`` with a key already completed (one acquire),

and, once a round, ``lease``: for scale, the acquire and complete a first request
makes, sent straight to leasekeeper by ``LeaseClient``. It prints the median, 90th
and 99th percentile latency of each, and what ``first`` and ``replay`` add to
``unguarded`` at the median. 500 rounds take about a minute. ``make bench`` runs it as
its last stage (``stage``), and its report shows the same table.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench._procs import Process, free_port, start, start_leasekeeper

KINDS = ("asgi", "wsgi")
MEASURES = ("unguarded", "first", "replay")
#: The row of the straight leasekeeper calls, beside the kinds.
LEASE = "lease"


def summary(samples: list[float]) -> dict[str, float]:
    """Median, p90 and p99 of ``samples`` (seconds), in milliseconds."""
    ordered = sorted(samples)

    def at(fraction: float) -> float:
        return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))] * 1000

    return {"median": statistics.median(ordered) * 1000, "p90": at(0.9), "p99": at(0.99)}


def report(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """The table: one row per kind and measure, the added latency at the median, and the
    straight leasekeeper calls."""
    lines = [f"{'kind':<6}{'measure':<11}{'median ms':>10}{'p90 ms':>9}{'p99 ms':>9}"]

    def row(kind: str, name: str, s: dict[str, float]) -> str:
        return f"{kind:<6}{name:<11}{s['median']:>10.2f}{s['p90']:>9.2f}{s['p99']:>9.2f}"

    for kind, measures in results.items():
        if kind == LEASE:
            continue
        lines.extend(row(kind, name, measures[name]) for name in MEASURES)
        base = measures["unguarded"]["median"]
        lines.append(
            f"{kind:<6}added: first {measures['first']['median'] - base:+.2f} ms, "
            f"replay {measures['replay']['median'] - base:+.2f} ms (medians)"
        )
    if LEASE in results:
        lines.append(row("-", "lease", results[LEASE][LEASE]))
    return "\n".join(lines)


def measure(
    apps: dict[str, str], leasekeeper_url: str, namespace: str, rounds: int
) -> dict[str, dict[str, dict[str, float]]]:
    """Time ``rounds`` rounds of every measure on every app (``{kind: url}``), and of the
    straight leasekeeper calls; 50 rounds warm up first."""
    from leasekeeper import LeaseClient

    samples: dict[str, dict[str, list[float]]] = {k: {n: [] for n in MEASURES} for k in apps}
    samples[LEASE] = {LEASE: []}
    body = json.dumps({"amount": 500}).encode()
    clients = {kind: httpx.Client(base_url=url, timeout=30) for kind, url in apps.items()}
    replay_key = str(uuid.uuid4())

    def post(kind: str, path: str, key: str) -> None:
        headers = {"content-type": "application/json", "idempotency-key": key}
        answer = clients[kind].post(path, content=body, headers=headers)
        if answer.status_code != 201:
            raise RuntimeError(f"{kind} {path} answered {answer.status_code}: {answer.text[:200]}")

    with LeaseClient(leasekeeper_url) as lk:

        def lease() -> None:
            key = str(uuid.uuid4())
            held = lk.acquire(namespace, key, ttl=30, fingerprint="f" * 64)
            lk.complete(namespace, key, held.owner_token, {"status": 201})  # type: ignore[union-attr]

        def fresh(kind: str, path: str) -> Callable[[], None]:
            return lambda: post(kind, path, str(uuid.uuid4()))

        steps: list[tuple[str, str, Callable[[], None]]] = [(LEASE, LEASE, lease)]
        for kind in apps:
            steps += [
                (kind, "unguarded", fresh(kind, "/plain/orders")),
                (kind, "first", fresh(kind, "/guarded/orders")),
                (kind, "replay", functools.partial(post, kind, "/guarded/orders", replay_key)),
            ]
        try:
            for turn in range(50 + rounds):
                for kind, name, step in steps:
                    began = time.perf_counter()
                    step()
                    if turn >= 50:
                        samples[kind][name].append(time.perf_counter() - began)
        finally:
            for client in clients.values():
                client.close()
    return {
        kind: {name: summary(values) for name, values in measures.items()}
        for kind, measures in samples.items()
    }


def start_app(kind: str, leasekeeper_url: str, namespace: str, workdir: Path) -> Process:
    port = free_port()
    argv = [sys.executable, "-m", "bench.middleware", "--serve", kind, "--port", str(port)]
    argv += ["--leasekeeper", leasekeeper_url, "--namespace", namespace]
    url = f"http://127.0.0.1:{port}"
    return start(kind, argv, url, "/plain/orders", workdir / f"{kind}.log", ready_method="GET")


def serve(kind: str, port: int, leasekeeper_url: str, namespace: str) -> None:
    """Serve the benchmark's app of ``kind`` until killed."""
    paths = ["/guarded/*"]
    if kind == "asgi":
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        from leasekeeper import IdempotencyMiddleware

        async def order(request: Request) -> JSONResponse:
            if request.method == "GET":
                return JSONResponse({"ready": True})
            return JSONResponse({"order": 1, "amount": (await request.json())["amount"]}, 201)

        routes = [
            Route(p, order, methods=["GET", "POST"]) for p in ("/plain/orders", "/guarded/orders")
        ]
        app = IdempotencyMiddleware(
            Starlette(routes=routes), leasekeeper_url, namespace=namespace, paths=paths
        )
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
        return
    from flask import Flask, request
    from werkzeug.serving import make_server

    from leasekeeper import WSGIIdempotencyMiddleware

    flask = Flask("bench")

    def flask_order() -> Any:
        if request.method == "GET":
            return {"ready": True}
        return {"order": 1, "amount": request.get_json(force=True)["amount"]}, 201

    for path in ("/plain/orders", "/guarded/orders"):
        flask.add_url_rule(path, path, flask_order, methods=["GET", "POST"])
    flask.wsgi_app = WSGIIdempotencyMiddleware(  # type: ignore[method-assign]
        flask.wsgi_app, leasekeeper_url, namespace=namespace, paths=paths
    )
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    make_server("127.0.0.1", port, flask, threaded=True).serve_forever()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=500, help="measured rounds per kind")
    parser.add_argument("--kinds", default=",".join(KINDS), help="asgi,wsgi (default both)")
    parser.add_argument("--store", default=None, help="leasekeeper's store URL (default SQLite)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--leasekeeper", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds) or args.rounds < 1:
        parser.error("--kinds takes asgi and wsgi, --rounds a positive number")
    args.kinds = kinds
    return args


def run(
    workdir: Path, rounds: int, kinds: Sequence[str] = KINDS, store: str | None = None
) -> dict[str, Any]:
    """Start leasekeeper (on ``store``, else SQLite in ``workdir``) and the apps of
    ``kinds``, time ``rounds`` rounds, and stop them: ``{"rounds": ..., "results": ...}``,
    as ``--json`` writes it and ``make bench`` (its last stage) keeps it."""
    from leasekeeper import LeaseClient

    leasekeeper = start_leasekeeper(store or f"sqlite:///{workdir / 'lk.db'}", workdir)
    apps: list[Process] = []
    try:
        with LeaseClient(leasekeeper.url) as client:
            namespace = client.create_namespace()
        for kind in kinds:
            apps.append(start_app(kind, leasekeeper.url, namespace, workdir))
        urls = {app.name: app.url for app in apps}
        results = measure(urls, leasekeeper.url, namespace, rounds)
    finally:
        for app in apps:
            app.stop()
        leasekeeper.stop()
    return {"rounds": rounds, "results": results}


def stage(workdir: Path, rounds: int) -> dict[str, Any]:
    """``make bench``'s last stage: ``run`` in ``workdir`` (made here), as
    ``{"rounds", "results", "notes"}``. A stage that fails (an app that does not start)
    is a note, as etcd's is in ``_driver``: the stores' results before it are kept."""
    print(f"\n== Idempotency-Key middleware: {rounds} rounds, one request at a time")
    workdir.mkdir()
    try:
        figures = run(workdir, rounds)
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"   skipped: {exc}")
        return {"rounds": rounds, "results": {}, "notes": [f"the middleware stage failed: {exc}"]}
    for row in report(figures["results"]).splitlines():
        print("   " + row)
    return {**figures, "notes": []}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve, args.port, args.leasekeeper, args.namespace)
        return 0
    with tempfile.TemporaryDirectory(prefix="leasekeeper-bench-mw-") as tmp:
        figures = run(Path(tmp), args.rounds, args.kinds, args.store)
    print(report(figures["results"]))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
