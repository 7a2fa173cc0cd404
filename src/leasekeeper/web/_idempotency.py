"""Every decision the ASGI and WSGI middlewares share, with no I/O: which requests are
guarded, reading the ``Idempotency-Key`` header, the key and fingerprint sent to
leasekeeper, a response encoded for storage and decoded for a replay, and the
``application/problem+json`` answers (RFC 9457).

A stored response is one JSON object whose field names are all this module's own, so
the service's redaction (any field named like ``token`` or ``cookie``) never touches
it; headers go in a list of ``[name, value]`` pairs, which it does not rewrite::

    {"http_response": 1, "status": 201,
     "headers": [["content-type", "application/json"], ["location", "/orders/7"]],
     "body": "{\\"id\\": 7}", "body_encoding": "text"}

``body_encoding`` is ``text`` (the body was UTF-8), ``base64``, or ``omitted``: the
body was too large to store, and a replay says so in a problem body.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol

# leasekeeper's __init__ binds its errors before it imports this package.
from leasekeeper import (
    FingerprintConflict,
    InvalidRequest,
    LeaseError,
    LeaseHeld,
    RateLimited,
    RequestTimeout,
    ServerError,
)

__all__ = [
    "COMPLETE_RETRY_DELAYS",
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_METHODS",
    "DEFAULT_STORED_HEADERS",
    "HEADER",
    "LOST_BEFORE_STORED",
    "MAX_RESULT_BYTES",
    "NOT_STORED",
    "UNSURE_COMPLETE",
    "Fingerprint",
    "IdempotentRequest",
    "KeyScope",
    "Policy",
    "Reply",
    "RequestLease",
    "ResponseRecorder",
    "UnreadableResult",
    "body_too_large",
    "default_fingerprint",
    "in_flight",
    "read_key",
    "refusal",
    "replay",
    "result_size",
    "results_to_store",
    "status_line",
    "stored_result",
    "unreadable",
]

#: The request header, lower-case as ASGI gives it.
HEADER = "idempotency-key"
#: The header every replayed response carries (Stripe's name for it).
REPLAYED = ("idempotent-replayed", "true")
DEFAULT_METHODS: tuple[str, ...] = ("POST", "PATCH")
#: The service's limit on a stored result: its compact UTF-8 JSON, in bytes.
MAX_RESULT_BYTES = 32_768
#: The longest key the service takes with a namespace.
MAX_KEY_CHARS = 200
#: Request bodies are read whole before the handler runs (the fingerprint covers them).
DEFAULT_MAX_REQUEST_BYTES: int = 10 * 1024 * 1024
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


@dataclass(frozen=True, slots=True)
class IdempotentRequest:
    """A guarded request as ``fingerprint`` and ``key_scope`` functions see it.

    ``path`` is decoded (``/caf%C3%A9`` is ``/café``), ``query`` is the raw query
    string, ``headers`` are ``(lower-case name, value)`` pairs, ``body`` the whole
    body, and ``raw`` the ASGI scope or WSGI environ (``raw["user"]`` after
    Starlette's ``AuthenticationMiddleware``, say).
    """

    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (any case), or None."""
        wanted = name.lower()
        return next((value for key, value in self.headers if key == wanted), None)


def default_fingerprint(request: IdempotentRequest) -> str:
    """SHA-256 over the method, the path, the query and the body, as hex."""
    digest = hashlib.sha256()
    for part in (
        request.method.encode("ascii", "replace"),
        request.path.encode("utf-8", "surrogatepass"),
        request.query.encode("latin-1", "replace"),
        request.body,
    ):
        digest.update(len(part).to_bytes(8, "big"))  # each part's length: no two requests
        digest.update(part)  # give the same stream of bytes
    return digest.hexdigest()


class Fingerprint(Protocol):
    def __call__(self, request: IdempotentRequest, /) -> str | bytes: ...


class KeyScope(Protocol):
    def __call__(self, request: IdempotentRequest, /) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Reply:
    """A response the middleware writes itself."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def framed_headers(self) -> list[tuple[str, str]]:
        """``headers`` and the body's ``content-length``, which a 204 or 304 must not
        have (RFC 9110 8.6)."""
        if self.status in (204, 304):
            return self.headers
        return [*self.headers, ("content-length", str(len(self.body)))]


class UnreadableResult(ValueError):
    """The stored result is not a response this middleware stored."""


@dataclass(frozen=True, slots=True)
class Policy:
    """The middleware's settings, as ``Policy.build`` checked them."""

    namespace: str | None
    methods: frozenset[str]
    path_rule: Callable[[str], bool] | None
    required: bool
    ttl: int
    stores_status: Callable[[int], bool]
    wait: float
    fail_open: bool
    fingerprint: Fingerprint | None
    key_scope: KeyScope | None
    stored_headers: frozenset[str]
    max_request_bytes: int
    docs_url: str | None

    @classmethod
    def build(
        cls,
        *,
        namespace: str | None,
        methods: Iterable[str] = DEFAULT_METHODS,
        paths: Iterable[str] | Callable[[str], bool] | None = None,
        required: bool = False,
        ttl: int = 30,
        stored_statuses: Collection[int] | Callable[[int], bool] | None = None,
        wait: float = 0.0,
        fail_open: bool = False,
        fingerprint: Fingerprint | None = None,
        key_scope: KeyScope | None = None,
        stored_headers: Iterable[str] = DEFAULT_STORED_HEADERS,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        docs_url: str | None = None,
    ) -> Policy:
        """Check every setting; ``ValueError`` or ``TypeError`` naming the one at fault."""
        if namespace is not None and not isinstance(namespace, str):
            raise TypeError("namespace must be a string (a minted ns_... value) or None")
        method_set = frozenset(
            m.upper() for m in ([methods] if isinstance(methods, str) else methods)
        )
        if not method_set:
            raise ValueError("methods must name at least one HTTP method")
        if type(ttl) is not int or not 1 <= ttl <= 86_400:
            raise ValueError("ttl must be a whole number of seconds from 1 to 86400")
        if isinstance(wait, bool) or not isinstance(wait, int | float):
            raise TypeError("wait must be a number of seconds")
        if not (0 <= wait < math.inf):
            raise ValueError("wait must be a finite number of seconds, 0 or more")
        headers = frozenset(name.lower() for name in stored_headers)
        if headers & FORBIDDEN_STORED_HEADERS:
            raise ValueError(
                "stored_headers cannot hold "
                + ", ".join(sorted(headers & FORBIDDEN_STORED_HEADERS))
            )
        if type(max_request_bytes) is not int or max_request_bytes < 0:
            raise ValueError("max_request_bytes must be a whole number of bytes, 0 or more")
        if docs_url is not None and not (docs_url.isascii() and docs_url.isprintable()):
            raise ValueError("docs_url must be a URL in printable ASCII")
        return cls(
            namespace=namespace,
            methods=method_set,
            path_rule=_path_rule(paths),
            required=bool(required),
            ttl=ttl,
            stores_status=_status_rule(stored_statuses),
            wait=float(wait),
            fail_open=bool(fail_open),
            fingerprint=fingerprint,
            key_scope=key_scope,
            stored_headers=headers,
            max_request_bytes=max_request_bytes,
            docs_url=docs_url,
        )

    def guards_path(self, path: str) -> bool:
        """Whether a request to ``path`` (of a guarded method) is guarded."""
        return self.path_rule is None or self.path_rule(path)

    def lease_key(self, key: str, request: IdempotentRequest) -> str | Reply:
        """The key sent to leasekeeper: the request's key, after the ``key_scope`` when
        there is one, as ``<length of scope>:<scope>:<key>`` so that no two scopes and
        keys give the same string; or the 400 for one too long."""
        if self.key_scope is not None:
            scope = self.key_scope(request) or ""
            if not isinstance(scope, str) or not scope.isprintable():
                raise TypeError("key_scope must return a string of printable characters or None")
            key = f"{len(scope)}:{scope}:{key}"
        if len(key) > MAX_KEY_CHARS:
            return _malformed(
                self,
                f"It must be at most {MAX_KEY_CHARS} characters"
                + (", a little less with this API's scoping." if self.key_scope else "."),
            )
        return key

    def fingerprint_of(self, request: IdempotentRequest) -> str:
        """The fingerprint sent to leasekeeper: the default, or a SHA-256 of the
        function's value (so that any value of any length will do)."""
        if self.fingerprint is None:
            return default_fingerprint(request)
        value = self.fingerprint(request)
        raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)
        return hashlib.sha256(raw).hexdigest()


