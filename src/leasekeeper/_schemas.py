"""The request bodies: each field's type and bounds declared once, and the models.

The OpenAPI request schemas, the MCP input schemas (``tool_input_schema``), the docs'
field tables (``field_table``) and the error texts (``FIELD_RULES``) derive from them.
Pydantic validates strictly (``true``, ``"60"`` and ``1.5`` are not integers) and
refuses unknown fields; ``null`` for an optional field is the same as leaving it out.
Every failure is ``InvalidRequest`` naming the field and its rule, never the value.
The secrets' shapes and the key rules are checked by ``_KeyBody._check_key`` (the
declarations give their JSON Schema only).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from leasekeeper._core import secrets, validation
from leasekeeper._core.secrets import ENCODED_CHARS, NAMESPACE_PREFIX, OWNER_PREFIX
from leasekeeper._core.validation import (
    DEFAULT_TTL_SECONDS,
    MAX_FINGERPRINT_CHARS,
    MAX_KEY_CHARS,
    MAX_TTL_SECONDS,
    MAX_WAIT_SECONDS,
    MIN_BARE_KEY_BITS,
    MIN_BARE_KEY_CHARS,
)
from leasekeeper._errors import InvalidRequest

__all__ = [
    "DEFAULT_TTL_SECONDS",
    "AcquireBody",
    "CompleteBody",
    "FieldRow",
    "NamespaceBody",
    "NamespaceStr",
    "OwnerTokenStr",
    "ReleaseBody",
    "RenewBody",
    "field_table",
    "parse_body",
    "tool_input_schema",
]


def _shape(length: int, pattern: str) -> Any:
    """A secret's shape as JSON Schema, which ``_KeyBody._check_key`` checks."""
    return Field(json_schema_extra={"minLength": length, "maxLength": length, "pattern": pattern})


NamespaceStr = Annotated[str, _shape(secrets.NAMESPACE_LENGTH, secrets.NAMESPACE_PATTERN)]
OwnerTokenStr = Annotated[str, _shape(secrets.OWNER_TOKEN_LENGTH, secrets.OWNER_TOKEN_PATTERN)]
#: What both key rules allow; ``_KEY_RULE`` says which one applies.
_KeyStr = Annotated[str, Field(json_schema_extra={"minLength": 1, "maxLength": MAX_KEY_CHARS})]
_Ttl = Annotated[
    Annotated[int, Field(ge=1, le=MAX_TTL_SECONDS)] | None,
    Field(
        description=f"Lease length in seconds, 1 to {MAX_TTL_SECONDS}, default "
        f"{DEFAULT_TTL_SECONDS} (null too means {DEFAULT_TTL_SECONDS}): a JSON integer "
        "written without a fraction or exponent (60, not 60.0)"
    ),
]


def _key_rule(min_chars: int, forbidden: str) -> dict[str, Any]:
    """The key's schema under one of its two rules (``_KEY_RULE``)."""
    limits = {"minLength": min_chars, "maxLength": MAX_KEY_CHARS, "not": {"pattern": forbidden}}
    return {"properties": {"key": {"type": "string", **limits}}}


# if/then/else on one flat object (client generators split an anyOf into partial
# models). Characters are forbidden with ``not`` a search: ``^[...]*$`` would let a
# trailing newline through in Python's re. The entropy floor has no JSON Schema form.
_KEY_RULE: dict[str, Any] = {
    "if": {"required": ["namespace"], "properties": {"namespace": {"type": "string"}}},
    "then": {
        "description": "With a namespace: a readable key",
        **_key_rule(1, f"[{validation.CONTROL_CHARACTERS}]"),
    },
    "else": {
        "description": "Without a namespace: a random key (also: at least "
        f"{MIN_BARE_KEY_BITS:.0f} bits of entropy)",
        **_key_rule(MIN_BARE_KEY_CHARS, f"[^{validation.PRINTABLE_ASCII}]"),
    },
}

