"""Webhook idempotency: a delivery the sender retries is handled once.

The event's id is the key and a hash of the body the fingerprint. A retry of the same
event gets the first answer back; another body under the same id is refused (422); a
delivery that arrives while the first is still being handled is told to retry (409).

    python examples/webhook.py     # a demo against `make serve`: three deliveries, in process

In an application, build the app with make_app(AsyncLeaseClient(url), namespace) and serve
it with uvicorn, the namespace read from the application's secrets.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from leasekeeper import AsyncLeaseClient, FingerprintConflict, LeaseHeld

URL = os.environ.get("LEASEKEEPER_URL", "http://127.0.0.1:8787")

#: The side effect to do once per event: here, a list standing for the payment system.
CHARGES: list[dict[str, Any]] = []


async def charge(event: dict[str, Any], fencing_token: int) -> dict[str, Any]:
    CHARGES.append({"amount": event["amount"], "fence": fencing_token})
    return {"charged": event["amount"], "charge_id": f"ch_{len(CHARGES)}"}


def make_app(leases: AsyncLeaseClient, namespace: str) -> Starlette:
    async def payment_webhook(request: Request) -> JSONResponse:
        body = await request.body()
        event = json.loads(body)
        key = f"webhook:payments:{event['id']}"
        fingerprint = hashlib.sha256(body).hexdigest()
        try:
            async with leases.lease(
                namespace, key, ttl=30, fingerprint=fingerprint, wait=10
            ) as lease:
                if lease.completed:  # a retry: answer as the first time
                    return JSONResponse({**lease.result, "replayed": True})
                lease.check()
                outcome = await charge(event, lease.fencing_token)
                return JSONResponse(await lease.complete(outcome))
        except FingerprintConflict:
            return JSONResponse({"error": "event id reused for another payload"}, status_code=422)
        except LeaseHeld as held:  # still being handled after 10 s: the sender retries later
            return JSONResponse(
                {"error": "being handled"},
                status_code=409,
                headers={"Retry-After": str(held.retry_after_seconds)},
            )

    return Starlette(routes=[Route("/webhooks/payments", payment_webhook, methods=["POST"])])


async def demo() -> None:
    async with AsyncLeaseClient(URL) as leases:
        namespace = await leases.create_namespace()
        app = make_app(leases, namespace)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as sender:
            event = json.dumps({"id": "evt_1NXw", "type": "payment.succeeded", "amount": 4200})
            first = await sender.post("/webhooks/payments", content=event)
            retry = await sender.post("/webhooks/payments", content=event)
            forged = await sender.post("/webhooks/payments", content=event.replace("4200", "1"))
    for name, answer in (("first", first), ("retry", retry), ("other body", forged)):
        print(name, answer.status_code, answer.json())
    assert first.status_code == retry.status_code == 200
    assert retry.json() == {**first.json(), "replayed": True}
    assert forged.status_code == 422
    assert len(CHARGES) == 1  # charged once


if __name__ == "__main__":
    asyncio.run(demo())
