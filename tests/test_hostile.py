"""Hostile input, case by case, beyond tests/test_http_contract.py and the fuzzer.

In process where the app decides (strict JSON, results, many keys), and through real
servers on each store for results with NUL characters. What the HTTP layer decides
(lying Content-Length, chunked bodies, malformed HTTP, slow clients) is in
tests/test_abuse.py. Every answer is a JSON object and never a 5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest

from leasekeeper import FakeClock, LeaseService, Settings
from leasekeeper.http import create_app
from leasekeeper.store import SqliteStore
from tests._server import running_server
from tests._stores import STORES, store_target
from tests.conftest import Api, ApiFactory

KEY = "k"


def invalid(response: Any) -> None:
    assert response.status_code == 400, response.text
    assert response.json()["status"] == "invalid"


def take(api: Api, ns: str, key: str = KEY, **extra: Any) -> dict[str, Any]:
    response = api.acquire(namespace=ns, key=key, **extra)
    assert response.status_code == 201, response.text
    lease: dict[str, Any] = response.json()
    return lease


# -- strict JSON -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body", [b"\x0c", b"\x0b", b"\x0c{}", b"\x1c", b"\xa0", b"\xef\xbb\xbf\xef\xbb\xbf"]
)
def test_a_mint_body_of_non_json_whitespace_is_invalid(api: Api, body: bytes) -> None:
    """Only JSON's whitespace makes an empty mint body; \\x0b, \\x0c and others are not JSON."""
    invalid(api.post("/lease/namespace", content=body))


@pytest.mark.parametrize(
    "body", [b"", b" \r\n\t", b"{}", b" {} \n", b"\xef\xbb\xbf", b"\xef\xbb\xbf \n"]
)
def test_a_mint_body_may_be_empty_or_blank(api: Api, body: bytes) -> None:
    """An empty body, JSON whitespace or {} mints (curl -X POST without -d works); a
    byte-order mark before any of them is ignored, as before any body."""
    assert api.post("/lease/namespace", content=body).status_code == 201


@pytest.mark.parametrize(
    "body",
    [
        b'{"key": ' + b'{"":' * 12_000 + b"1" + b"}" * 12_000 + b"}",
        b'{"key": "k", "result": ' + b"[" * 30_000 + b"]" * 30_000 + b"}",
        b'{"namespace": "ns_'
        + b"A" * 43
        + b'", "key": "k", "owner_token": "own_'
        + b"A" * 43
        + b'", "result": '
        + b'{"a": [' * 70
        + b"1"
        + b"]}" * 70
        + b"}",
    ],
)
def test_deep_nesting_is_invalid_at_any_depth_and_size(api: Api, body: bytes) -> None:
    """Objects or arrays nested past 64 levels (or 20,000) are 400 invalid, never a crash."""
    for route in ("/lease", "/lease/complete"):
        invalid(api.post(route, content=body))


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999"])
def test_non_finite_numbers_inside_a_result_are_invalid(api: Api, ns: str, value: bytes) -> None:
    """NaN, Infinity and numbers beyond a double are refused wherever they are."""
    lease = take(api, ns)
    head = (
        f'{{"namespace": "{ns}", "key": "{KEY}", "owner_token": "{lease["owner_token"]}", '
    ).encode()
    invalid(
        api.post("/lease/complete", content=head + b'"result": {"a": [1, {"b": ' + value + b"}]}}")
    )
    assert api.renew(namespace=ns, key=KEY, owner_token=lease["owner_token"]).status_code == 200


def test_integers_past_4300_digits_are_invalid(api: Api, ns: str) -> None:
    """Python converts no integer of more than 4,300 digits: 400 invalid, never a 500."""
    huge = b"9" * 4301
    lease = take(api, ns)
    head = f'{{"namespace": "{ns}", "key": "{KEY}", "owner_token": "{lease["owner_token"]}", '
    acquire = f'{{"namespace": "{ns}", "key": "k2", "ttl_seconds": '.encode() + huge + b"}"
    invalid(api.post("/lease", content=acquire))
    invalid(api.post("/lease/complete", content=head.encode() + b'"result": [' + huge + b"]}"))
    # 4,300 digits are a number like any other: stored and returned exactly.
    done = api.post("/lease/complete", content=head.encode() + b'"result": [' + huge[1:] + b"]}")
    assert done.status_code == 200, done.text
    assert done.json()["result"] == [int(huge[1:])]
    assert api.acquire(namespace=ns, key="k2").status_code == 201


@pytest.mark.parametrize(
    "result",
    [
        b'{"a": {"b": {"c": 1, "c": 2}}}',
        b'[{"x": 1}, {"y": 2, "y": 2}]',
        b'{"\\u0061": 1, "a": 2}',  # the same name, escaped once
    ],
)
def test_duplicate_names_anywhere_are_invalid(api: Api, ns: str, result: bytes) -> None:
    """A duplicate object key at any depth is refused (which value would be stored?)."""
    lease = take(api, ns)
    head = f'{{"namespace": "{ns}", "key": "{KEY}", "owner_token": "{lease["owner_token"]}", '
    invalid(api.post("/lease/complete", content=head.encode() + b'"result": ' + result + b"}"))


@pytest.mark.parametrize(
    "field",
    [
        b'"key": "k\\ud800"',
        b'"key": "k", "fingerprint": "\\udfff"',
        b'"key": "k", "fingerprint": "\\ud800\\u0041"',
        b'"key": "k", "unknown\\ud800": 1',
    ],
)
def test_lone_surrogates_are_invalid(api: Api, ns: str, field: bytes) -> None:
    """A lone surrogate escape in any string or name is 400 invalid, never a 500 at encoding."""
    invalid(api.post("/lease", content=f'{{"namespace": "{ns}", '.encode() + field + b"}"))


