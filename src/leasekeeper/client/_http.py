"""What the sync and async clients share of HTTP: URLs, request bodies, reading an answer.

Every response goes through ``read_response``: a 2xx JSON object with ``ok`` is
returned, anything else becomes an exception of the one tree through
``leasekeeper._errors.error_from_body``, and a transport failure becomes
``ServiceUnreachable`` (``unreachable``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from leasekeeper._core.validation import check_tree, json_failure
from leasekeeper._errors import (
    MAX_RETRY_AFTER,
    InternalError,
    InvalidRequest,
    LeaseError,
    ServiceUnreachable,
    error_from_body,
)

__all__ = [
    "BASE_PATH",
    "DEFAULT_TIMEOUT",
    "DEFAULT_URL",
    "HEADERS",
    "MAX_RESPONSE_BYTES",
    "AsyncBodyReader",
    "BodyReader",
    "Direct",
    "api_root",
    "async_own_transport",
    "async_within",
    "decode",
    "encode",
    "http_root",
    "lease_body",
    "own_transport",
    "read_response",
    "renewal_timeout",
    "route_prefix",
    "unreachable",
    "within",
]

BASE_PATH = "/services/v1"
DEFAULT_URL = "http://127.0.0.1:8787"
#: Seconds for one request; a renewal uses less when the lease expires sooner.
DEFAULT_TIMEOUT = 10.0
#: ``identity``: the service never compresses, and a compressed answer (a proxy's) could
#: inflate past ``MAX_RESPONSE_BYTES`` many times over within one read.
HEADERS = {
    "content-type": "application/json",
    "accept": "application/json",
    "accept-encoding": "identity",
}

#: The largest response body read: the service's largest answer is a 32 KiB result (up to
#: six times that escaped); a larger one (a wrong URL serving a download) is not its.
MAX_RESPONSE_BYTES = 1 << 20

#: Absent a value, these fields are left out of the body (the service's defaults apply).
_OPTIONAL = ("namespace", "ttl_seconds", "fingerprint")


def renewal_timeout(timeout: object) -> float:
    """Seconds a renewal may take at most (also never longer than the lease): the client's
    ``timeout`` (an ``httpx.Timeout``'s read timeout), else ``DEFAULT_TIMEOUT``."""
    if isinstance(timeout, httpx.Timeout) and timeout.read is not None:
        return timeout.read
    return float(timeout) if isinstance(timeout, int | float) else DEFAULT_TIMEOUT


def api_root(base_url: str) -> str:
    """The API root for a server URL given with or without ``/services/v1``."""
    url = base_url.rstrip("/")
    return url if url.endswith(BASE_PATH) else url + BASE_PATH


def http_root(base_url: str | None) -> str:
    """The API root of ``base_url`` (by default ``DEFAULT_URL``) for a client of our own.

    ``ValueError`` (not repeating the URL, which may hold credentials) unless it is
    ``http://`` or ``https://`` with a host, a port in range, no query or fragment: one
    without its scheme would fail every request as unreachable, for ever under ``once``.
    """
    root = api_root(base_url or DEFAULT_URL)
    try:
        url = httpx.URL(root)
    except httpx.InvalidURL:
        url = None
    if (
        url is None
        or url.scheme not in ("http", "https")
        or not url.host
        or not (url.port is None or 1 <= url.port <= 65_535)  # httpx lets 99999 and -1 by
        or url.query  # the API path would land after it: every request a 404
        or url.fragment
    ):
        raise ValueError(
            "the service URL must be http:// or https:// with a host, a port from 1 to 65535 "
            f"if any, and no query or fragment, as {DEFAULT_URL}"
        )
    return root


def route_prefix(base_url: str | None, client: Any) -> str:
    """What goes before a route on an injected ``client``: ``base_url``'s API root when
    given, else nothing when the client's own base URL ends at the API root already,
    else ``/services/v1``. ``ValueError`` as from ``http_root`` for the URL used."""
    if base_url:
        return http_root(base_url)
    own = str(getattr(client, "base_url", "")).rstrip("/")
    http_root(own or "-")  # "-": no URL is no http:// one either
    return "" if own.endswith(BASE_PATH) else BASE_PATH


class Direct:
    """Our own httpx client's requests, built here for the transport that client would
    send them through (``transport``: the default, an injected one, or a proxy's mount
    from the environment), to be handed to it directly: past the client's redirects,
    cookies, auth, event hooks and URL merging, which the lease client never needs and
    which cost a third of its CPU per request (docs/performance.md, "Speed tricks").
    A URL with credentials goes through the client, which turns them into basic auth.
    The headers are the client's with ``HEADERS``; the timeout, the client's or the
    request's own. Where the client would use its default transport, ``own()`` (when
    given) is used instead, and kept as ``own`` for the caller to close."""

    def __init__(
        self,
        client: httpx.Client | httpx.AsyncClient,
        timeout: float,
        own: Callable[[], Any] | None = None,
    ) -> None:
        # (httpx's own lookup, private; without it, requests go through the client)
        # A URL with a user name or password: httpx's client sends it as basic auth.
        find = getattr(client, "_transport_for_url", None)
        self.own: Any = None
        if find is None or client.base_url.userinfo:
            self.transport: Any = None
        else:
            self.transport = find(client.base_url)
            if own is not None and self.transport is getattr(client, "_transport", None):
                self.transport = self.own = own()
        headers = httpx.Headers(client.headers)
        headers.update(HEADERS)
        self._headers = headers.raw
        self._base = str(client.base_url).rstrip("/")
        self._urls: dict[str, httpx.URL] = {}
        self._timeout = httpx.Timeout(timeout).as_dict()

    def request(self, route: str, content: bytes, seconds: float | None) -> httpx.Request:
        """A POST of ``content`` to ``route``, within ``seconds`` (None: the client's)."""
        url = self._urls.get(route)
        if url is None:
            url = self._urls[route] = httpx.URL(self._base + route)
        timeout = self._timeout if seconds is None else httpx.Timeout(seconds).as_dict()
        return httpx.Request(
            "POST", url, content=content, headers=self._headers, extensions={"timeout": timeout}
        )


def lease_body(**fields: Any) -> dict[str, Any]:
    """A request body; ``namespace``, ``ttl_seconds`` and ``fingerprint`` left out when None."""
    return {k: v for k, v in fields.items() if not (k in _OPTIONAL and v is None)}


def encode(body: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON; ``TypeError`` for NaN, the infinities, a lone surrogate or any
    value that is not a JSON type, before anything is sent.

    Python's ``json``, not orjson: orjson writes NaN as ``null`` and dates or UUIDs as
    strings (a result would be stored other than given), and refuses integers past 64
    bits, which the service takes.
    """
    try:
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return text.encode("utf-8")
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
        raise TypeError(f"The request body is not JSON-serializable: {_why(exc)}") from None
    except RecursionError:  # the service takes 64 levels; this is thousands
        raise TypeError("The request body is not JSON-serializable: nested too deeply") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("an object repeats a name")
    return obj


_decoder = json.JSONDecoder(parse_constant=_no_constant, object_pairs_hook=_unique_names)


def decode(text: bytes | str) -> Any:
    """Strict JSON, as the service reads it (no NaN, no ``1e400``, no repeated names, no
    lone surrogate, at most 64 levels); ``ValueError`` says what is wrong without
    repeating the text, which may hold secrets. Python's ``json``, not orjson, which
    reads an integer past 64 bits (``10**30 + 1``, stored exactly) as a float."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("it is not UTF-8") from None
    try:
        value = _decoder.decode(text)
        # The service's own rules for what parsing lets by (a response is an object,
        # checked as it is: its result nests one level below the top, as in the request).
        check_tree(value if isinstance(value, dict) else {"value": value})
    except json.JSONDecodeError as exc:  # its own text quotes where, not what
        raise ValueError(json_failure(exc)) from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except InvalidRequest as error:
        raise ValueError(error.error.removeprefix("Body is not valid JSON: ")) from None
    return value


def _why(exc: Exception) -> str:
    """What is wrong, without the value itself (which may be a secret)."""
    if isinstance(exc, UnicodeEncodeError):
        return "a string contains a lone surrogate"
    message = str(exc)
    if message.startswith("Object of type "):  # "Object of type X is not JSON serializable"
        return f"a value of type {message.split()[3]}"
    if isinstance(exc, TypeError):  # "keys must be str, int, float, bool or None, not X"
        return "an object key that is not a string"
    if message.startswith("Circular reference"):
        return "a value that contains itself"
    return "NaN and infinite numbers are not JSON"


def _retry_after(response: httpx.Response) -> int | None:
    value = response.headers.get("retry-after", "").strip()
    # Only delta-seconds; the service never sends an HTTP date. ASCII digits only
    # (str.isdigit() also takes "²", which int() refuses), and at most 9 of them past
    # any leading zeros (int() refuses more than 4,300; 9 digits are 31 years).
    if not (value.isascii() and value.isdigit()):
        return None
    significant = value.lstrip("0") or "0"
    return int(significant) if len(significant) <= len(str(MAX_RETRY_AFTER)) else None


class BodyReader:
    """Gathers a response body chunk by chunk: ``InternalError`` for a compressed one or
    past ``MAX_RESPONSE_BYTES``, ``ServiceUnreachable`` for a chunk arriving more than
    ``limit`` seconds from now (None: no limit; httpx's timeout bounds each read only)."""

    def __init__(self, limit: float | None, monotonic: Callable[[], float]) -> None:
        self._deadline = None if limit is None else monotonic() + limit
        self._monotonic = monotonic
        self._parts: list[bytes] = []
        self._size = 0

    def start(self, response: httpx.Response) -> bool:
        """Before the body: whether to read it. An encoded one is not inflated: a success is
        then refused, a refusal (a proxy's compressed 503) classified by status and headers."""
        encoding = response.headers.get("content-encoding", "").strip().lower()
        if encoding in ("", "identity"):
            return True
        if response.is_success:
            raise InternalError("The response is compressed; the lease service never compresses")
        return False

    def add(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size > MAX_RESPONSE_BYTES:
            raise InternalError("The response is larger than any the lease service sends")
        if self._deadline is not None and self._monotonic() > self._deadline:
            raise ServiceUnreachable("The lease service's answer did not arrive in time")
        self._parts.append(chunk)

    def content(self) -> bytes:
        return b"".join(self._parts)


class AsyncBodyReader(BodyReader):
    """``BodyReader`` for the async client, whose ``async_within`` bounds the whole
    exchange: no limit of its own."""

    def __init__(self, limit: float | None, monotonic: Callable[[], float]) -> None:
        super().__init__(None, monotonic)


def own_transport(context: ssl.SSLContext) -> Callable[[], None] | None:
    """The sync twin of ``async_own_transport``: none, httpx's default transport serves."""
    return None


def async_own_transport(context: ssl.SSLContext) -> Callable[[], httpx.AsyncBaseTransport]:
    """What makes the async client's own transport (``Direct``'s ``own``): httpx's, on
    asyncio's sockets rather than anyio's (``_asyncio_backend``), with TLS by ``context``.
    (Imported here: httpcore, which httpx loads only when a client makes its transport,
    and anyio with it would add 12 ms to every ``import leasekeeper``, the CLI's start and
    an app importing the middleware included.)"""
    from leasekeeper.client._asyncio_backend import asyncio_transport

    return functools.partial(asyncio_transport, context)


def within(limit: float | None) -> contextlib.nullcontext[None]:
    """The sync twin of ``async_within``: nothing (``BodyReader`` keeps the limit)."""
    return contextlib.nullcontext()


@contextlib.asynccontextmanager
async def async_within(limit: float | None) -> AsyncIterator[None]:
    """Bound a whole exchange, the response's head included, to ``limit`` seconds (None:
    no bound): ``ServiceUnreachable`` when it is not over by then."""
    try:
        async with asyncio.timeout(limit):
            yield
    except TimeoutError:
        raise ServiceUnreachable("The lease service's answer did not arrive in time") from None


def read_response(response: httpx.Response, content: bytes) -> dict[str, Any]:
    """The body of a successful response (its ``content`` read by a ``BodyReader``), or
    raise the error the response describes."""
    try:
        parsed = decode(content)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        parsed = None
    body: dict[str, Any] | None = parsed if isinstance(parsed, dict) else None
    if response.is_success:
        if body is not None and body.get("ok") is True:
            return body
        # The service answers every refusal with a 4xx or 5xx: a success that is not
        # ok (a proxy's page, a body in its words but not its shape) was not meant.
        raise InternalError("The service's response to this request is not one it sends")
    raise error_from_body(
        body, http_status=response.status_code, retry_after=_retry_after(response)
    )


def unreachable(exc: httpx.RequestError) -> LeaseError:
    """The error for a request that got no answer, or none that could be read (a body
    that does not decode, endless redirects): its message names the URL tried, without
    the user name, password, query or fragment it may have held."""
    try:
        tried = exc.request.url.copy_with(userinfo=b"", query=None, fragment=None)
    except RuntimeError:  # an error raised without its request: no URL to name
        return ServiceUnreachable(f"Could not reach the lease service ({type(exc).__name__})")
    return ServiceUnreachable(
        f"Could not reach the lease service at {tried} ({type(exc).__name__})"
    )
