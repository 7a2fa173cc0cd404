"""A response encoded for storage with leasekeeper's ``complete``, and decoded for a replay.

Field names are this module's own, so the service's redaction never touches them;
headers are ``[name, value]`` pairs, which it does not rewrite::

    {"http_response": 1, "status": 201,
     "headers": [["content-type", "application/json"], ["location", "/orders/7"]],
     "body": "{\\"id\\": 7}", "body_encoding": "text"}

``body_encoding`` is ``text`` (the body was UTF-8), ``base64``, or ``omitted``: the
body was too large to store, and a replay says so in a problem body.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from leasekeeper import RateLimited, RequestTimeout, ServerError
from leasekeeper.web._problems import Reply, problem, unreadable

if TYPE_CHECKING:
    from leasekeeper.web._policy import Policy

__all__ = [
    "COMPLETE_RETRY_DELAYS",
    "DEFAULT_STORED_HEADERS",
    "FORBIDDEN_STORED_HEADERS",
    "LOST_BEFORE_STORED",
    "MAX_RESULT_BYTES",
    "NOT_STORED",
    "UNSURE_COMPLETE",
    "ResponseRecorder",
    "UnreadableResult",
    "replay",
    "replay_or_unreadable",
    "result_size",
    "results_to_store",
    "stored_result",
]

log = logging.getLogger("leasekeeper.web")

#: The header every replayed response carries (Stripe's name for it).
REPLAYED = ("idempotent-replayed", "true")
#: The service's limit on a stored result: its compact UTF-8 JSON, in bytes.
MAX_RESULT_BYTES = 32_768
#: The headers that describe a response's body, stored with it and replayed.
DEFAULT_STORED_HEADERS: frozenset[str] = frozenset(
    {
        "cache-control",
        "content-disposition",
        "content-encoding",
        "content-language",
        "content-location",
        "content-type",
        "etag",
        "expires",
        "last-modified",
        "link",
        "location",
        "vary",
    }
)
#: Never stored: a session given to the first caller must not be handed to every
#: retry, and framing headers are the server's to write for the replayed body.
FORBIDDEN_STORED_HEADERS = frozenset(
    {
        "connection",
        "content-length",
        "idempotent-replayed",
        "keep-alive",
        "set-cookie",
        "set-cookie2",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
#: Headers about a body that a "body not kept" replay does not have.
_ABOUT_THE_BODY = frozenset({"digest", "etag", "last-modified", "repr-digest"})
_RESULT_TAG = "http_response"
_ENCODINGS = ("text", "base64", "omitted")


class UnreadableResult(ValueError):
    """The stored result is not a response this middleware stored."""


class ResponseRecorder:
    """A response's status, headers and body as the handler produces it, the body kept
    up to ``limit`` bytes: past that it cannot be stored, whatever its encoding."""

    def __init__(self, limit: int = MAX_RESULT_BYTES) -> None:
        self.limit = limit
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.overflowed = False

    def start(self, status: int, headers: Iterable[tuple[str, str]]) -> None:
        self.status = status
        self.headers = list(headers)

    def add(self, chunk: bytes) -> bool:
        """Keep ``chunk``; False once the body is over the limit (the chunk is kept)."""
        if chunk:
            self.chunks.append(chunk)
            self.size += len(chunk)
        if self.size > self.limit:
            self.overflowed = True
        return not self.overflowed

    def body(self) -> bytes:
        return b"".join(self.chunks)


def stored_result(
    policy: Policy, status: int, headers: Iterable[tuple[str, str]], body: bytes | None
) -> dict[str, Any]:
    """The result to ``complete`` with: the response, or (``body`` None, or too large
    once encoded) its status and headers with the body marked ``omitted``."""
    kept = [
        [name.lower(), value] for name, value in headers if name.lower() in policy.stored_headers
    ]
    result: dict[str, Any] = {
        _RESULT_TAG: 1,
        "status": status,
        "headers": kept,
        "body": None,
        "body_encoding": "omitted",
    }
    if body is None:
        return result
    try:
        result["body"], result["body_encoding"] = body.decode("utf-8"), "text"
    except UnicodeDecodeError:
        result["body"], result["body_encoding"] = base64.b64encode(body).decode("ascii"), "base64"
    if result_size(result) > MAX_RESULT_BYTES:
        result["body"], result["body_encoding"] = None, "omitted"
    return result


def results_to_store(
    policy: Policy, status: int, headers: list[tuple[str, str]], body: bytes | None
) -> Iterator[dict[str, Any]]:
    """What to ``complete`` with, each tried while the previous is refused as too large:
    the response, then without its body, then its status alone."""
    yield stored_result(policy, status, headers, body)
    if body is not None:
        yield stored_result(policy, status, headers, None)
    yield stored_result(policy, status, (), None)


#: A ``complete`` refused with one of these may have stored the result or not: it is tried
#: again after each of ``COMPLETE_RETRY_DELAYS``.
UNSURE_COMPLETE = (ServerError, RateLimited, RequestTimeout)
COMPLETE_RETRY_DELAYS = (0.25, 1.0)
#: WARNINGs of a response sent but not stored, with the lease's fencing token (not the key).
LOST_BEFORE_STORED = (
    "the lease (fencing token %d) was lost before its response was stored: the response "
    "is sent but not stored, and a retry runs the request again"
)
NOT_STORED = (
    "the response (fencing token %d) could not be stored (%s): it is sent, and a retry "
    "after the lease expires runs the request again"
)


def result_size(result: Any) -> int:
    """Bytes of ``result`` as the service counts them: compact UTF-8 JSON."""
    text = json.dumps(result, ensure_ascii=False, separators=(",", ":"))
    return len(text.encode("utf-8", "surrogatepass"))


def replay(policy: Policy, result: Any) -> Reply:
    """The stored response with ``Idempotent-Replayed: true`` (a body not kept: a problem
    body saying so); ``UnreadableResult`` if ``result`` is not one ``stored_result`` made."""
    if not (
        isinstance(result, dict)
        and result.get(_RESULT_TAG) == 1
        and type(result.get("status")) is int
        and 100 <= result["status"] <= 599
        and isinstance(result.get("headers"), list)
        and all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)
            for pair in result["headers"]
        )
        and result.get("body_encoding") in _ENCODINGS
        and isinstance(result.get("body"), str) is (result["body_encoding"] != "omitted")
    ):
        raise UnreadableResult("the stored result is not a stored response")
    status: int = result["status"]
    headers = [(name, value) for name, value in result["headers"]]
    encoding = result["body_encoding"]
    if encoding == "omitted":
        kept = [
            (n, v) for n, v in headers if not n.startswith("content-") and n not in _ABOUT_THE_BODY
        ]
        not_kept = problem(
            policy,
            status,
            "body-not-kept",
            "The original response body was not kept",
            "This request was processed before; its response body was too large to store, "
            "so only its status and headers are repeated.",
        )
        return Reply(status, kept + not_kept.headers + [REPLAYED], not_kept.body)
    if encoding == "text":
        body = result["body"].encode("utf-8")
    else:
        try:
            body = base64.b64decode(result["body"], validate=True)
        except binascii.Error:
            raise UnreadableResult("the stored body is not base64") from None
    return Reply(status, [*headers, REPLAYED], body)


def replay_or_unreadable(policy: Policy, result: Any) -> Reply:
    """``replay``, or the 500 (logged as an ERROR) for a result it cannot read."""
    try:
        return replay(policy, result)
    except UnreadableResult:
        log.error("the result stored for an Idempotency-Key is not a stored response")
        return unreadable(policy)
