"""The OpenAPI 3.1 document for ``/openapi.json``, built from the request models."""

from __future__ import annotations

from typing import Any

from leasekeeper._core.secrets import NAMESPACE_PATTERN, OWNER_TOKEN_PATTERN
from leasekeeper._schemas import AcquireBody, CompleteBody, NamespaceBody, ReleaseBody, RenewBody

__all__ = ["DOCS_HTML", "openapi_document"]

_REF = "#/components/schemas/{model}"

_INT = {"type": "integer"}
_STR = {"type": "string"}
_TS = {"type": "integer", "description": "Unix seconds, rounded down"}
_ISO = {"type": "string", "description": "ISO 8601 UTC, YYYY-MM-DDTHH:MM:SSZ"}


def _obj(required: dict[str, Any], description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": description,
        "required": list(required),
        "properties": required,
    }


_RESPONSES: dict[str, dict[str, Any]] = {
    "Namespace": _obj(
        {
            "ok": {"const": True},
            "namespace": {**_STR, "pattern": "^ns_[A-Za-z0-9_-]{43}$"},
            "entropy_bits": {"const": 256},
        },
        "A new namespace. Keep it secret; it cannot be listed or recovered.",
    ),
    "Granted": _obj(
        {
            "ok": {"const": True},
            "status": {"const": "held"},
            "owner_token": {**_STR, "pattern": "^own_[A-Za-z0-9_-]{43}$"},
            "ttl_seconds": {**_INT, "minimum": 0},
            "fencing_token": {**_INT, "minimum": 1},
            "lease_expires_at_timestamp": _TS,
            "lease_expires_at": _ISO,
            "absolute_expires_at_timestamp": _TS,
            "absolute_expires_at": _ISO,
        },
        "You own the lease. Keep owner_token secret; send fencing_token with your writes.",
    ),
    "Renewed": _obj(
        {
            "ok": {"const": True},
            "status": {"const": "held"},
            "ttl_seconds": {**_INT, "minimum": 0},
            "fencing_token": {**_INT, "minimum": 1},
            "lease_expires_at_timestamp": _TS,
            "lease_expires_at": _ISO,
            "absolute_expires_at_timestamp": _TS,
            "absolute_expires_at": _ISO,
        },
        "The lease has a new expiry.",
    ),
    "Released": _obj(
        {
            "ok": {"const": True},
            "status": {"const": "released"},
            "fencing_token": {**_INT, "minimum": 1},
        },
        "The lease ended; the key can be acquired at once.",
    ),
    "Completed": _obj(
        {
            "ok": {"const": True},
            "status": {"const": "completed"},
            "completed_at": _ISO,
            "result": {"description": "The stored JSON value (secret-named fields redacted)"},
            "fencing_token": {**_INT, "minimum": 1},
            "absolute_expires_at": _ISO,
        },
        "The work is done; here is its stored result.",
    ),
    "Error": {
        "type": "object",
        "required": ["ok", "status", "error"],
        "properties": {
            "ok": {"const": False},
            "status": {
                "enum": [
                    "invalid",
                    "not_found",
                    "method_not_allowed",
                    "timeout",
                    "held",
                    "conflict",
                    "lost",
                    "too_large",
                    "rate_limited",
                    "unavailable",
                    "internal",
                ]
            },
            "error": _STR,
            "retry_after_seconds": {**_INT, "minimum": 1},
            "fencing_token": {**_INT, "minimum": 1},
            "lease_expires_at": _ISO,
            "absolute_expires_at": _ISO,
        },
    },
    "Health": _obj({"ok": {"const": True}, "status": _STR}, "The process or store is fine."),
}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": _REF.format(model=name)}


def _json(name: str, description: str, *, retry_after: bool = False) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": _ref(name)}},
    }
    if retry_after:
        response["headers"] = {
            "Retry-After": {"description": "Seconds to wait", "schema": {"type": "integer"}}
        }
    return response


_COMMON_ERRORS = {
    "400": _json("Error", "invalid: bad JSON, wrong type, or a broken rule"),
    "408": _json("Error", "timeout: the request body was not sent in time"),
    "413": _json("Error", "too_large: body over 64 KiB, or result over 32 KiB"),
    "429": _json("Error", "rate_limited", retry_after=True),
    "503": _json("Error", "unavailable: the store cannot be reached", retry_after=True),
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
    summary: str, body: str, responses: dict[str, Any], description: str
) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "description": description,
            "requestBody": {
                "required": body != "NamespaceBody",
                "content": {"application/json": {"schema": _ref(body), "example": _EXAMPLES[body]}},
            },
            "responses": {**responses, **_COMMON_ERRORS},
        }
    }


