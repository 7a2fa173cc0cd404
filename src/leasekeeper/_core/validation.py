"""Input rules that need no I/O: strict JSON's limits, key rules, result size and redaction.

Every failure raises ``InvalidRequest`` (or ``PayloadTooLarge``) with a message
that names the field and the rule and never repeats the value.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from leasekeeper._core.keyguess import estimate_below
from leasekeeper._errors import InvalidRequest, PayloadTooLarge

__all__ = [
    "CONTROL_CHARACTERS",
    "DEFAULT_TTL_SECONDS",
    "MAX_DEPTH",
    "MAX_FINGERPRINT_CHARS",
    "MAX_KEY_CHARS",
    "MAX_RESULT_BYTES",
    "MAX_TTL_SECONDS",
    "MAX_WAIT_SECONDS",
    "MIN_BARE_KEY_BITS",
    "MIN_BARE_KEY_CHARS",
    "NOT_AN_OBJECT",
    "PRINTABLE_ASCII",
    "SECRET_WORDS",
    "UTF8_BOM",
    "check_bare_key",
    "check_namespaced_key",
    "check_tree",
    "encode_result",
    "json_failure",
    "redact",
]

MAX_DEPTH = 64
#: A UTF-8 byte-order mark, ignored before a body (and before an MCP stdio line).
UTF8_BOM = "\ufeff".encode()
#: What ``parse_json_object`` says of JSON that is valid but not an object.
NOT_AN_OBJECT = "Body must be a JSON object"

# The request fields' bounds, each stated once (``leasekeeper._schemas`` declares the fields).
MAX_TTL_SECONDS = 86_400  # a lease's length: at most a day,
DEFAULT_TTL_SECONDS = 60  # 60 seconds when none is asked for
MAX_KEY_CHARS = 200
MIN_BARE_KEY_CHARS = 32  # a key without a namespace: this long, printable ASCII,
MIN_BARE_KEY_BITS = 100.0  # and this random
MAX_FINGERPRINT_CHARS = 1024
MAX_RESULT_BYTES = 32_768  # a result's compact JSON encoding, as submitted
MAX_WAIT_SECONDS = 60  # how long an acquire may wait for a held key
#: Character ranges, written as both Python's re and JSON Schema read them inside ``[]``:
#: what a key may not contain, and what a bare key is made of.
CONTROL_CHARACTERS = r"\x00-\x1f\x7f-\x9f"
PRINTABLE_ASCII = "!-~"

_CONTROL = re.compile(f"[{CONTROL_CHARACTERS}]")
#: A control character or a lone surrogate (which no UTF-8 can carry).
_CONTROL_OR_SURROGATE = re.compile(rf"[{CONTROL_CHARACTERS}\ud800-\udfff]")
_BARE_KEY = re.compile(rf"[{PRINTABLE_ASCII}]{{{MIN_BARE_KEY_CHARS},{MAX_KEY_CHARS}}}\Z")
_REDACTED = "[redacted]"
#: A result's field whose name contains one of these is stored as ``[redacted]``.
SECRET_WORDS = (
    "password",
    "passwd",
    "token",
    "secret",
    "apikey",
    "privatekey",
    "authorization",
    "cookie",
)
#: Removed from a field name before the secret words are looked for: "-", "_", "." and
#: every Unicode space (``str.isspace``; none is past U+3000).
_NAME_NOISE = str.maketrans(
    "", "", "-_." + "".join(c for c in map(chr, range(0x3001)) if c.isspace())
)


def json_failure(exc: json.JSONDecodeError) -> str:
    """What the decoder found wrong and where, never the input: "Expecting value at
    position 7"."""
    return f"{exc.msg.removesuffix(' at')} at position {exc.pos}"


def check_tree(root: dict[str, Any]) -> None:
    """Reject what the strict parser refuses and the MCP SDK's lets through: nesting
    deeper than MAX_DEPTH, lone surrogates, NaN and infinite floats."""
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


def check_namespaced_key(key: str) -> None:
    """A key inside a namespace: 1 to ``MAX_KEY_CHARS`` characters, no control characters
    nor lone surrogates (a direct ``LeaseService`` caller may pass them)."""
    if not 1 <= len(key) <= MAX_KEY_CHARS:
        raise InvalidRequest(f"Invalid key: must be 1 to {MAX_KEY_CHARS} characters")
    if _CONTROL_OR_SURROGATE.search(key):
        if _CONTROL.search(key):
            raise InvalidRequest("Invalid key: must not contain control characters")
        raise InvalidRequest("Invalid key: must not contain lone surrogates")


def check_bare_key(key: str) -> None:
    """A key without a namespace must be long, printable ASCII and visibly random."""
    advice = (
        "use a random value such as str(uuid.uuid4()) or secrets.token_urlsafe(32), "
        "or mint a namespace (POST /services/v1/lease/namespace) to use readable keys"
    )
    if not _BARE_KEY.match(key):
        raise InvalidRequest(
            f"Invalid key: without a namespace a key must be {MIN_BARE_KEY_CHARS} to "
            f"{MAX_KEY_CHARS} printable ASCII characters with no whitespace; {advice}"
        )
    bits = estimate_below(key, MIN_BARE_KEY_BITS)
    if bits is not None:
        raise InvalidRequest(
            f"Invalid key: without a namespace a key must look random (at least "
            f"{MIN_BARE_KEY_BITS:.0f} bits of entropy, where words, names, dates, keyboard "
            "patterns, repeats and sequences count for little; this one is estimated at "
            f"{math.floor(bits * 10) / 10:.1f} bits); {advice}"
        )


#: What ``encode_result`` says of a value no JSON can carry.
_NOT_A_JSON_VALUE = (
    "Invalid result: must be a JSON value (objects with string field names, arrays, "
    "strings without lone surrogates, finite numbers, true, false or null)"
)


def encode_result(result: Any) -> str:
    """The result as stored: size-checked (compact UTF-8, before redaction), redacted,
    compact JSON text. A value no JSON can hold is ``InvalidRequest``; a tuple is an array.
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
        raise InvalidRequest(_NOT_A_JSON_VALUE) from None


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _secret_name(name: object) -> bool:
    if not isinstance(name, str):
        # json.dumps would write 1 as "1" (beside a "1" of the caller's, a repeated name).
        raise InvalidRequest(_NOT_A_JSON_VALUE)
    folded = name.lower().translate(_NAME_NOISE)
    return any(word in folded for word in SECRET_WORDS)


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
