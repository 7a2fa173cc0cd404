"""The middlewares' settings, checked once (``Policy.build``), and the decisions they
make from them: which requests are guarded, the key and fingerprint sent to leasekeeper,
and which statuses are stored.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import TypedDict

from leasekeeper.web._problems import Reply, key_malformed
from leasekeeper.web._request import (
    MAX_KEY_CHARS,
    Fingerprint,
    IdempotentRequest,
    KeyScope,
    default_fingerprint,
)
from leasekeeper.web._stored import DEFAULT_STORED_HEADERS, FORBIDDEN_STORED_HEADERS

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "DEFAULT_METHODS", "Policy", "PolicyOptions"]

DEFAULT_METHODS: tuple[str, ...] = ("POST", "PATCH")
#: Request bodies are read whole before the handler runs (the fingerprint covers them).
DEFAULT_MAX_REQUEST_BYTES: int = 10 * 1024 * 1024


class PolicyOptions(TypedDict, total=False):
    """The middlewares' keyword options, with their defaults in ``Policy.build``."""

    methods: Iterable[str]
    paths: Iterable[str] | Callable[[str], bool] | None
    required: bool
    ttl: int
    stored_statuses: Collection[int] | Callable[[int], bool] | None
    wait: float
    fail_open: bool
    fingerprint: Fingerprint | None
    key_scope: KeyScope | None
    stored_headers: Iterable[str]
    max_request_bytes: int
    docs_url: str | None


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
            return key_malformed(
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