def _path_rule(paths: Iterable[str] | Callable[[str], bool] | None) -> Callable[[str], bool] | None:
    """``paths`` as one test: exact paths, and prefixes written with a final ``*``."""
    if paths is None or callable(paths):
        return paths
    paths = [paths] if isinstance(paths, str) else list(paths)
    exact = frozenset(p for p in paths if not p.endswith("*"))
    prefixes = tuple(p[:-1] for p in paths if p.endswith("*"))
    return lambda path: path in exact or path.startswith(prefixes)


def _status_rule(statuses: Collection[int] | Callable[[int], bool] | None) -> Callable[[int], bool]:
    if statuses is None:
        return lambda status: status < 500
    if callable(statuses):
        return statuses
    chosen = frozenset(statuses)
    return chosen.__contains__


# -- the header ------------------------------------------------------------------------------


def read_key(values: Sequence[str], policy: Policy) -> str | Reply:
    """The key in the request's ``Idempotency-Key`` header values, or the 400 to answer.

    The draft makes it a structured-field string (``"8e03..."``, RFC 8941 3.3.3); a
    bare token (``8e03...``) is taken too, as most clients send it. Refused: none at
    all, a malformed one, and more than one (the draft forbids it): several fields, or
    one holding a list (WSGI servers join repeated fields with commas). The value is
    never repeated in the problem: it is a secret.
    """
    if not values:
        return _problem(
            policy,
            400,
            "key-missing",
            "Idempotency-Key is missing",
            "This request needs an Idempotency-Key header: a unique value (a UUID, say), "
            "sent again unchanged when the request is retried.",
        )
    try:
        if len(values) > 1:
            raise ValueError(_TWICE)
        text = values[0].strip(" \t")
        return _sf_string(text) if text.startswith('"') else _bare(text)
    except ValueError as why:
        return _malformed(policy, str(why))