#: What each field must be, for error messages (never the value).
FIELD_RULES: dict[str, str] = {
    "namespace": f"must be {NAMESPACE_PREFIX} followed by {ENCODED_CHARS} base64url "
    "characters, as returned by POST /services/v1/lease/namespace",
    "key": "must be a string",
    "ttl_seconds": f"must be a JSON integer from 1 to {MAX_TTL_SECONDS}",
    "fingerprint": f"must be a string of 1 to {MAX_FINGERPRINT_CHARS} characters",
    "wait_seconds": f"must be a JSON integer from 0 to {MAX_WAIT_SECONDS}",
    "owner_token": f"must be {OWNER_PREFIX} followed by {ENCODED_CHARS} base64url "
    "characters, as returned by acquire",
    "result": "is required and may be any JSON value",
}


# -- the models ------------------------------------------------------------------------------


class _Body(BaseModel):
    """A request body; fields holding secrets or the caller's data have ``repr=False``."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, hide_input_in_errors=True)


class NamespaceBody(_Body):
    """Mint a namespace: an empty object."""


class _KeyBody(_Body):
    model_config = ConfigDict(json_schema_extra=_KEY_RULE)

    namespace: NamespaceStr | None = Field(
        default=None,
        repr=False,
        description=f"{NAMESPACE_PREFIX} and {ENCODED_CHARS} base64url characters, from "
        "POST /lease/namespace. A bearer secret: keep it private.",
    )
    key: _KeyStr = Field(
        repr=False,
        description=f"With a namespace: 1-{MAX_KEY_CHARS} characters, no control characters. "
        f"Without: {MIN_BARE_KEY_CHARS}-{MAX_KEY_CHARS} printable ASCII characters with at "
        f"least {MIN_BARE_KEY_BITS:.0f} bits of entropy (a uuid4).",
    )

    @model_validator(mode="after")
    def _check_key(self) -> Any:
        namespace_secret = None
        if self.namespace is not None:
            namespace_secret = secrets.parse_namespace(self.namespace)
            if namespace_secret is None:
                raise InvalidRequest(f"Invalid namespace: {FIELD_RULES['namespace']}")
            validation.check_namespaced_key(self.key)
        else:
            validation.check_bare_key(self.key)
        # Not getattr(): pydantic's __getattr__ would raise and catch an AttributeError.
        owner_token = self.__dict__.get("owner_token")
        if owner_token is not None and not secrets.valid_owner_token(owner_token):
            raise InvalidRequest(f"Invalid owner_token: {FIELD_RULES['owner_token']}")
        # Where cached_property keeps it (its first read takes a lock in Python 3.11).
        self.__dict__["_namespace_secret"] = namespace_secret
        return self

    def namespace_secret(self) -> bytes | None:
        """The namespace's secret bytes (already validated), or None without one."""
        return self._namespace_secret

    @functools.cached_property
    def _namespace_secret(self) -> bytes | None:
        # Set by the validator; computed here only for a body built without validation.
        return None if self.namespace is None else secrets.parse_namespace(self.namespace)


class AcquireBody(_KeyBody):
    """Acquire a lease on ``key``."""

    ttl_seconds: _Ttl = DEFAULT_TTL_SECONDS
    fingerprint: Annotated[str, Field(min_length=1, max_length=MAX_FINGERPRINT_CHARS)] | None = (
        Field(
            default=None,
            repr=False,
            description=f"1 to {MAX_FINGERPRINT_CHARS} characters. Binds the key to its input "
            "for the lifecycle; absent is a binding too.",
        )
    )
    wait_seconds: Annotated[int, Field(ge=0, le=MAX_WAIT_SECONDS)] | None = Field(
        default=0,
        description=f"0 to {MAX_WAIT_SECONDS}, default 0 (null too means 0), a JSON integer "
        "written without a fraction or exponent: while the key is held, wait up to this many "
        "seconds for it to be released, expire or be completed, instead of answering held at "
        "once",
    )


class _OwnerBody(_KeyBody):
    owner_token: OwnerTokenStr = Field(
        repr=False,
        description=f"{OWNER_PREFIX} and {ENCODED_CHARS} base64url characters, as returned "
        "by acquire.",
    )


class RenewBody(_OwnerBody):
    """Move the lease expiry of the live owner."""

    ttl_seconds: _Ttl = DEFAULT_TTL_SECONDS


