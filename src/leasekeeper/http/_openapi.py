"""The OpenAPI 3.1 document for ``/openapi.json``, derived from the request models
(``leasekeeper._schemas``) and the reply types (``leasekeeper._replies``)."""

from __future__ import annotations

import copy
import functools
from typing import Annotated, Any

from pydantic import Field, TypeAdapter
from pydantic.json_schema import JsonSchemaMode

from leasekeeper import _replies as replies
from leasekeeper._schemas import AcquireBody, CompleteBody, NamespaceBody, ReleaseBody, RenewBody

__all__ = ["openapi_document"]

_REF = "#/components/schemas/{model}"

#: The types the document names; the error shapes come in through the two unions.
_TYPES: dict[str, Any] = {
    **{
        kind.__name__: kind
        for kind in (
            *(NamespaceBody, AcquireBody, RenewBody, ReleaseBody, CompleteBody),
            *(replies.Namespace, replies.Granted, replies.Renewed, replies.Released),
            *(replies.Completed, replies.Lost, replies.Alive, replies.Ready),
        )
    },
    "Error": replies.Error,
    "HeldOrConflict": Annotated[replies.Held | replies.Conflict, Field(discriminator="status")],
}


@functools.cache
def _schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """The components, and the acquire's 409 body (held or conflict, written in place).

    Derived once per process (pydantic builds a core schema for each type): every app
    a test suite makes would pay for it again. Callers take a copy."""
    mode: JsonSchemaMode = "validation"
    inputs = [(name, mode, TypeAdapter(kind)) for name, kind in _TYPES.items()]
    schemas, defs = TypeAdapter.json_schemas(inputs, ref_template=_REF)
    components: dict[str, Any] = {**defs["$defs"], "Error": schemas["Error", mode]}
    return components, schemas["HeldOrConflict", mode]


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": _REF.format(model=name)}


def _json(
    body: str | dict[str, Any], description: str, *, retry_after: str | None = None
) -> dict[str, Any]:
    """A JSON response: ``body`` names a component schema, or is a schema itself;
    ``retry_after`` describes its ``Retry-After`` header, when it has one."""
    schema = _ref(body) if isinstance(body, str) else body
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": schema}},
    }
    if retry_after is not None:
        response["headers"] = {
            "Retry-After": {"description": retry_after, "schema": {"type": "integer"}}
        }
    return response


_WAIT = "Seconds to wait"
_COMMON_ERRORS = {
    "400": _json("Error", "invalid: bad JSON, wrong type, or a broken rule"),
    "408": _json("Error", "timeout: the request body was not sent in time"),
    "413": _json("Error", "too_large: body over 64 KiB, or result over 32 KiB"),
    "429": _json("Error", "rate_limited", retry_after=_WAIT),
    "500": _json("Error", "internal: an unforeseen failure (no details are given)"),
    "503": _json("Error", "unavailable: the store cannot be reached", retry_after=_WAIT),
    "default": _json("Error", "any other refusal, in the same shape"),
}

_NS = "ns_XbO8a6V9e5dMWYqghfPV3ykHTNpR3oZ0fQJm4l7K2nE"
_OWNER = "own_6-DXEvQNKM4GG8_Y0PrPcSP1sR0Z9h11ybeTYPiQ0J8"
_KEYED = {"namespace": _NS, "key": "invoice:2026-09-05"}
_EXAMPLES: dict[str, dict[str, Any]] = {
    "NamespaceBody": {},
    "AcquireBody": {**_KEYED, "ttl_seconds": 60, "fingerprint": "charge-order-501"},
    "RenewBody": {**_KEYED, "owner_token": _OWNER, "ttl_seconds": 120},
    "ReleaseBody": {**_KEYED, "owner_token": _OWNER},
    "CompleteBody": {**_KEYED, "owner_token": _OWNER, "result": {"receipt_id": 4817}},
}


def _operation(
    operation_id: str, summary: str, body: str, responses: dict[str, Any], description: str
) -> dict[str, Any]:
    return {
        "post": {
            "operationId": operation_id,
            "tags": ["lease"],
            "summary": summary,
            "description": description,
            "requestBody": {
                "required": body != "NamespaceBody",
                "content": {"application/json": {"schema": _ref(body), "example": _EXAMPLES[body]}},
            },
            "responses": {**responses, **_COMMON_ERRORS},
        }
    }


def openapi_document(base: str) -> dict[str, Any]:
    """The whole API description, with every route and body."""
    schemas, held_or_conflict = copy.deepcopy(_schemas())
    held = _json(
        held_or_conflict,
        "held (another owner; Retry-After), or conflict",
        retry_after="Seconds to wait: sent with held only (a conflict is not waited out)",
    )
    lost = _json("Lost", "lost: you are not the live owner")
    acquire = _operation(
        "acquireLease",
        "Acquire a lease",
        "AcquireBody",
        {
            "201": _json("Granted", "A new owner: you"),
            "200": _json("Completed", "Completed earlier: the stored result"),
            "409": held,
        },
        "Decided in order: new lifecycle (201), fingerprint conflict (409 conflict), "
        "completed (200), live lease (409 held), otherwise a new owner (201).",
    )
    alias = {"post": {**acquire["post"], "operationId": "acquireLeaseAlias"}}
    alive = {
        "get": {
            "operationId": "getHealth",
            "tags": ["health"],
            "summary": "Is the process running",
            "responses": {"200": _json("Alive", "alive")},
        }
    }
    ready = {
        "get": {
            "operationId": "getReady",
            "tags": ["health"],
            "summary": "Can the store be reached and written",
            "responses": {
                "200": _json("Ready", "ready"),
                "503": _json("Error", "unavailable", retry_after=_WAIT),
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "leasekeeper",
            "version": "1",
            "description": (
                "Leases, fencing tokens and idempotent results. Bodies are strict JSON, "
                "beyond what the schemas say: one object of at most 64 KiB (413 "
                "too_large past it); NaN, Infinity, a repeated name, a lone surrogate, "
                "nesting deeper than 64 levels and an integer of more than 4,300 digits "
                "are 400 invalid. A UTF-8 byte-order mark before a body is ignored."
            ),
        },
        "paths": {
            f"{base}/lease/namespace": _operation(
                "createNamespace",
                "Mint a namespace",
                "NamespaceBody",
                {"201": _json("Namespace", "A new namespace")},
                "Returns a 256-bit bearer secret that lets you use readable keys.",
            ),
            f"{base}/lease": acquire,
            f"{base}/lease/acquire": alias,
            f"{base}/lease/renew": _operation(
                "renewLease",
                "Renew a lease",
                "RenewBody",
                {"200": _json("Renewed", "New expiry"), "409": lost},
                "Moves the lease expiry to min(now + ttl, absolute_expires_at).",
            ),
            f"{base}/lease/release": _operation(
                "releaseLease",
                "Release a lease",
                "ReleaseBody",
                {"200": _json("Released", "Released"), "409": lost},
                "Ends ownership now; the lifecycle and fingerprint binding stay.",
            ),
            f"{base}/lease/complete": _operation(
                "completeLease",
                "Complete a lease",
                "CompleteBody",
                {"200": _json("Completed", "Stored"), "409": lost},
                "Stores the result for later callers and ends ownership for good.",
            ),
            "/healthz": alive,
            "/readyz": ready,
        },
        "components": {"schemas": schemas},
    }