_TWICE = "It was sent more than once."
_SHAPE = (
    'It must be one string in double quotes ("...") or one token, of 1 to '
    f"{MAX_KEY_CHARS} visible ASCII characters, sent once."
)


def _sf_string(text: str) -> str:
    """An RFC 8941 sf-string's value (``text`` starts with its quote); ``ValueError``
    saying why it is not one."""
    chars: list[str] = []
    escaped = False
    for index in range(1, len(text)):
        char = text[index]
        if escaped:
            if char not in '"\\':
                break
            chars.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            rest = text[index + 1 :].lstrip(" \t")
            if rest.startswith(","):
                raise ValueError(_TWICE)
            if rest or not chars:
                break
            return "".join(chars)
        elif " " <= char <= "~":
            chars.append(char)
        else:
            break
    raise ValueError(_SHAPE)


def _bare(text: str) -> str:
    """A bare key: visible ASCII without quotes; a comma means several fields were joined."""
    if "," in text:
        raise ValueError(_TWICE)
    if not text or not all("!" <= c <= "~" and c != '"' for c in text):
        raise ValueError(_SHAPE)
    return text


def _malformed(policy: Policy, why: str) -> Reply:
    return _problem(
        policy,
        400,
        "key-malformed",
        "Idempotency-Key is malformed",
        f"The header is malformed. {why}",
    )


# -- responses for storage and replay -----------------------------------------------------------


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
    """What to ``complete`` with, in order, while the service refuses each as too large
    (its limit may be set below ours): the response, then its status and headers with
    the body omitted, then its status alone."""
    yield stored_result(policy, status, headers, body)
    if body is not None:
        yield stored_result(policy, status, headers, None)
    yield stored_result(policy, status, (), None)


