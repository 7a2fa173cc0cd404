"""A guarded request as the middlewares read it: its ``Idempotency-Key`` header, the
request as ``fingerprint`` and ``key_scope`` functions see it, the default fingerprint,
and the lease its handler runs under.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from leasekeeper.web._problems import Reply, key_malformed, key_missing

if TYPE_CHECKING:
    from leasekeeper.web._policy import Policy

__all__ = [
    "HEADER",
    "MAX_KEY_CHARS",
    "Fingerprint",
    "IdempotentRequest",
    "KeyScope",
    "RequestLease",
    "default_fingerprint",
    "read_key",
]

#: The request header, lower-case as ASGI gives it.
HEADER = "idempotency-key"
#: The longest key the service takes with a namespace.
MAX_KEY_CHARS = 200


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
        return key_missing(policy)
    try:
        if len(values) > 1:
            raise ValueError(_TWICE)
        text = values[0].strip(" \t")
        return _sf_string(text) if text.startswith('"') else _bare(text)
    except ValueError as why:
        return key_malformed(policy, str(why))


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
