"""The answers the middlewares write themselves: an ``application/problem+json`` body
(RFC 9457) for every refusal, and the status line a WSGI server needs. A problem never
repeats the key: it is a secret.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from leasekeeper import FingerprintConflict, InvalidRequest, LeaseError, LeaseHeld

if TYPE_CHECKING:
    from leasekeeper.web._policy import Policy

log = logging.getLogger("leasekeeper.web")

__all__ = [
    "Reply",
    "body_too_large",
    "in_flight",
    "key_malformed",
    "key_missing",
    "lease_refused",
    "problem",
    "refusal",
    "status_line",
    "unreadable",
]


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


def problem(
    policy: Policy,
    status: int,
    slug: str,
    title: str,
    detail: str,
    extra: Sequence[tuple[str, str]] = (),
) -> Reply:
    """An ``application/problem+json`` reply: with ``docs_url``, typed ``docs_url#slug``
    with a ``Link`` header; without, ``about:blank`` titled by the status phrase."""
    body: dict[str, Any] = {}
    headers = [("content-type", "application/problem+json"), ("content-language", "en")]
    if policy.docs_url:
        body["type"] = f"{policy.docs_url}#{slug}"
        body["title"] = title
        headers.append(("link", f'<{policy.docs_url}>; rel="describedby"; type="text/html"'))
    else:
        body["title"] = _phrase(status)
    body["status"] = status
    body["detail"] = detail
    headers.append(("cache-control", "no-store"))
    headers.extend(extra)
    return Reply(status, headers, json.dumps(body).encode("utf-8"))


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


def key_missing(policy: Policy) -> Reply:
    """400: a guarded request without the key, where ``required`` asks for one."""
    return problem(
        policy,
        400,
        "key-missing",
        "Idempotency-Key is missing",
        "This request needs an Idempotency-Key header: a unique value (a UUID, say), "
        "sent again unchanged when the request is retried.",
    )


def key_malformed(policy: Policy, why: str) -> Reply:
    """400: the key is not one the middleware takes; ``why`` says what it must be."""
    return problem(
        policy,
        400,
        "key-malformed",
        "Idempotency-Key is malformed",
        f"The header is malformed. {why}",
    )


def in_flight(policy: Policy) -> Reply:
    """409: the first request with this key is still being processed."""
    return problem(
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
    return problem(
        policy,
        413,
        "body-too-large",
        "The request body is too large",
        f"A request with an Idempotency-Key may have a body of at most "
        f"{policy.max_request_bytes} bytes.",
    )


def unreadable(policy: Policy) -> Reply:
    """500: the key's stored result is not a response (another use of the same key)."""
    return problem(
        policy,
        500,
        "unreadable",
        "The stored response cannot be replayed",
        "A result is stored for this Idempotency-Key, but it is not a response.",
    )


def refusal(policy: Policy, error: LeaseError) -> Reply | None:
    """The answer to a request whose lease ``error`` refused; None when it should run
    unguarded (``fail_open`` and leasekeeper unavailable or misbehaving)."""
    if isinstance(error, LeaseHeld):
        return in_flight(policy)
    if isinstance(error, FingerprintConflict):
        return problem(
            policy,
            422,
            "key-reused",
            "Idempotency-Key is already used",
            "This Idempotency-Key was used for a request with another method, path or "
            "body; a key must not be reused for a different request.",
        )
    if isinstance(error, InvalidRequest):  # its message names the rule, never the value
        return problem(
            policy,
            400,
            "key-refused",
            "Idempotency-Key is not accepted",
            f"The idempotency store refused the key: {error.error}",
        )
    if policy.fail_open:
        return None
    retry_after = max(1, min(error.retry_after or 1, 60))
    return problem(
        policy,
        503,
        "unavailable",
        "Idempotency cannot be checked now",
        "The idempotency store could not be reached, so the request was not processed. "
        "Retry after the Retry-After delay.",
        [("retry-after", str(retry_after))],
    )


def lease_refused(policy: Policy, error: LeaseError) -> Reply | None:
    """``refusal``, with a WARNING when the request goes through unguarded or the
    service refused the key."""
    reply = refusal(policy, error)
    if reply is None:
        log.warning("leasekeeper is unavailable (%s): the request runs unguarded", error.error)
    elif reply.status == 400:
        log.warning("leasekeeper refused an Idempotency-Key: %s", error.error)
    return reply
