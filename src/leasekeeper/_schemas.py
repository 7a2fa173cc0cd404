"""Request bodies, validated strictly; shared by the HTTP and MCP adapters.

Pydantic runs in strict mode (``true`` is not an integer, ``"60"`` is not an
integer, ``1.5`` is not an integer) and unknown fields are refused, so a typo such
as ``"fingerprnt"`` cannot silently drop the idempotency binding. JSON ``null``
for an optional field means the same as leaving it out.

Every failure becomes ``InvalidRequest`` with a message naming the field and its
rule; the value itself is never repeated.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from leasekeeper._core import secrets, validation
from leasekeeper._core.validation import DEFAULT_TTL_SECONDS, MAX_TTL_SECONDS
from leasekeeper._errors import InvalidRequest

__all__ = [
    "DEFAULT_TTL_SECONDS",
    "MAX_TTL_SECONDS",
    "AcquireBody",
    "CompleteBody",
    "NamespaceBody",
    "ReleaseBody",
    "RenewBody",
    "parse_body",
]


# What each field must be, for error messages (never the value).
FIELD_RULES: dict[str, str] = {
    "namespace": "must be ns_ followed by 43 base64url characters, as returned by "
    "POST /services/v1/lease/namespace",
    "key": "must be a string",
    "ttl_seconds": f"must be a JSON integer from 1 to {MAX_TTL_SECONDS}",
    "fingerprint": "must be a string of 1 to 1024 characters",
    "owner_token": "must be own_ followed by 43 base64url characters, as returned by acquire",
    "result": "is required and may be any JSON value",
}

TTL = Annotated[int, Field(ge=1, le=MAX_TTL_SECONDS, description="Lease length in seconds")]


class _Body(BaseModel):
    """A request body. Every field that carries a secret (namespace, owner token) or the
    caller's data (key, fingerprint, result) has ``repr=False``: a body's repr, in a
    log line or a traceback, shows none of them."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, hide_input_in_errors=True)


class NamespaceBody(_Body):
    """Mint a namespace: an empty object."""


class _KeyBody(_Body):
    namespace: str | None = Field(
        default=None,
        repr=False,
        description="A namespace from POST /lease/namespace. A bearer secret: keep it private.",
    )
    key: str = Field(
        repr=False,
        description="With a namespace: 1-200 characters, no control characters. Without: "
        "32-200 printable ASCII characters with at least 100 bits of entropy (a uuid4).",
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
        # Read from the instance's fields: getattr() on a body without the field would
        # go through pydantic's __getattr__ and raise and catch an AttributeError.
        owner_token = self.__dict__.get("owner_token")
        if owner_token is not None and not secrets.valid_owner_token(owner_token):
            raise InvalidRequest(f"Invalid owner_token: {FIELD_RULES['owner_token']}")
        # Kept where cached_property keeps its value, without its first read, which
        # takes a lock in Python 3.11.
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

    ttl_seconds: TTL | None = Field(default=None, description="Default 60.")
    fingerprint: Annotated[str, Field(min_length=1, max_length=1024)] | None = Field(
        default=None,
        repr=False,
        description="Binds the key to its input for the lifecycle; absent is a binding too.",
    )


class RenewBody(_KeyBody):
    """Move the lease expiry of the live owner."""

    owner_token: str = Field(repr=False, description="The owner token returned by acquire.")
    ttl_seconds: TTL | None = Field(default=None, description="Default 60.")


class ReleaseBody(_KeyBody):
    """End the live owner's lease now."""

    owner_token: str = Field(repr=False, description="The owner token returned by acquire.")


class CompleteBody(_KeyBody):
    """Store the result and end ownership for the lifecycle."""

    owner_token: str = Field(repr=False, description="The owner token returned by acquire.")
    result: Any = Field(
        repr=False,
        description="Any JSON value, at most 32,768 bytes compact; fields named like "
        "secrets are stored as [redacted].",
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
    """One problem for all the unknown fields whose names are not the API's own: their
    names are the caller's input and may be secrets (a key or a token sent as a field
    name), so they are not repeated; the fields the request takes are listed instead."""
    takes = ", ".join(model.model_fields) or "no fields"
    which = "Unknown field" if count == 1 else f"{count} unknown fields"
    return f"{which} (names are not repeated); this request takes {takes}"
