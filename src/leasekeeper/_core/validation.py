"""Input rules that need no I/O: strict JSON, key rules, result size and redaction.

Every failure raises ``InvalidRequest`` (or ``PayloadTooLarge``) with a message
that names the field and the rule and never repeats the value.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from typing import Any

import orjson

from leasekeeper._errors import InvalidRequest, PayloadTooLarge

__all__ = [
    "DEFAULT_TTL_SECONDS",
    "MAX_DEPTH",
    "MAX_RESULT_BYTES",
    "MAX_TTL_SECONDS",
    "NOT_AN_OBJECT",
    "UTF8_BOM",
    "check_bare_key",
    "check_namespaced_key",
    "check_text",
    "check_tree",
    "encode_result",
    "json_failure",
    "key_entropy_bits",
    "parse_json_object",
    "redact",
]

MAX_DEPTH = 64
#: A UTF-8 byte-order mark, ignored before a body (and before an MCP stdio line).
UTF8_BOM = "\ufeff".encode()
#: What ``parse_json_object`` says of JSON that is valid but not an object.
NOT_AN_OBJECT = "Body must be a JSON object"
MAX_RESULT_BYTES = 32_768
MIN_BARE_KEY_BITS = 100.0
#: A lease's length in seconds: at most a day, 60 when none is asked for.
MAX_TTL_SECONDS = 86_400
DEFAULT_TTL_SECONDS = 60

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: A control character or a lone surrogate (which no UTF-8 can carry).
_CONTROL_OR_SURROGATE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_BARE_KEY = re.compile(r"[\x21-\x7e]{32,200}\Z")
_REDACTED = "[redacted]"
_SECRET_WORDS = (
    "authorization",
    "password",
    "passwd",
    "secret",
    "token",
    "privatekey",
    "apikey",
    "cookie",
)
#: Removed from a field name before the secret words are looked for: the spec's "-", "_",
#: "." and spaces, every kind of space Unicode has counting as one (a tab, a no-break
#: space: ``str.isspace``; none is past U+3000).
_NAME_NOISE = str.maketrans(
    "", "", "-_." + "".join(c for c in map(chr, range(0x3001)) if c.isspace())
)


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


def json_failure(exc: json.JSONDecodeError) -> str:
    """What the decoder found wrong and where, never the input itself: "Expecting value at
    position 7" (some of its messages end in "at" already: "Invalid control character at")."""
    return f"{exc.msg.removesuffix(' at')} at position {exc.pos}"


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


def check_tree(root: dict[str, Any]) -> None:
    """Reject nesting deeper than MAX_DEPTH, strings with lone surrogates, and floats
    that are NaN or infinite: what the strict parser refuses and a JSON-RPC parser
    (the MCP SDK's) lets through (it reads ``NaN``, ``Infinity`` and ``1e999``)."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InvalidRequest(f"Body nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            for name in node:
                _check_surrogates(name)
            children = node.values()
        else:
            children = node
        for child in children:
            if isinstance(child, str):
                _check_surrogates(child)
            elif isinstance(child, dict | list):
                stack.append((child, depth + 1))
            elif isinstance(child, float) and not math.isfinite(child):
                raise InvalidRequest(_NOT_FINITE)


_NOT_FINITE = "Body is not valid JSON: a number is NaN, infinite or too large for a double"


def _check_surrogates(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(
            "Body is not valid JSON: a string contains a lone surrogate escape"
        ) from None


def check_text(field: str, value: str, *, max_chars: int) -> None:
    """A non-empty string of at most ``max_chars`` characters without control characters.

    Nor lone surrogates: the HTTP and MCP adapters refuse them before (``check_tree``),
    a program calling ``LeaseService`` itself might not, and no digest can be taken of
    text that has no UTF-8 encoding."""
    if not 1 <= len(value) <= max_chars:
        raise InvalidRequest(f"Invalid {field}: must be 1 to {max_chars} characters")
    if _CONTROL_OR_SURROGATE.search(value):
        if _CONTROL.search(value):
            raise InvalidRequest(f"Invalid {field}: must not contain control characters")
        raise InvalidRequest(f"Invalid {field}: must not contain lone surrogates")


def check_namespaced_key(key: str) -> None:
    """A key inside a namespace: 1-200 characters, no control characters."""
    check_text("key", key, max_chars=200)


def key_entropy_bits(key: str) -> float:
    """Length times the Shannon entropy per character of the key's own character frequencies."""
    n = len(key)
    if n == 0:
        return 0.0
    per_char = 0.0 - sum(c / n * math.log2(c / n) for c in Counter(key).values())
    return n * per_char


def check_bare_key(key: str) -> None:
    """A key without a namespace must be long, printable ASCII and visibly random."""
    advice = (
        "use a random value such as str(uuid.uuid4()) or secrets.token_urlsafe(32), "
        "or mint a namespace (POST /services/v1/lease/namespace) to use readable keys"
    )
    if not _BARE_KEY.match(key):
        raise InvalidRequest(
            "Invalid key: without a namespace a key must be 32 to 200 printable ASCII "
            f"characters with no whitespace; {advice}"
        )
    bits = key_entropy_bits(key)
    if bits < MIN_BARE_KEY_BITS:
        raise InvalidRequest(
            f"Invalid key: without a namespace a key must look random (at least "
            f"{MIN_BARE_KEY_BITS:.0f} bits of entropy by its own character frequencies, "
            f"this one has {math.floor(bits * 10) / 10:.1f}); {advice}"
        )


#: What ``encode_result`` says of a value no JSON can carry.
_NOT_A_JSON_VALUE = (
    "Invalid result: must be a JSON value (objects with string field names, arrays, "
    "strings without lone surrogates, finite numbers, true, false or null)"
)


def encode_result(result: Any) -> str:
    """The result as stored: size-checked, redacted, compact JSON text.

    The 32,768-byte limit applies to the compact UTF-8 encoding of the result
    as submitted, before redaction. A value that no JSON body can hold (NaN, a lone
    surrogate, a set, a non-string field name, a cycle), which only a program calling
    ``LeaseService`` directly can pass, is ``InvalidRequest``; a tuple is an array.
    """
    try:
        submitted = _compact(result).encode("utf-8")
        if len(submitted) > MAX_RESULT_BYTES:
            raise PayloadTooLarge(
                f"Result is too large: its compact JSON encoding must be at most "
                f"{MAX_RESULT_BYTES} bytes"
            )
        return _compact(redact(result))
    except (TypeError, ValueError, RecursionError):
        # json.dumps: a type JSON lacks, NaN, a cycle, an integer past Python's digit
        # limit; encode: a lone surrogate; either: nesting past the recursion limit.
        raise InvalidRequest(_NOT_A_JSON_VALUE) from None


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _secret_name(name: object) -> bool:
    if not isinstance(name, str):
        # json.dumps would write 1 as "1" (beside a "1" of the caller's, a repeated name).
        raise InvalidRequest(_NOT_A_JSON_VALUE)
    folded = name.lower().translate(_NAME_NOISE)
    return any(word in folded for word in _SECRET_WORDS)


def redact(value: Any) -> Any:
    """A copy of ``value`` where every field named like a secret, at any depth, is
    ``"[redacted]"``; everything else is unchanged."""
    if isinstance(value, dict):
        return {
            name: _REDACTED if _secret_name(name) else redact(child)
            for name, child in value.items()
        }
    if isinstance(value, list | tuple):  # json.dumps writes a tuple as an array
        return [redact(child) for child in value]
    return value
