"""Secret formats and the digests that are stored instead of them.

Nothing raw is stored. A namespaced key's id is an HMAC under a key derived from the
namespace secret (not reversible; unrelated across namespaces); a bare key (random by
rule) is SHA-256 under its own tag. Fingerprint digests are keyed by the namespace
secret (or the bare key) and bound to the key id; owner tokens are SHA-256, compared in
constant time. Random bytes come from the caller.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import re

__all__ = [
    "ENCODED_CHARS",
    "NAMESPACE_LENGTH",
    "NAMESPACE_PATTERN",
    "NAMESPACE_PREFIX",
    "OWNER_PREFIX",
    "OWNER_TOKEN_LENGTH",
    "OWNER_TOKEN_PATTERN",
    "digests_equal",
    "fingerprint_digest",
    "format_namespace",
    "format_owner_token",
    "key_id",
    "owner_digest",
    "parse_namespace",
    "valid_owner_token",
]

NAMESPACE_PREFIX = "ns_"
OWNER_PREFIX = "own_"
SECRET_BYTES = 32
#: The unpadded base64url characters of a secret's 32 bytes.
ENCODED_CHARS = 43
NAMESPACE_LENGTH = len(NAMESPACE_PREFIX) + ENCODED_CHARS
OWNER_TOKEN_LENGTH = len(OWNER_PREFIX) + ENCODED_CHARS

# 43 characters of unpadded base64url carry 258 bits; the last character may only
# use the top 4 of its 6 bits, so a canonical encoding of 32 bytes ends in one of these.
_B64_43 = rf"[A-Za-z0-9_-]{{{ENCODED_CHARS - 1}}}[AEIMQUYcgkosw048]"
_NAMESPACE_RE = re.compile(rf"{NAMESPACE_PREFIX}{_B64_43}\Z")
_OWNER_RE = re.compile(rf"{OWNER_PREFIX}{_B64_43}\Z")
#: The same shapes as JSON Schema patterns (for the OpenAPI document and the MCP tools).
NAMESPACE_PATTERN = rf"^{NAMESPACE_PREFIX}{_B64_43}$"
OWNER_TOKEN_PATTERN = rf"^{OWNER_PREFIX}{_B64_43}$"

_TAG = b"leasekeeper/v1/"
_NS_KEY_LABEL = _TAG + b"namespace-key-id"
_NS_FP_LABEL = _TAG + b"namespace-fingerprint"
_KEY_TAG = _TAG + b"key\x00"
_BARE_KEY_TAG = _TAG + b"bare-key\x00"
_FP_TAG = _TAG + b"fingerprint\x00"
_OWNER_TAG = _TAG + b"owner\x00"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def format_namespace(random32: bytes) -> str:
    """A namespace string for 32 random bytes: ``ns_`` + 43 base64url characters."""
    if len(random32) != SECRET_BYTES:
        raise ValueError("a namespace needs exactly 32 random bytes")
    return NAMESPACE_PREFIX + _b64(random32)


def format_owner_token(random32: bytes) -> str:
    """An owner token for 32 random bytes: ``own_`` + 43 base64url characters."""
    if len(random32) != SECRET_BYTES:
        raise ValueError("an owner token needs exactly 32 random bytes")
    return OWNER_PREFIX + _b64(random32)


def parse_namespace(namespace: str) -> bytes | None:
    """The namespace's 32 secret bytes, or None when it is not a well-formed namespace.
    Answers for the 1,024 most recent are kept (a speed trick: docs/performance.md),
    only for text of a namespace's length."""
    if len(namespace) != NAMESPACE_LENGTH:
        return None
    return _parse_namespace(namespace)


@functools.lru_cache(maxsize=1024)
def _parse_namespace(namespace: str) -> bytes | None:
    if not _NAMESPACE_RE.match(namespace):
        return None
    try:
        return base64.urlsafe_b64decode(namespace[3:] + "=")
    except (binascii.Error, ValueError):  # pragma: no cover - the pattern admits only valid text
        return None


def valid_owner_token(token: str) -> bool:
    """True when ``token`` has the shape of an owner token (not whether it owns anything)."""
    return _OWNER_RE.match(token) is not None


def _hmac(key: bytes, message: bytes) -> bytes:
    return hmac.digest(key, message, "sha256")


@functools.lru_cache(maxsize=1024)
def _namespace_macs(namespace_secret: bytes) -> tuple[hmac.HMAC, hmac.HMAC]:
    """HMAC states keyed by the namespace's two derived keys (key ids, fingerprints),
    kept for the 1,024 most recent namespaces and copied per use (a speed trick:
    docs/performance.md)."""
    key_mac = hmac.new(_hmac(namespace_secret, _NS_KEY_LABEL), digestmod="sha256")
    fingerprint_mac = hmac.new(_hmac(namespace_secret, _NS_FP_LABEL), digestmod="sha256")
    return key_mac, fingerprint_mac


def _keyed(mac: hmac.HMAC, message: bytes) -> bytes:
    mac = mac.copy()
    mac.update(message)
    return mac.digest()


def key_id(namespace_secret: bytes | None, key: str) -> bytes:
    """The stored id of ``key`` in the namespace (or of a bare key when None)."""
    raw = key.encode("utf-8")
    if namespace_secret is None:
        return hashlib.sha256(_BARE_KEY_TAG + raw).digest()
    return _keyed(_namespace_macs(namespace_secret)[0], _KEY_TAG + raw)


def fingerprint_digest(
    namespace_secret: bytes | None, key: str, key_digest: bytes, fingerprint: str
) -> bytes:
    """The stored digest of ``fingerprint``, keyed by a secret and bound to the key id."""
    message = _FP_TAG + key_digest + fingerprint.encode("utf-8")
    if namespace_secret is None:
        return _hmac(key.encode("utf-8"), message)
    return _keyed(_namespace_macs(namespace_secret)[1], message)


def owner_digest(token: str) -> bytes:
    """The stored digest of an owner token."""
    return hashlib.sha256(_OWNER_TAG + token.encode("ascii")).digest()


def digests_equal(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two digests."""
    return hmac.compare_digest(a, b)
