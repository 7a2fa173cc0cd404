"""The HTTP contract is the same, byte for byte, whichever store is behind it."""

from __future__ import annotations

import re
import secrets
from typing import Any

import pytest

from leasekeeper import FakeClock
from tests.conftest import STORE_KINDS, Api, ApiFactory

_OWNER_TOKEN = re.compile(rb"own_[A-Za-z0-9_-]{43}")
LIFECYCLE_SECONDS = 100

Exchange = tuple[int, str | None, bytes]


def conversation(api: Api, clock: FakeClock, namespace: str, bare_key: str) -> list[Exchange]:
    """A fixed sequence of requests; each response as (status, Retry-After, body bytes)."""
    seen: list[Exchange] = []

    def send(route: str, body: Any = None, *, content: bytes | None = None) -> Any:
        if content is not None:
            response = api.post(route, content=content)
        else:
            response = api.post(route, body)
        seen.append(
            (
                response.status_code,
                response.headers.get("retry-after"),
                _OWNER_TOKEN.sub(b"own_<token>", response.content),
            )
        )
        return response.json()

    key = {"namespace": namespace, "key": "invoice:2026-09-05"}
    first = send("/lease", {**key, "ttl_seconds": 30, "fingerprint": "charge-501"})
    send("/lease/acquire", {**key, "fingerprint": "charge-501"})
    clock.advance(10.5)
    send("/lease/renew", {**key, "owner_token": first["owner_token"], "ttl_seconds": 60})
    send("/lease/release", {**key, "owner_token": first["owner_token"]})
    second = send("/lease", {**key, "fingerprint": "charge-501"})
    clock.advance(1.25)
    result = (
        b'{"z":1,"a":"\\u0000","big":1180591620717411303424,"api-key":"x",'
        b'"nested":[{"Password":1,"keep":[1.5,-0]}],"e":"\xc3\xa9\xf0\x9f\x98\x80"}'
    )
    body = (
        b'{"namespace":"' + namespace.encode() + b'","key":"invoice:2026-09-05",'
        b'"owner_token":"' + second["owner_token"].encode() + b'","result":' + result + b"}"
    )
    send("/lease/complete", content=body)
    send("/lease", {**key, "fingerprint": "charge-501"})
    send("/lease", {**key, "fingerprint": "charge-502"})
    send("/lease/renew", {**key, "owner_token": first["owner_token"]})
    send("/lease/complete", {**key, "owner_token": second["owner_token"], "result": 1})
    bare = send("/lease", {"key": bare_key, "ttl_seconds": 5})
    clock.advance(5)
    send("/lease/renew", {"key": bare_key, "owner_token": bare["owner_token"]})
    send("/lease", {"key": bare_key})
    clock.advance(LIFECYCLE_SECONDS)
    send("/lease", {**key, "fingerprint": "charge-502"})
    ready = api.client.get("/readyz")
    seen.append((ready.status_code, None, ready.content))
    return seen


@pytest.mark.parametrize("store_kind", [k for k in STORE_KINDS if k != "memory"])
def test_every_store_gives_the_same_responses(
    make_api: ApiFactory, clock: FakeClock, store_kind: str
) -> None:
    """The same requests at the same times get byte-identical responses from memory and this."""
    reference = make_api("memory", lifecycle_seconds=LIFECYCLE_SECONDS)
    namespace = reference.namespace()
    bare_key = secrets.token_urlsafe(32)
    start = clock.now_ms()
    expected = conversation(reference, clock, namespace, bare_key)
    clock.jump_back((clock.now_ms() - start) / 1000)  # a fresh store, the same instants
    actual = conversation(
        make_api(store_kind, lifecycle_seconds=LIFECYCLE_SECONDS), clock, namespace, bare_key
    )
    assert [status for status, _, _ in expected] == [
        201, 409, 200, 200, 201, 200, 200, 409, 409, 409, 201, 409, 201, 201, 200
    ]  # fmt: skip
    assert actual == expected
    assert b"1180591620717411303424" in expected[5][2]
    assert b'"a":"\\u0000"' in expected[6][2]