def test_lone_surrogates_inside_a_result_are_invalid(api: Api, ns: str) -> None:
    """Inside a result too, as a value or as a name, at any depth."""
    lease = take(api, ns)
    head = f'{{"namespace": "{ns}", "key": "{KEY}", "owner_token": "{lease["owner_token"]}", '
    for result in (b'["ok", {"x": "\\udc00"}]', b'{"deep": {"\\ud83d": 1}}'):
        invalid(api.post("/lease/complete", content=head.encode() + b'"result": ' + result + b"}"))


def test_surrogate_pairs_are_characters(api: Api, ns: str) -> None:
    """A correctly paired escape is one character, in keys, fingerprints and results."""
    body = (
        b'{"namespace": "'
        + ns.encode()
        + b'", "key": "\\ud83d\\ude00", "fingerprint": "\\ud83d\\ude00"}'
    )
    lease = api.post("/lease", content=body)
    assert lease.status_code == 201, lease.text
    token = lease.json()["owner_token"]
    done = api.complete(namespace=ns, key="\U0001f600", owner_token=token, result="\U0001f600")
    assert done.json()["result"] == "\U0001f600"
    replay = api.acquire(namespace=ns, key="\U0001f600", fingerprint="\U0001f600")
    assert replay.status_code == 200 and replay.json()["result"] == "\U0001f600"


NUL_RESULTS = [
    "a\u0000b",
    {"\u0000": "\u0000", "nested": ["\u0000" * 100, {"x\u0000y": None}]},
    ["\u0000"],
]


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
@pytest.mark.parametrize("result", NUL_RESULTS)
def test_nul_characters_in_results_round_trip_exactly(
    make_api: ApiFactory, store_kind: str, result: Any
) -> None:
    """\\u0000 anywhere in a result comes back the same, from complete and from every replay."""
    api = make_api(store_kind)
    ns = api.namespace()
    lease = take(api, ns, fingerprint="f\u0000p")
    done = api.complete(namespace=ns, key=KEY, owner_token=lease["owner_token"], result=result)
    assert done.status_code == 200 and done.json()["result"] == result
    replay = api.acquire(namespace=ns, key=KEY, fingerprint="f\u0000p")
    assert replay.status_code == 200 and replay.json()["result"] == result
    raw = json.dumps(result, separators=(",", ":"))
    assert raw in replay.text and raw in done.text  # byte for byte, as stored
    assert api.acquire(namespace=ns, key=KEY, fingerprint="f").json()["status"] == "conflict"
    invalid(api.acquire(namespace=ns, key="k\u0000"))  # a key refuses control characters


@pytest.mark.slow
@pytest.mark.parametrize("kind", STORES)
def test_nul_characters_round_trip_through_a_real_server(kind: str, tmp_path: Path) -> None:
    """The same through a real server on each store (PostgreSQL text refuses raw NUL bytes)."""
    with (
        store_target(kind, tmp_path) as target,
        running_server(target.url, tmp_path / "server.log") as server,
    ):
        ns = httpx.post(f"{server.api}/lease/namespace").json()["namespace"]
        for i, result in enumerate(NUL_RESULTS):
            key = f"nul-{i}"
            lease = httpx.post(f"{server.api}/lease", json={"namespace": ns, "key": key}).json()
            owner = {"namespace": ns, "key": key, "owner_token": lease["owner_token"]}
            done = httpx.post(f"{server.api}/lease/complete", json={**owner, "result": result})
            replay = httpx.post(f"{server.api}/lease", json={"namespace": ns, "key": key})
            assert done.status_code == 200 and replay.status_code == 200, replay.text
            assert done.json()["result"] == replay.json()["result"] == result


def test_ten_thousand_keys_in_one_namespace(tmp_path: Path) -> None:
    """10,000 keys in one namespace: each its own lease and fence, none stored readably.

    The grants go through ``LeaseService.handle`` (validation, digests, the store: all of
    a request but the HTTP transport, which costs 5 times as much in process); a sample
    is then read back over HTTP.
    """
    db = tmp_path / "many.db"
    count = 10_000

    def body(ns: str, i: int) -> dict[str, Any]:
        return {"namespace": ns, "key": f"invoice:{i:05d}", "ttl_seconds": 600}

    async def main() -> tuple[list[int], list[httpx.Response]]:
        service = LeaseService(SqliteStore(db, FakeClock()))
        app = create_app(service, Settings(), run_cleanup=False)
        await service.start()
        try:
            ns = (await service.create_namespace()).body["namespace"]
            granted: list[int] = []
            for start in range(0, count, 1000):
                batch = await asyncio.gather(
                    *(service.handle("acquire", body(ns, i)) for i in range(start, start + 1000))
                )
                assert all(reply.created for reply in batch)
                granted += [reply.body["fencing_token"] for reply in batch]
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                held = await asyncio.gather(
                    *(
                        client.post("/services/v1/lease", json=body(ns, i))
                        for i in range(0, count, 97)
                    )
                )
            return granted, held
        finally:
            await service.stop()

    granted, held = asyncio.run(main())
    assert len(set(granted)) == count
    assert {r.status_code for r in held} == {409}
    assert [r.json()["fencing_token"] for r in held] == [granted[i] for i in range(0, count, 97)]
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT count(*) FROM leases").fetchone() == (count,)
    blobs = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("many.db"))
    assert b"invoice:" not in blobs