# The key's rule depends on the namespace: readable keys inside one, random ones without.
# The entropy part of the second rule (at least 100 bits by the key's own character
# frequencies) has no JSON Schema form; the description states it.
# Patterns that forbid characters are written as "contains none of" (``not`` a search):
# an anchored ``^[...]*$`` would let a trailing newline through in Python's re.
_NAMESPACED_KEY = {
    "type": "string",
    "minLength": 1,
    "maxLength": 200,
    "not": {"pattern": "[\\x00-\\x1f\\x7f-\\x9f]"},
}
_BARE_KEY = {"type": "string", "minLength": 32, "maxLength": 200, "not": {"pattern": "[^!-~]"}}
_KEY_RULE = [
    {
        "description": "With a namespace: a readable key",
        "required": ["namespace"],
        "properties": {"namespace": {"type": "string"}, "key": _NAMESPACED_KEY},
    },
    {
        "description": "Without a namespace: a random key (also: at least 100 bits of entropy)",
        "properties": {"namespace": {"type": "null"}, "key": _BARE_KEY},
    },
]


def _request_schema(model: Any) -> dict[str, Any]:
    """The model's JSON Schema with the rules its validators check written out.

    Pydantic sees plain strings where the service checks shapes (namespace, owner
    token) and a key rule that depends on the namespace; clients and fuzzers should
    see those rules too.
    """
    schema: dict[str, Any] = model.model_json_schema(ref_template=_REF)
    properties = schema.get("properties", {})
    if "namespace" in properties:
        properties["namespace"]["anyOf"] = [
            {"type": "string", "minLength": 46, "maxLength": 46, "pattern": NAMESPACE_PATTERN},
            {"type": "null"},
        ]
        schema["anyOf"] = _KEY_RULE
    if "owner_token" in properties:
        properties["owner_token"].update(minLength=47, maxLength=47, pattern=OWNER_TOKEN_PATTERN)
    if "ttl_seconds" in properties:
        properties["ttl_seconds"]["description"] = (
            "Lease length in seconds, default 60: a JSON integer written without a fraction "
            "or exponent (60, not 60.0)"
        )
    return schema


def openapi_document(base: str) -> dict[str, Any]:
    """The whole API description, with every route and body."""
    schemas: dict[str, Any] = dict(_RESPONSES)
    for model in (NamespaceBody, AcquireBody, RenewBody, ReleaseBody, CompleteBody):
        schema = _request_schema(model)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    held = _json("Error", "held (another owner; Retry-After), or conflict", retry_after=True)
    lost = _json("Error", "lost: you are not the live owner")
    acquire = _operation(
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
    health = {
        "get": {
            "summary": "Health",
            "responses": {
                "200": _json("Health", "OK"),
                "503": _json("Error", "unavailable", retry_after=True),
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "leasekeeper",
            "version": "1",
            "description": "Leases, fencing tokens and idempotent results.",
        },
        "paths": {
            f"{base}/lease/namespace": _operation(
                "Mint a namespace",
                "NamespaceBody",
                {"201": _json("Namespace", "A new namespace")},
                "Returns a 256-bit bearer secret that lets you use readable keys.",
            ),
            f"{base}/lease": acquire,
            f"{base}/lease/acquire": acquire,
            f"{base}/lease/renew": _operation(
                "Renew a lease",
                "RenewBody",
                {"200": _json("Renewed", "New expiry"), "409": lost},
                "Moves the lease expiry to min(now + ttl, absolute_expires_at).",
            ),
            f"{base}/lease/release": _operation(
                "Release a lease",
                "ReleaseBody",
                {"200": _json("Released", "Released"), "409": lost},
                "Ends ownership now; the lifecycle and fingerprint binding stay.",
            ),
            f"{base}/lease/complete": _operation(
                "Complete a lease",
                "CompleteBody",
                {"200": _json("Completed", "Stored"), "409": lost},
                "Stores the result for later callers and ends ownership for good.",
            ),
            "/healthz": health,
            "/readyz": health,
        },
        "components": {"schemas": schemas},
    }


DOCS_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>leasekeeper API</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css">
</head><body><div id="ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui"});</script>
<noscript>The machine-readable API description is at <a href="/openapi.json">/openapi.json</a>.
</noscript></body></html>
"""
