"""Reading a request body: one strict JSON object, or ``InvalidRequest`` saying why not.

The server's (the HTTP and MCP adapters'); the client imports ``validation`` alone, so
orjson, used here for the usual flat body, is a dependency of the server only.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import orjson

from leasekeeper._core.validation import MAX_DEPTH, NOT_AN_OBJECT, check_tree, json_failure
from leasekeeper._errors import InvalidRequest

__all__ = ["parse_json_object"]


def _reject_constant(name: str) -> Any:
    raise InvalidRequest(f"Body is not valid JSON: {name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise InvalidRequest("Body is not valid JSON: a number is too large for a double")
    return value


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise InvalidRequest("Body is not valid JSON: an object has a duplicate field name")
    return obj


_decoder = json.JSONDecoder(
    object_pairs_hook=_unique_object,
    parse_constant=_reject_constant,
    parse_float=_finite_float,
)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Parse a request body strictly: one JSON object, UTF-8, no NaN, no duplicate keys,
    no lone surrogates, no integer of more than 4,300 digits, nesting at most 64 levels."""
    flat = _flat_object(body)
    if flat is not None:
        return flat
    return _parse_strict(body)


def _flat_object(body: bytes) -> dict[str, Any] | None:
    """``body`` parsed by orjson when that is provably what ``_parse_strict`` returns
    too, else None (and ``_parse_strict`` decides): for one object whose values are
    all strings, integers, booleans or null, with no backslash anywhere, as the usual
    lease request is. A speed trick: docs/performance.md says what it buys.

    Why it is the same: with no backslash there is no escape, so no surrogate, and
    every quote is the first or last character of a string, so the quotes count the
    document's strings; a repeated member adds strings that the parsed object lacks.
    orjson refuses invalid UTF-8 (surrogates included) and what else RFC 8259 does,
    as the strict parser does; it reads an integer past 64 bits as a float, and no
    float is taken here. A flat object nests one level deep.
    """
    if b"\\" in body:
        return None
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if type(value) is not dict:
        return None
    strings = len(value)
    for member in value.values():
        kind = type(member)
        if kind is str:
            strings += 1
        elif not (kind is int or kind is bool or member is None):
            return None
    return value if body.count(b'"') == 2 * strings else None


def _parse_strict(body: bytes) -> dict[str, Any]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("Body is not valid UTF-8") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        value = _decoder.decode(text)
    except RecursionError:
        raise InvalidRequest(f"Body nests deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"Body is not valid JSON: {json_failure(exc)}") from None
    except ValueError:
        # Python refuses to convert an integer of more than sys.get_int_max_str_digits()
        # (4,300) digits, and nothing could store or return one (the MCP SDK's parser
        # refuses the same numbers).
        raise InvalidRequest(
            f"Body is not valid JSON: a number has more than {sys.get_int_max_str_digits()} digits"
        ) from None
    if not isinstance(value, dict):
        raise InvalidRequest(NOT_AN_OBJECT)
    check_tree(value)
    return value
