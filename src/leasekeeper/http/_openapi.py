"""The OpenAPI 3.1 document for ``/openapi.json``, built from the request models."""

from __future__ import annotations

from typing import Any

from leasekeeper._core.secrets import NAMESPACE_PATTERN, OWNER_TOKEN_PATTERN
from leasekeeper._schemas import AcquireBody, CompleteBody, NamespaceBody, ReleaseBody, RenewBody

__all__ = ["DOCS_HTML", "openapi_document"]

_REF = "#/components/schemas/{model}"

_INT = {"type": "integer"}
_STR = {"type": "string"}
# int64 where a value outgrows 32 bits: generators map a bare integer to int32 in Java,
# Go or C#, and the store-wide fencing counter passes 2^31 in weeks at full load.
_FENCE = {"type": "integer", "format": "int64", "minimum": 1, "maximum": 2**63 - 1}
_TS = {"type": "integer", "format": "int64", "description": "Unix seconds, rounded down"}
_ISO = {
    "type": "string",
    "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z$",
    "description": "ISO 8601 UTC, YYYY-MM-DDTHH:MM:SSZ",
}
_OK = {"type": "boolean", "const": True}
_NOT_OK = {"type": "boolean", "const": False}


def _word(word: str) -> dict[str, Any]:
    return {"type": "string", "const": word}


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
            "ok": _OK,
            "namespace": {**_STR, "pattern": "^ns_[A-Za-z0-9_-]{43}$"},
            "entropy_bits": {"type": "integer", "const": 256},
        },
        "A new namespace. Keep it secret; it cannot be listed or recovered.",
    ),
    "Granted": _obj(
        {
            "ok": _OK,
            "status": _word("held"),
            "owner_token": {**_STR, "pattern": "^own_[A-Za-z0-9_-]{43}$"},
            "ttl_seconds": {**_INT, "minimum": 0},
            "fencing_token": _FENCE,
            "lease_expires_at_timestamp": _TS,
            "lease_expires_at": _ISO,
            "absolute_expires_at_timestamp": _TS,
            "absolute_expires_at": _ISO,
        },
        "You own the lease. Keep owner_token secret; send fencing_token with your writes.",
    ),
    "Renewed": _obj(
        {
            "ok": _OK,
            "status": _word("held"),
            "ttl_seconds": {**_INT, "minimum": 0},
            "fencing_token": _FENCE,
            "lease_expires_at_timestamp": _TS,
            "lease_expires_at": _ISO,
            "absolute_expires_at_timestamp": _TS,
            "absolute_expires_at": _ISO,
        },
        "The lease has a new expiry.",
    ),
    "Released": _obj(
        {
            "ok": _OK,
            "status": _word("released"),
            "fencing_token": _FENCE,
        },
        "The lease ended; the key can be acquired at once.",
    ),
    "Completed": _obj(
        {
            "ok": _OK,
            "status": _word("completed"),
            "completed_at": _ISO,
            "result": {"description": "The stored JSON value (secret-named fields redacted)"},
            "fencing_token": _FENCE,
            "absolute_expires_at": _ISO,
        },
        "The work is done; here is its stored result.",
    ),
    "Error": {
        "type": "object",
        "required": ["ok", "status", "error"],
        "properties": {
            "ok": _NOT_OK,
            "status": {
                "type": "string",
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
                ],
            },
            "error": _STR,
            "retry_after_seconds": {**_INT, "minimum": 1},
            "fencing_token": _FENCE,
            "lease_expires_at": _ISO,
            "absolute_expires_at": _ISO,
        },
    },
    "Held": _obj(
        {
            "ok": _NOT_OK,
            "status": _word("held"),
            "error": _STR,
            "retry_after_seconds": {**_INT, "minimum": 1},
            "fencing_token": _FENCE,
            "lease_expires_at": _ISO,
            "absolute_expires_at": _ISO,
        },
        "Another owner holds the lease: retry after retry_after_seconds (the Retry-After header).",
    ),
    "Conflict": _obj(
        {
            "ok": _NOT_OK,
            "status": _word("conflict"),
            "error": _STR,
            "absolute_expires_at": _ISO,
        },
        "The key is bound to another fingerprint until absolute_expires_at.",
    ),
    "Lost": _obj(
        {"ok": _NOT_OK, "status": _word("lost"), "error": _STR},
        "You are not (or no longer) the live owner.",
    ),
    "Alive": _obj({"ok": _OK, "status": _word("alive")}, "The process is running."),
    "Ready": _obj({"ok": _OK, "status": _word("ready")}, "The store can be reached and written."),
}


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