#: A ``complete`` refused with one of these may have stored the result or not: it is tried
#: again after each of ``COMPLETE_RETRY_DELAYS`` (the client then asks the service whether
#: its earlier attempt stored it).
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
    """The stored response as sent again, with ``Idempotent-Replayed: true``; a body that
    was not kept becomes a problem body saying so. ``UnreadableResult`` if ``result``
    is not one ``stored_result`` made."""
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
        not_kept = _problem(
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


# -- problems (RFC 9457) ---------------------------------------------------------------------


def _problem(
    policy: Policy,
    status: int,
    slug: str,
    title: str,
    detail: str,
    extra: Sequence[tuple[str, str]] = (),
) -> Reply:
    """An ``application/problem+json`` reply. With ``docs_url`` its ``type`` is that page
    (``#slug``) and a ``Link`` header points there, as the draft suggests; without, the
    type is ``about:blank``, whose title RFC 9457 says is the status's own phrase."""
    problem: dict[str, Any] = {}
    headers = [("content-type", "application/problem+json"), ("content-language", "en")]
    if policy.docs_url:
        problem["type"] = f"{policy.docs_url}#{slug}"
        problem["title"] = title
        headers.append(("link", f'<{policy.docs_url}>; rel="describedby"; type="text/html"'))
    else:
        problem["title"] = _phrase(status)
    problem["status"] = status
    problem["detail"] = detail
    headers.append(("cache-control", "no-store"))
    headers.extend(extra)
    return Reply(status, headers, json.dumps(problem).encode("utf-8"))


def status_line(status: int) -> str:
    """``201 Created``: a WSGI status line."""
    return f"{status} {_phrase(status)}"


#: RFC 9110's names, which Python's ``HTTPStatus`` has only from 3.13.
_PHRASES = {413: "Content Too Large", 422: "Unprocessable Content"}


def _phrase(status: int) -> str:
    if status in _PHRASES:
        return _PHRASES[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown Status"


def in_flight(policy: Policy) -> Reply:
    """409: the first request with this key is still being processed."""
    return _problem(
        policy,
        409,
        "in-flight",
        "A request with this Idempotency-Key is still being processed",
        "A request with this Idempotency-Key is still being processed; retry after the "
        "Retry-After delay to get its response.",
        # One second, not the lease's remaining time: that is renewed for as long as the
        # handler runs, and says nothing of when it ends.
        [("retry-after", "1")],
    )


def body_too_large(policy: Policy) -> Reply:
    """413: the request body is over ``max_request_bytes``."""
    return _problem(
        policy,
        413,
        "body-too-large",
        "The request body is too large",
        f"A request with an Idempotency-Key may have a body of at most "
        f"{policy.max_request_bytes} bytes.",
    )


def unreadable(policy: Policy) -> Reply:
    """500: the key's stored result is not a response (another use of the same key)."""
    return _problem(
        policy,
        500,
        "unreadable",
        "The stored response cannot be replayed",
        "A result is stored for this Idempotency-Key, but it is not a response.",
    )


def refusal(policy: Policy, error: LeaseError) -> Reply | None:
    """The answer to a request whose lease could not be taken, because of ``error``;
    None when the request should go through unguarded (``fail_open``, and leasekeeper
    unavailable or answering as it never should)."""
    if isinstance(error, LeaseHeld):
        return in_flight(policy)
    if isinstance(error, FingerprintConflict):
        return _problem(
            policy,
            422,
            "key-reused",
            "Idempotency-Key is already used",
            "This Idempotency-Key was used for a request with another method, path or "
            "body; a key must not be reused for a different request.",
        )
    if isinstance(error, InvalidRequest):  # its message names the rule, never the value
        return _problem(
            policy,
            400,
            "key-refused",
            "Idempotency-Key is not accepted",
            f"The idempotency store refused the key: {error.error}",
        )
    if policy.fail_open:
        return None
    retry_after = max(1, min(error.retry_after or 1, 60))
    return _problem(
        policy,
        503,
        "unavailable",
        "Idempotency cannot be checked now",
        "The idempotency store could not be reached, so the request was not processed. "
        "Retry after the Retry-After delay.",
        [("retry-after", str(retry_after))],
    )


# -- what a guarded handler sees -----------------------------------------------------------------


class _Lease(Protocol):
    @property
    def fencing_token(self) -> int: ...
    def check(self) -> None: ...
    @property
    def lost(self) -> _Flag: ...


class _Flag(Protocol):
    def is_set(self) -> bool: ...


class RequestLease:
    """The lease a guarded request's handler runs under: ASGI ``scope["state"]["leasekeeper"]``
    (Starlette's ``request.state.leasekeeper``), WSGI ``environ["leasekeeper.lease"]``.

    Send ``fencing_token`` with writes to the protected system (``FenceGuard``), and call
    ``check()`` before a side effect: it raises ``LeaseLost`` once the lease is lost
    (renewals failed past its expiry), when another request may be running the same work.
    """

    __slots__ = ("_lease",)

    def __init__(self, lease: _Lease) -> None:
        self._lease = lease

    def __repr__(self) -> str:
        return f"<RequestLease fencing_token={self.fencing_token} lost={self.lost}>"

    @property
    def fencing_token(self) -> int:
        return self._lease.fencing_token

    @property
    def lost(self) -> bool:
        return self._lease.lost.is_set()

    def check(self) -> None:
        """Raise ``LeaseLost`` unless the lease is still held."""
        self._lease.check()
