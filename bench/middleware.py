"""``python -m bench.middleware``: what the Idempotency-Key middleware adds to a request.

Starts ``leasekeeper serve`` (SQLite in a temporary directory, as a user runs it) and
one app per kind: a Starlette app under uvicorn (``IdempotencyMiddleware``) and a
Flask app under werkzeug's threaded server (``WSGIIdempotencyMiddleware``). Each app
serves one handler (a 201 with a small JSON body) at two paths: ``/plain/orders``,
which the middleware does not guard (``paths=["/guarded/*"]``), and
``/guarded/orders``. Over one keep-alive connection, requests go one at a time, in
rounds of four, so that a busy machine slows every kind alike:

- ``unguarded``: ``/plain/orders``, with an ``Idempotency-Key`` (the header lookup),
- ``first``: ``/guarded/orders`` with a new key (leasekeeper's acquire and complete),
- ``replay``: ``/guarded/orders`` with a key already completed (one acquire),
- ``lease``: for scale, the acquire and complete a guarded request makes, sent
  straight to leasekeeper by ``LeaseClient``.

It prints the median, 90th and 99th percentile latency of each, and what ``first`` and
``replay`` add to ``unguarded`` at the median. A few seconds per kind and 500 rounds.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench._procs import Process, free_port, start, start_leasekeeper

KINDS = ("asgi", "wsgi")
MEASURES = ("unguarded", "first", "replay", "lease")


def summary(samples: list[float]) -> dict[str, float]:
    """Median, p90 and p99 of ``samples`` (seconds), in milliseconds."""
    ordered = sorted(samples)

    def at(fraction: float) -> float:
        return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))] * 1000

    return {"median": statistics.median(ordered) * 1000, "p90": at(0.9), "p99": at(0.99)}


def report(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """The table: one row per kind and measure, and the added latency at the median."""
    lines = [f"{'kind':<6}{'measure':<11}{'median ms':>10}{'p90 ms':>9}{'p99 ms':>9}"]
    for kind, measures in results.items():
        for name in MEASURES:
            s = measures[name]
            lines.append(f"{kind:<6}{name:<11}{s['median']:>10.2f}{s['p90']:>9.2f}{s['p99']:>9.2f}")
        base = measures["unguarded"]["median"]
        lines.append(
            f"{kind:<6}added: first {measures['first']['median'] - base:+.2f} ms, "
            f"replay {measures['replay']['median'] - base:+.2f} ms (medians)"
        )
    return "\n".join(lines)


def measure(app_url: str, leasekeeper_url: str, namespace: str, rounds: int) -> dict[str, Any]:
    """Time ``rounds`` rounds of the four measures against one app; 50 rounds warm up."""
    from leasekeeper import LeaseClient

    samples: dict[str, list[float]] = {name: [] for name in MEASURES}
    body = json.dumps({"amount": 500}).encode()
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=app_url, timeout=30) as app, LeaseClient(leasekeeper_url) as lk:
        replay_key = str(uuid.uuid4())

        def post(path: str, key: str) -> None:
            answer = app.post(path, content=body, headers={**headers, "idempotency-key": key})
            if answer.status_code != 201:
                raise RuntimeError(f"{path} answered {answer.status_code}: {answer.text[:200]}")

        def lease() -> None:
            key = str(uuid.uuid4())
            held = lk.acquire(namespace, key, ttl=30, fingerprint="f" * 64)
            lk.complete(namespace, key, held.owner_token, {"status": 201})  # type: ignore[union-attr]

        steps: dict[str, Callable[[], None]] = {
            "unguarded": lambda: post("/plain/orders", str(uuid.uuid4())),
            "first": lambda: post("/guarded/orders", str(uuid.uuid4())),
            "replay": lambda: post("/guarded/orders", replay_key),
            "lease": lease,
        }
        for turn in range(50 + rounds):
            for name, step in steps.items():
                began = time.perf_counter()
                step()
                if turn >= 50:
                    samples[name].append(time.perf_counter() - began)
    return {name: summary(values) for name, values in samples.items()}


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve, args.port, args.leasekeeper, args.namespace)
        return 0
    from leasekeeper import LeaseClient

    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="leasekeeper-bench-mw-") as tmp:
        workdir = Path(tmp)
        leasekeeper = start_leasekeeper(args.store or f"sqlite:///{workdir / 'lk.db'}", workdir)
        try:
            with LeaseClient(leasekeeper.url) as client:
                namespace = client.create_namespace()
            for kind in args.kinds:
                app = start_app(kind, leasekeeper.url, namespace, workdir)
                try:
                    results[kind] = measure(app.url, leasekeeper.url, namespace, args.rounds)
                finally:
                    app.stop()
        finally:
            leasekeeper.stop()
    print(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps({"rounds": args.rounds, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
