"""One small shop as a Starlette app and as a Flask app, for the middleware's tests.

Routes (both apps): ``POST /orders`` (201, JSON, ``Location``, a ``Set-Cookie``; waits
while ``shop.gate`` is closed, then ``shop.hold`` seconds, then checks its lease),
``POST /crash`` (raises the first time), ``POST /fail`` (500), ``POST /big`` (40,000
bytes in four chunks), ``POST /binary``, ``POST /nothing`` (204), ``POST /lost``
(answers once its lease is lost), ``GET /orders``. ``shop.calls`` counts the handler runs per route.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from flask import Flask, request
from flask import Response as FlaskResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from leasekeeper import LeaseLost
from leasekeeper.web import RequestLease

BIG_CHUNK = b"0123456789" * 1000
BINARY = bytes(range(256)) * 2


class Shop:
    """What the handlers did: their runs, the fences they were given, what they saw."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: collections.Counter[str] = collections.Counter()
        #: Set when a /orders handler has started; it then waits for ``gate``.
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.hold = 0.0
        self.fences: list[int | None] = []
        #: For each /orders run: whether its lease was still held at the end.
        self.held_at_end: list[bool] = []

    def run(self, route: str, lease: RequestLease | None) -> int:
        with self._lock:
            self.calls[route] += 1
            self.fences.append(lease.fencing_token if lease is not None else None)
            return self.calls[route]

    def still_held(self, lease: RequestLease | None) -> None:
        try:
            if lease is not None:
                lease.check()
            self.held_at_end.append(lease is not None)
        except LeaseLost:
            self.held_at_end.append(False)


def _order(
    number: int, body: Any, lease: RequestLease | None
) -> tuple[dict[str, Any], dict[str, str]]:
    amount = body.get("amount") if isinstance(body, dict) else None
    payload = {"order": number, "amount": amount, "fence": lease and lease.fencing_token}
    return payload, {"location": f"/orders/{number}", "set-cookie": "session=s3cr3t"}


def starlette_app(shop: Shop) -> Starlette:
    def lease_of(req: Request) -> RequestLease | None:
        lease: RequestLease | None = getattr(req.state, "leasekeeper", None)
        return lease

    async def orders(req: Request) -> JSONResponse:
        lease = lease_of(req)
        number = shop.run("orders", lease)
        shop.entered.set()
        await asyncio.to_thread(shop.gate.wait, 30)
        await asyncio.sleep(shop.hold)
        shop.still_held(lease)
        payload, headers = _order(number, await req.json(), lease)
        return JSONResponse(payload, status_code=201, headers=headers)

    async def list_orders(req: Request) -> JSONResponse:
        return JSONResponse({"orders": shop.calls["orders"]})

    async def crash(req: Request) -> JSONResponse:
        attempt = shop.run("crash", lease_of(req))
        if attempt == 1:
            raise RuntimeError("the first attempt crashes")
        return JSONResponse({"attempt": attempt}, status_code=201)

    async def fail(req: Request) -> JSONResponse:
        return JSONResponse({"attempt": shop.run("fail", lease_of(req))}, status_code=500)

    async def big(req: Request) -> StreamingResponse:
        shop.run("big", lease_of(req))

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(4):
                yield BIG_CHUNK

        return StreamingResponse(chunks(), media_type="text/plain", headers={"etag": '"big"'})

    async def binary(req: Request) -> PlainTextResponse:
        shop.run("binary", lease_of(req))
        return PlainTextResponse(BINARY, media_type="application/octet-stream")

    async def nothing(req: Request) -> Response:
        shop.run("nothing", lease_of(req))
        return Response(status_code=204, headers={"etag": '"none"'})

    async def lost(req: Request) -> JSONResponse:
        lease = lease_of(req)
        shop.run("lost", lease)
        for _ in range(500):
            if lease is None or lease.lost:
                break
            await asyncio.sleep(0.01)
        return JSONResponse({"lost": bool(lease and lease.lost)}, status_code=201)

    return Starlette(
        routes=[
            Route("/orders", orders, methods=["POST"]),
            Route("/orders", list_orders, methods=["GET"]),
            Route("/crash", crash, methods=["POST"]),
            Route("/fail", fail, methods=["POST"]),
            Route("/big", big, methods=["POST"]),
            Route("/binary", binary, methods=["POST"]),
            Route("/lost", lost, methods=["POST"]),
            Route("/nothing", nothing, methods=["POST"]),
        ]
    )


def flask_app(shop: Shop) -> Flask:
    app = Flask("shop")

    def lease_of() -> RequestLease | None:
        lease: RequestLease | None = request.environ.get("leasekeeper.lease")
        return lease

    @app.post("/orders")
    def orders() -> Any:
        lease = lease_of()
        number = shop.run("orders", lease)
        shop.entered.set()
        shop.gate.wait()
        time.sleep(shop.hold)
        shop.still_held(lease)
        payload, headers = _order(number, request.get_json(force=True, silent=True), lease)
        return payload, 201, headers

    @app.get("/orders")
    def list_orders() -> Any:
        return {"orders": shop.calls["orders"]}

    @app.post("/crash")
    def crash() -> Any:
        attempt = shop.run("crash", lease_of())
        if attempt == 1:
            raise RuntimeError("the first attempt crashes")
        return {"attempt": attempt}, 201

    @app.post("/fail")
    def fail() -> Any:
        return {"attempt": shop.run("fail", lease_of())}, 500

    @app.post("/big")
    def big() -> Any:
        shop.run("big", lease_of())

        def chunks() -> Iterator[bytes]:
            for _ in range(4):
                yield BIG_CHUNK

        return FlaskResponse(chunks(), mimetype="text/plain", headers={"etag": '"big"'})

    @app.post("/binary")
    def binary() -> Any:
        shop.run("binary", lease_of())
        return FlaskResponse(BINARY, mimetype="application/octet-stream")

    @app.post("/nothing")
    def nothing() -> Any:
        shop.run("nothing", lease_of())
        return FlaskResponse(status=204, headers={"etag": '"none"'})

    @app.post("/lost")
    def lost() -> Any:
        lease = lease_of()
        shop.run("lost", lease)
        for _ in range(500):
            if lease is None or lease.lost:
                break
            time.sleep(0.01)
        return {"lost": bool(lease and lease.lost)}, 201

    return app