class ReleaseBody(_OwnerBody):
    """End the live owner's lease now."""


class CompleteBody(_OwnerBody):
    """Store the result and end ownership for the lifecycle."""

    result: Any = Field(
        repr=False,
        description=f"Any JSON value, at most {validation.MAX_RESULT_BYTES:,} bytes compact; "
        "fields named like secrets are stored as [redacted].",
    )


B = TypeVar("B", bound=_Body)


def parse_body(model: type[B], data: dict[str, Any]) -> B:
    """Validate ``data`` as ``model``; every failure is ``InvalidRequest``."""
    try:
        # What model.model_validate(data) does, without its Python wrapper around the call.
        body: B = model.__pydantic_validator__.validate_python(data)
        return body
    except ValidationError as exc:
        raise InvalidRequest(_describe(exc, model)) from None


def _describe(exc: ValidationError, model: type[_Body]) -> str:
    problems: list[str] = []
    unnamed = 0  # unknown fields whose names are not repeated (``_unknown_fields``)
    for error in exc.errors(include_input=False, include_url=False):
        loc = error["loc"]
        field = str(loc[0]) if loc else "body"
        kind = error["type"]
        if kind == "extra_forbidden":
            if field in FIELD_RULES:  # the API's own name, sent where it does not belong
                problems.append(f'Unknown field "{field}" for this request')
            else:
                unnamed += 1
        elif kind == "missing":
            problems.append(f"Missing field {field}: {FIELD_RULES.get(field, 'is required')}")
        elif kind == "model_type" or kind == "model_attributes_type":
            problems.append("Body must be a JSON object")
        else:
            problems.append(f"Invalid {field}: {FIELD_RULES.get(field, 'has the wrong type')}")
    if unnamed:
        problems.append(_unknown_fields(unnamed, model))
    return "; ".join(problems) if problems else "Invalid request"


def _unknown_fields(count: int, model: type[_Body]) -> str:
    """One problem for the unknown fields whose names are not the API's own (they may
    be secrets, so they are not repeated): the fields the request takes are listed."""
    takes = ", ".join(model.model_fields) or "no fields"
    which = "Unknown field" if count == 1 else f"{count} unknown fields"
    return f"{which} (names are not repeated); this request takes {takes}"


# -- derived: flat schemas and field tables --------------------------------------------------


class _FlatSchema(GenerateJsonSchema):
    """Each field's type and bounds without ``null``, default or title (for MCP)."""

    def nullable_schema(self, schema: core_schema.NullableSchema) -> JsonSchemaValue:
        return self.generate_inner(schema["schema"])

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        return self.generate_inner(schema["schema"])

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def tool_input_schema(model: type[BaseModel], descriptions: dict[str, str]) -> dict[str, Any]:
    """The model's fields as one flat JSON Schema object described by ``descriptions``;
    no cross-field rules (several MCP clients refuse ``if``, ``not`` and ``anyOf``)."""
    schema = model.model_json_schema(schema_generator=_FlatSchema)
    return {
        "type": "object",
        "properties": {
            name: {**field, "description": descriptions[name]}
            for name, field in schema["properties"].items()
        },
        "required": schema.get("required", []),
        "additionalProperties": schema["additionalProperties"],
    }


class FieldRow(NamedTuple):
    """One row of a request's field table, for the docs."""

    field: str
    type: str  # the JSON type, or "any JSON value"
    presence: str  # "required", "optional" or "optional, default 60"
    rule: str


def field_table(model: type[BaseModel]) -> list[FieldRow]:
    """The fields of ``model`` (a request of ``LeaseService.handle``'s ``OPERATIONS``),
    in order, as the docs list them."""
    schema = model.model_json_schema(schema_generator=_FlatSchema)
    return [
        FieldRow(
            name, field.get("type", "any JSON value"), _presence(model, name), field["description"]
        )
        for name, field in schema["properties"].items()
    ]


def _presence(model: type[BaseModel], name: str) -> str:
    info = model.model_fields[name]
    if info.is_required():
        return "required"
    return "optional" if info.default is None else f"optional, default {info.default}"
