"""Hostile input, case by case, beyond tests/test_http_contract.py and the fuzzer.

In process where the app decides (strict JSON, results, many keys); over raw sockets
against a real server where the HTTP layer decides (lying Content-Length, chunked
bodies, malformed HTTP). Every answer is a JSON object and never a 5xx.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Api

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


@pytest.mark.parametrize("body", [b"\x0c", b"\x0b", b"\x0c{}", b"\x1c", b"\xa0"])
def test_a_mint_body_of_non_json_whitespace_is_invalid(api: Api, body: bytes) -> None:
    """Only JSON's whitespace makes an empty mint body; \\x0b, \\x0c and others are not JSON."""
    invalid(api.post("/lease/namespace", content=body))


@pytest.mark.parametrize("body", [b"", b" \r\n\t", b"{}", b" {} \n"])
def test_a_mint_body_may_be_empty_or_blank(api: Api, body: bytes) -> None:
    """An empty body, JSON whitespace or {} mints (curl -X POST without -d works)."""
    assert api.post("/lease/namespace", content=body).status_code == 201
