"""A payment webhook receiver that charges each event once, however often it is delivered.

Webhook senders deliver again when they do not get an answer in time, and several
deliveries of one event can arrive at once. Here ``IdempotencyMiddleware`` runs the
handler once per ``Idempotency-Key`` (the event's id) and hands every redelivery the
first answer; the handler writes through a ``FenceGuard`` with its lease's fencing
token, so a delivery that lost its lease (paused past its TTL) cannot write after a
newer one. docs/middleware.md walks through it with curl.

    leasekeeper serve                              # leasekeeper, on 127.0.0.1:8787
    python examples/webhook_middleware.py          # this app, on 127.0.0.1:8000

``LEASEKEEPER_URL`` says where leasekeeper is, and ``LEASEKEEPER_NAMESPACE`` which
namespace to use (without it one is minted at start, so keys do not outlive a
restart). Charges are kept in memory. Needs Starlette and uvicorn.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from leasekeeper import IdempotencyMiddleware, LeaseClient
from leasekeeper.client import FenceGuard
from leasekeeper.web import RequestLease

db = sqlite3.connect(":memory:", check_same_thread=False)
db.execute("CREATE TABLE charges (id INTEGER PRIMARY KEY, event TEXT, amount INTEGER)")
guard = FenceGuard(db)
guard.create_table()
db.commit()


async def payment_event(request: Request) -> JSONResponse:
    """Charge the event's amount: one row per event, written under the lease's fence."""
    event = await request.json()
    lease: RequestLease = request.state.leasekeeper
    with db:  # one transaction: the fence check and the write commit together
        guard.check(f"charge:{event['id']}", lease.fencing_token)  # StaleFence if newer
        row = db.execute(
            "INSERT INTO charges (event, amount) VALUES (?, ?)", (event["id"], event["amount"])
        )
    charge = {"charge": row.lastrowid, "event": event["id"], "amount": event["amount"]}
    return JSONResponse(charge, status_code=201, headers={"location": f"/charges/{row.lastrowid}"})


async def charges(request: Request) -> JSONResponse:
    rows = db.execute("SELECT id, event, amount FROM charges ORDER BY id").fetchall()
    return JSONResponse([{"charge": i, "event": e, "amount": a} for i, e, a in rows])


def build_app(leasekeeper_url: str, namespace: str) -> IdempotencyMiddleware:
    shop = Starlette(
        routes=[
            Route("/webhooks/payments", payment_event, methods=["POST"]),
            Route("/charges", charges, methods=["GET"]),
        ]
    )
    return IdempotencyMiddleware(
        shop,
        leasekeeper_url,
        namespace=namespace,
        paths=["/webhooks/*"],  # only the webhooks; other POSTs pass through
        required=True,  # a delivery without a key is refused (400), not run unguarded
        ttl=30,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    url = os.environ.get("LEASEKEEPER_URL", "http://127.0.0.1:8787")
    namespace = os.environ.get("LEASEKEEPER_NAMESPACE")
    if not namespace:
        with LeaseClient(url) as client:
            namespace = client.create_namespace()
        print(
            "minted a namespace for this run (set LEASEKEEPER_NAMESPACE to keep one)",
            file=sys.stderr,
        )
    uvicorn.run(build_app(url, namespace), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
