"""Webhook events from a queue: each event is handled once, however often it is delivered.

A webhook receiver often answers the sender at once and puts the event on a queue for
workers. Queues deliver at least once: a message comes again when its worker was slow to
acknowledge it or crashed, and two workers can get copies of it at the same time. The
event's id is the key and a hash of the message the fingerprint: the first worker takes
the lease, charges, and stores its outcome with ``complete``; a copy that comes later gets
that outcome back; a copy that comes while the first is at work waits for it (``wait``);
the same id with another payload is set aside for a person to look at.

    python examples/webhook_queue.py     # a demo against `make serve`: four deliveries

A web app whose requests carry an ``Idempotency-Key`` header needs none of this:
``IdempotencyMiddleware`` does it for the whole request and response (docs/middleware.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from typing import Any

from leasekeeper import AsyncLeaseClient, FingerprintConflict, LeaseHeld

URL = os.environ.get("LEASEKEEPER_URL", "http://127.0.0.1:8787")

#: The side effect to do once per event: here, a list standing for the payment system.
CHARGES: list[dict[str, Any]] = []


async def charge(event: dict[str, Any], fencing_token: int) -> dict[str, Any]:
    await asyncio.sleep(0.3)  # the payment system takes its time
    CHARGES.append({"event": event["id"], "amount": event["amount"], "fence": fencing_token})
    return {"charged": event["amount"], "charge_id": f"ch_{len(CHARGES)}"}


async def handle(leases: AsyncLeaseClient, namespace: str, message: bytes) -> tuple[str, Any]:
    """What to do with one delivery: ``("ack", outcome)`` once the event is handled, now
    or before; ``("dead-letter", why)``; ``("retry", seconds)`` to have it delivered
    again later. If ``charge`` raises, the lease is released, nothing is stored, and the
    queue's redelivery (the message was not acknowledged) runs it again."""
    event = json.loads(message)
    key = f"webhook:payments:{event['id']}"
    fingerprint = hashlib.sha256(message).hexdigest()
    try:
        async with leases.lease(namespace, key, ttl=30, fingerprint=fingerprint, wait=10) as lease:
            if lease.completed:  # handled before: acknowledge with the first outcome
                return "ack", {**lease.result, "replayed": True}
            lease.check()
            return "ack", await lease.complete(await charge(event, lease.fencing_token))
    except FingerprintConflict:  # the same id with another payload: not for a worker to guess
        return "dead-letter", "event id reused for another payload"
    except LeaseHeld as held:  # another worker still at it after 10 s: come back later
        return "retry", held.retry_after_seconds


async def demo() -> None:
    event = {"id": "evt_1NXw", "type": "payment.succeeded", "amount": 4200}
    message = json.dumps(event).encode()
    forged = json.dumps({**event, "amount": 1}).encode()
    # (seconds after the start, message): the event; a copy while the first is being
    # handled; a redelivery after it was; the same id with another amount.
    deliveries = [(0.0, message), (0.1, message), (1.0, message), (1.1, forged)]
    async with AsyncLeaseClient(URL) as leases:
        namespace = await leases.create_namespace()  # in an app: from its secrets

        async def worker(at: float, delivered: bytes) -> tuple[str, Any]:
            await asyncio.sleep(at)
            return await handle(leases, namespace, delivered)

        outcomes = await asyncio.gather(*(worker(at, m) for at, m in deliveries))
    for number, (action, outcome) in enumerate(outcomes, 1):
        print(f"delivery {number}: {action} {outcome}")
    assert len(CHARGES) == 1  # charged once
    assert [action for action, _ in outcomes] == ["ack", "ack", "ack", "dead-letter"]
    # Whichever of the first two got the lease charged; the others got its outcome back.
    assert {outcome["charge_id"] for _, outcome in outcomes[:3]} == {"ch_1"}
    replayed = [outcome.get("replayed", False) for _, outcome in outcomes[:3]]
    assert replayed.count(False) == 1


if __name__ == "__main__":
    asyncio.run(demo())