def _one_of(description: str, *names: str, retry_after: str | None = None) -> dict[str, Any]:
    """A response that is one of ``names``' bodies, told apart by their ``status``."""
    schema = {
        "oneOf": [_ref(name) for name in names],
        "discriminator": {
            "propertyName": "status",
            "mapping": {name.lower(): _REF.format(model=name) for name in names},
        },
    }
    return _json(schema, description, retry_after=retry_after)


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


# The key's rule depends on the namespace: readable keys inside one, random ones without.
# The entropy part of the second rule (at least 100 bits of estimated guessing entropy,
# _core/keyguess.py) has no JSON Schema form; the description states it.
# Patterns that forbid characters are written as "contains none of" (``not`` a search):
# an anchored ``^[...]*$`` would let a trailing newline through in Python's re.
_NAMESPACED_KEY = {
    "type": "string",
    "minLength": 1,
    "maxLength": 200,
    "not": {"pattern": "[\\x00-\\x1f\\x7f-\\x9f]"},
}
_BARE_KEY = {"type": "string", "minLength": 32, "maxLength": 200, "not": {"pattern": "[^!-~]"}}
# As if/then/else on one flat object, not an anyOf of two: client generators turn an
# anyOf into two partial models and lose the other fields.
_KEY_RULE = {
    "if": {"required": ["namespace"], "properties": {"namespace": {"type": "string"}}},
    "then": {
        "description": "With a namespace: a readable key",
        "properties": {"key": _NAMESPACED_KEY},
    },
    "else": {
        "description": "Without a namespace: a random key (also: at least 100 bits of entropy)",
        "properties": {"key": _BARE_KEY},
    },
}


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
        properties["key"].update(minLength=1, maxLength=200)
        schema.update(_KEY_RULE)
    if "owner_token" in properties:
        properties["owner_token"].update(minLength=47, maxLength=47, pattern=OWNER_TOKEN_PATTERN)
    if "ttl_seconds" in properties:
        properties["ttl_seconds"]["description"] = (
            "Lease length in seconds, default 60 (null too means 60): a JSON integer written "
            "without a fraction or exponent (60, not 60.0)"
        )
        properties["ttl_seconds"]["default"] = 60
    return schema


def openapi_document(base: str) -> dict[str, Any]:
    """The whole API description, with every route and body."""
    schemas: dict[str, Any] = dict(_RESPONSES)
    for model in (NamespaceBody, AcquireBody, RenewBody, ReleaseBody, CompleteBody):
        schema = _request_schema(model)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    held = _one_of(
        "held (another owner; Retry-After), or conflict",
        "Held",
        "Conflict",
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


#: Swagger UI for ``/docs``, from jsDelivr, pinned to one release and checked by the
#: browser against these hashes (Subresource Integrity): a CDN that served anything
#: else would run script on the service's own origin. The hashes are SHA-384 of the
#: files in npm's ``swagger-ui-dist-5.35.0.tgz`` (whose own sha512 matched the npm
#: registry's), which jsDelivr serves byte for byte. To move to another release,
#: recompute both from its tarball: ``openssl dgst -sha384 -binary FILE | base64``.
_SWAGGER_UI = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5.35.0"
_SWAGGER_CSS_SRI = "sha384-WlYgdmXYOOBWL5apwjDEZwN+U3HmXSSu5R6V5aGxEcf7z+KuRNwBhoxKVN1i3D5I"
_SWAGGER_JS_SRI = "sha384-gjRm0bEPMeTmMh5jT2cHccIwCUZSTd8YC+j0d0sXw0MdGEfScduGpSyF3ZSSLkX9"
#: no-referrer: the CDN is not told the address the docs were opened at.
DOCS_HTML = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>leasekeeper API</title>
<link rel="stylesheet" href="{_SWAGGER_UI}/swagger-ui.css"
 integrity="{_SWAGGER_CSS_SRI}" crossorigin="anonymous" referrerpolicy="no-referrer">
</head><body><div id="ui"></div>
<script src="{_SWAGGER_UI}/swagger-ui-bundle.js"
 integrity="{_SWAGGER_JS_SRI}" crossorigin="anonymous" referrerpolicy="no-referrer"></script>
<script>SwaggerUIBundle({{url: "/openapi.json", dom_id: "#ui"}});</script>
<noscript>The machine-readable API description is at <a href="/openapi.json">/openapi.json</a>.
</noscript></body></html>
"""
