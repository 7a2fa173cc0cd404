"""MCP: the five lease tools, driven by the SDK's own client in memory, over
streamable HTTP against ``leasekeeper serve`` and over stdio against ``leasekeeper mcp``."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.shared.exceptions import MCPError
from mcp.types import INVALID_PARAMS, CallToolResult
from starlette.testclient import TestClient

import leasekeeper.mcp
from leasekeeper import FakeClock, LeaseService, Settings
from leasekeeper._core.validation import UTF8_BOM
from leasekeeper._limits import Limits
from leasekeeper._server_cli import serve_app
from leasekeeper._service import clean_up_every
from leasekeeper.http import create_app
from leasekeeper.mcp import TOOL_OPERATIONS, call_lease_tool, create_mcp_server
from leasekeeper.store import MemoryStore
from tests.conftest import FakeMonotonic, ManualSleep

TOOL_NAMES = {
    "create_lease_namespace",
    "acquire_lease",
    "renew_lease",
    "release_lease",
    "complete_lease",
}
FLOW_TIMEOUT = 30
LEASEKEEPER = Path(sys.executable).with_name("leasekeeper")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- helpers ---------------------------------------------------------------------------------


def body(result: CallToolResult) -> dict[str, Any]:
    """The tool's JSON body; the text content must say the same as the structured one."""
    assert isinstance(result.structured_content, dict)
    assert len(result.content) == 1
    text = result.content[0]
    assert text.type == "text"
    assert json.loads(text.text) == result.structured_content
    return result.structured_content


def ok(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.structured_content
    reply = body(result)
    assert reply["ok"] is True
    return reply


def refused(result: CallToolResult, status: str) -> dict[str, Any]:
    assert result.is_error, result.structured_content
    reply = body(result)
    assert reply["ok"] is False
    assert reply["status"] == status, reply
    assert isinstance(reply["error"], str)
    return reply


@dataclass
class Secrets:
    """Every secret a flow used; none may appear in a server log."""

    values: list[str] = field(default_factory=list)

    def add(self, *values: str) -> None:
        self.values.extend(values)


async def check_tool_list(client: Client) -> None:
    tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(tools) == TOOL_NAMES
    required = {name: set(tool.input_schema.get("required", [])) for name, tool in tools.items()}
    assert required == {
        "create_lease_namespace": set(),
        "acquire_lease": {"key"},
        "renew_lease": {"key", "owner_token"},
        "release_lease": {"key", "owner_token"},
        "complete_lease": {"key", "owner_token", "result"},
    }
    hints = {
        name: (
            tool.annotations.read_only_hint,
            tool.annotations.destructive_hint,
            tool.annotations.idempotent_hint,
            tool.annotations.open_world_hint,
        )
        for name, tool in tools.items()
        if tool.annotations is not None
    }
    assert hints == {
        "create_lease_namespace": (True, False, False, False),
        "acquire_lease": (False, False, False, False),
        "renew_lease": (False, False, True, False),
        "release_lease": (False, True, True, False),
        "complete_lease": (False, True, True, False),
    }


async def full_flow(client: Client, secrets: Secrets) -> None:
    """namespace, acquire, held by a second agent, renew, complete, reuse, conflict, lost,
    and invalid input: the outcomes of the HTTP contract."""
    with anyio.fail_after(FLOW_TIMEOUT):
        await check_tool_list(client)
        namespace = ok(await client.call_tool("create_lease_namespace", {}))["namespace"]
        assert namespace.startswith("ns_")
        assert len(namespace) == 46
        key = f"invoice:{namespace[-8:]}"
        fingerprint = f"charge-order-{namespace[-6:]}"
        lease = {"namespace": namespace, "key": key}

        granted = ok(
            await client.call_tool(
                "acquire_lease", {**lease, "ttl_seconds": 60, "fingerprint": fingerprint}
            )
        )
        assert granted["status"] == "held"
        assert granted["ttl_seconds"] == 60
        token = granted["owner_token"]
        assert token.startswith("own_")
        fence = granted["fencing_token"]
        secrets.add(namespace, key, fingerprint, token)

        held = refused(
            await client.call_tool("acquire_lease", {**lease, "fingerprint": fingerprint}),
            "held",
        )
        assert 1 <= held["retry_after_seconds"] <= 60
        assert held["fencing_token"] == fence
        assert held["lease_expires_at"] == granted["lease_expires_at"]
        assert "owner_token" not in held
        waited = refused(  # wait_seconds passes through: the service waited, then held
            await client.call_tool(
                "acquire_lease", {**lease, "fingerprint": fingerprint, "wait_seconds": 1}
            ),
            "held",
        )
        assert waited["fencing_token"] == fence and "owner_token" not in waited

        renewed = ok(
            await client.call_tool(
                "renew_lease", {**lease, "owner_token": token, "ttl_seconds": 120}
            )
        )
        assert renewed["status"] == "held"
        assert renewed["fencing_token"] == fence
        assert "owner_token" not in renewed

        result = {"receipt_id": 4817, "api_key": "sk-live-abc", "lines": [{"Pass-Word": "x"}]}
        stored = {
            "receipt_id": 4817,
            "api_key": "[redacted]",
            "lines": [{"Pass-Word": "[redacted]"}],
        }
        completed = ok(
            await client.call_tool(
                "complete_lease", {**lease, "owner_token": token, "result": result}
            )
        )
        assert completed["status"] == "completed"
        assert completed["result"] == stored
        assert completed["fencing_token"] == fence

        reused = ok(await client.call_tool("acquire_lease", {**lease, "fingerprint": fingerprint}))
        assert reused["status"] == "completed"
        assert reused["result"] == stored
        assert reused["fencing_token"] == fence
        assert "owner_token" not in reused

        other = f"{fingerprint}-other"
        secrets.add(other)
        conflict = refused(
            await client.call_tool("acquire_lease", {**lease, "fingerprint": other}), "conflict"
        )
        assert "result" not in conflict

        refused(await client.call_tool("renew_lease", {**lease, "owner_token": token}), "lost")

        invalid = refused(
            await client.call_tool("acquire_lease", {**lease, "ttl_seconds": True}), "invalid"
        )
        assert "ttl_seconds" in invalid["error"]


def assert_no_secrets(log: str, secrets: Secrets) -> None:
    assert secrets.values
    for secret in secrets.values:
        assert secret not in log


@contextlib.asynccontextmanager
async def running(service: LeaseService) -> AsyncIterator[LeaseService]:
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


@pytest.fixture
def service(clock: FakeClock) -> LeaseService:
    return LeaseService(MemoryStore(clock))


# -- in memory -------------------------------------------------------------------------------


def test_public_api_is_curated() -> None:
    """leasekeeper.mcp exports exactly what __all__ lists."""
    public = {name for name in dir(leasekeeper.mcp) if not name.startswith("_")}
    assert set(leasekeeper.mcp.__all__) == public - {"annotations"}
    assert set(TOOL_OPERATIONS) == TOOL_NAMES


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_full_flow_in_memory(service: LeaseService, mode: str) -> None:
    """Over the SDK's in-process transports (2026 direct dispatch, and the legacy
    JSON-RPC handshake) the tools give the HTTP contract's outcomes."""
    async with running(service), Client(create_mcp_server(service), mode=mode) as client:
        await full_flow(client, Secrets())


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("seconds", "noun", "adjective"),
    [
        (86_400, "24 hours", "24-hour"),
        (8, "8 seconds", "8-second"),
        (3_600, "1 hour", "1-hour"),
        (604_800, "7 days", "7-day"),
        (90, "90 seconds", "90-second"),
    ],
)
async def test_the_texts_quote_the_configured_lifecycle(
    clock: FakeClock, seconds: int, noun: str, adjective: str
) -> None:
    """What the instructions and tool texts tell an agent about how long a result is
    kept follows LEASEKEEPER_LIFECYCLE_SECONDS, not the default's 24 hours."""
    service = LeaseService(MemoryStore(clock), lifecycle_seconds=seconds)
    async with Client(create_mcp_server(service)) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        instructions = client.instructions
    assert instructions is not None and f"kept until {noun} after" in instructions
    # Held as a result (the lease is yours) and held as a tool error (it is not) differ.
    assert "owner_token, the lease is yours" in instructions
    assert "status held means another worker owns the lease, so do not do the work" in (
        instructions
    )
    complete = tools["complete_lease"].description
    assert complete is not None and f"({noun} after its first acquire)" in complete
    fingerprint = tools["acquire_lease"].input_schema["properties"]["fingerprint"]
    assert f"for the key's {adjective} lifecycle" in fingerprint["description"]
    texts = instructions + "".join(tool.model_dump_json() for tool in tools.values())
    assert seconds == 86_400 or ("24 hours" not in texts and "24-hour" not in texts)


@pytest.mark.anyio
async def test_input_schemas_carry_the_spec_bounds(service: LeaseService) -> None:
    """Every input schema is closed and states the spec's bounds and patterns."""
    async with Client(create_mcp_server(service)) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    for tool in tools.values():
        assert tool.input_schema["type"] == "object"
        assert tool.input_schema["additionalProperties"] is False
        assert tool.description is not None
        assert len(tool.description) > 200
    acquire = tools["acquire_lease"].input_schema["properties"]
    assert acquire["ttl_seconds"] | {"description": ""} == {
        "type": "integer",
        "minimum": 1,
        "maximum": 86400,
        "description": "",
    }
    assert (acquire["fingerprint"]["minLength"], acquire["fingerprint"]["maxLength"]) == (1, 1024)
    assert (acquire["key"]["minLength"], acquire["key"]["maxLength"]) == (1, 200)
    # The service's own patterns, as in the OpenAPI document: what the service takes.
    owner_token = tools["renew_lease"].input_schema["properties"]["owner_token"]
    for pattern, prefix in (
        (acquire["namespace"]["pattern"], "ns_"),
        (owner_token["pattern"], "own_"),
    ):
        canonical = prefix + base64.urlsafe_b64encode(bytes(31) + b"\x01").decode().rstrip("=")
        assert re.fullmatch(pattern.strip("^$"), canonical)
        assert not re.fullmatch(pattern.strip("^$"), canonical[:-1] + "B")  # not canonical
        assert not re.fullmatch(pattern.strip("^$"), canonical[:-1])
    assert "result" in tools["complete_lease"].input_schema["properties"]
    # What a model must know: the secrets, and what each refusal means.
    assert "secret" in tools["create_lease_namespace"].description
    for word in ("held", "completed", "conflict", "retry_after_seconds"):
        assert word in tools["acquire_lease"].description
    assert "lost" in tools["renew_lease"].description


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("arguments", "field_name"),
    [
        ({"ttl_seconds": True}, "ttl_seconds"),
        ({"ttl_seconds": "60"}, "ttl_seconds"),
        ({"ttl_seconds": 1.5}, "ttl_seconds"),
        ({"ttl_seconds": 0}, "ttl_seconds"),
        ({"ttl_seconds": 86401}, "ttl_seconds"),
        ({"fingerprint": ""}, "fingerprint"),
        ({"fingerprint": "x" * 1025}, "fingerprint"),
        ({"fingerprnt": "typo"}, "Unknown field (names are not repeated)"),
        ({"namespace": "ns_short"}, "namespace"),
        ({"key": 5}, "key"),
        ({"key": "k" * 201}, "key"),
    ],
)
async def test_strict_arguments_are_refused_as_invalid(
    service: LeaseService, arguments: dict[str, Any], field_name: str
) -> None:
    """Wrong types and broken bounds are tool errors with status invalid, as over HTTP."""
    async with running(service), Client(create_mcp_server(service)) as client:
        namespace = ok(await client.call_tool("create_lease_namespace", {}))["namespace"]
        reply = refused(
            await client.call_tool(
                "acquire_lease", {"namespace": namespace, "key": "job", **arguments}
            ),
            "invalid",
        )
    assert field_name in reply["error"]


@pytest.mark.anyio
async def test_tree_checks_apply_to_arguments(service: LeaseService) -> None:
    """Nesting deeper than 64 levels and lone surrogates are invalid, as in an HTTP body."""
    deep: Any = 0
    for _ in range(64):
        deep = [deep]
    async with running(service), Client(create_mcp_server(service)) as client:
        namespace = ok(await client.call_tool("create_lease_namespace", {}))["namespace"]
        lease = {"namespace": namespace, "key": "job"}
        token = ok(await client.call_tool("acquire_lease", lease))["owner_token"]
        refused(
            await client.call_tool(
                "complete_lease", {**lease, "owner_token": token, "result": deep}
            ),
            "invalid",
        )
        refused(
            await client.call_tool("acquire_lease", {**lease, "fingerprint": "a\ud800b"}),
            "invalid",
        )
        # The lease is untouched by the refused calls: it can still complete.
        ok(await client.call_tool("complete_lease", {**lease, "owner_token": token, "result": 1}))


@pytest.mark.anyio
async def test_too_large_result_leaves_the_lease(service: LeaseService) -> None:
    """A result over 32,768 bytes is a too_large tool error and the owner keeps the lease."""
    async with running(service), Client(create_mcp_server(service)) as client:
        namespace = ok(await client.call_tool("create_lease_namespace", {}))["namespace"]
        lease = {"namespace": namespace, "key": "job"}
        token = ok(await client.call_tool("acquire_lease", lease))["owner_token"]
        big = {**lease, "owner_token": token, "result": "x" * 40_000}
        refused(await client.call_tool("complete_lease", big), "too_large")
        ok(await client.call_tool("release_lease", {**lease, "owner_token": token}))


@pytest.mark.anyio
async def test_time_is_the_service_clock(service: LeaseService, clock: FakeClock) -> None:
    """retry_after_seconds counts down on the fake clock; after expiry the old owner is lost
    and the next acquire gets a higher fencing token."""
    async with running(service), Client(create_mcp_server(service)) as client:
        namespace = ok(await client.call_tool("create_lease_namespace", {}))["namespace"]
        lease = {"namespace": namespace, "key": "invoice:2026-09-05"}
        first = ok(await client.call_tool("acquire_lease", {**lease, "ttl_seconds": 60}))
        clock.advance(17)
        held = refused(await client.call_tool("acquire_lease", lease), "held")
        assert held["retry_after_seconds"] == 43
        clock.advance(43)
        refused(
            await client.call_tool("renew_lease", {**lease, "owner_token": first["owner_token"]}),
            "lost",
        )
        second = ok(await client.call_tool("acquire_lease", lease))
        assert second["fencing_token"] > first["fencing_token"]
        released = ok(
            await client.call_tool("release_lease", {**lease, "owner_token": second["owner_token"]})
        )
        assert released == {"ok": True, "status": "released", "fencing_token": 2}


def deterministic_random() -> Callable[[int], bytes]:
    counter = itertools.count()
    return lambda n: hashlib.sha256(str(next(counter)).encode()).digest()[:n]


@pytest.mark.anyio
async def test_same_bodies_as_http(clock: FakeClock) -> None:
    """Step by step, each tool returns exactly the HTTP body, and is an error exactly when
    HTTP answers 4xx."""
    http_service = LeaseService(MemoryStore(clock), random_bytes=deterministic_random())
    mcp_service = LeaseService(MemoryStore(clock), random_bytes=deterministic_random())
    app = create_app(http_service, Settings(), run_cleanup=False)
    routes = {
        "namespace": "/lease/namespace",
        "acquire": "/lease",
        "renew": "/lease/renew",
        "release": "/lease/release",
        "complete": "/lease/complete",
    }
    tool_of = {operation: tool for tool, operation in TOOL_OPERATIONS.items()}
    with TestClient(app) as http:
        async with running(mcp_service), Client(create_mcp_server(mcp_service)) as client:

            async def both(operation: str, **arguments: Any) -> dict[str, Any]:
                response = http.post(f"/services/v1{routes[operation]}", json=arguments)
                result = await client.call_tool(tool_of[operation], arguments)
                assert body(result) == response.json()
                assert result.is_error == (response.status_code >= 400)
                return dict(response.json())

            ns = (await both("namespace"))["namespace"]
            lease = {"namespace": ns, "key": "report:2026-09"}
            token = (await both("acquire", **lease, fingerprint="a", ttl_seconds=30))["owner_token"]
            clock.advance(10.5)
            await both("acquire", **lease, fingerprint="a")
            await both("acquire", **lease)
            await both("renew", **lease, owner_token=token, ttl_seconds=90)
            await both("release", **lease, owner_token=token)
            token = (await both("acquire", **lease, fingerprint="a"))["owner_token"]
            await both("complete", **lease, owner_token=token, result={"token": 1, "n": [1.5]})
            await both("acquire", **lease, fingerprint="a")
            await both("acquire", **lease, fingerprint="b")
            await both("complete", **lease, owner_token=token, result=None)
            await both("acquire", key="too-short")
            await both("renew", **lease, owner_token="own_nope")


@pytest.mark.anyio
async def test_unexpected_errors_are_internal_and_logged_without_arguments(
    service: LeaseService, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unforeseen exception is an internal tool error; the log has the traceback but
    not the arguments."""

    async def broken(operation: str, data: Any) -> Any:
        raise RuntimeError("store exploded")

    monkeypatch.setattr(service, "handle", broken)
    secret_key = "invoice:very-secret-key"
    with caplog.at_level(logging.ERROR, logger="leasekeeper.mcp"):
        async with Client(create_mcp_server(service)) as client:
            reply = refused(
                await client.call_tool("acquire_lease", {"key": secret_key}), "internal"
            )
    assert reply == {"ok": False, "status": "internal", "error": "Internal error"}
    assert "store exploded" in caplog.text
    assert secret_key not in caplog.text


@pytest.mark.anyio
async def test_unknown_tool_is_a_protocol_error(service: LeaseService) -> None:
    """Calling a tool that does not exist is an MCP error, not a tool result: -32602
    (invalid params), as the MCP spec asks for an unknown tool."""
    async with Client(create_mcp_server(service)) as client:
        with pytest.raises(MCPError, match="Unknown tool") as raised:
            await client.call_tool("delete_everything", {})
    assert raised.value.code == INVALID_PARAMS


# -- /mcp in the HTTP app, in process --------------------------------------------------------

_INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "test", "version": "1"},
    },
}
_MCP_HEADERS = {"accept": "application/json, text/event-stream"}


_MODERN = "2026-07-28"
ERAS = ["handshake-era", _MODERN]


@pytest.fixture
def app_with_mcp(clock: FakeClock) -> Iterator[TestClient]:
    """The app ``leasekeeper serve`` runs, with the default settings."""
    app = serve_app(LeaseService(MemoryStore(clock)), Settings(), run_cleanup=False)
    with TestClient(app, base_url="http://127.0.0.1:8787") as client:
        yield client


def call_over_mcp(
    client: TestClient, era: str, name: str, arguments: dict[str, Any] | str
) -> CallToolResult:
    """One stateless tools/call POST to /mcp (``post_tool_call``), answered 200."""
    response = post_tool_call(client, era, name, arguments)
    assert response.status_code == 200, response.text
    return CallToolResult.model_validate(response.json()["result"])


def post_tool_call(
    client: TestClient,
    era: str,
    name: str,
    arguments: dict[str, Any] | str,
    *,
    prefix: bytes = b"",
) -> httpx.Response:
    """A stateless tools/call POST to /mcp, as a handshake-era or a 2026-07-28 client
    sends it (the SDK serves the two on different paths). ``arguments`` as a string is
    sent as raw JSON text, as no client's JSON encoder would write it."""
    raw = isinstance(arguments, str)
    params: dict[str, Any] = {"name": name, "arguments": "RAW" if raw else arguments}
    headers = dict(_MCP_HEADERS)
    if era == _MODERN:
        params["_meta"] = {
            "io.modelcontextprotocol/protocolVersion": _MODERN,
            "io.modelcontextprotocol/clientCapabilities": {},
        }
        headers |= {"mcp-protocol-version": _MODERN, "mcp-method": "tools/call", "mcp-name": name}
    message = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params}
    text = json.dumps(message)
    if isinstance(arguments, str):
        text = text.replace('"RAW"', arguments)
    headers["content-type"] = "application/json"
    return client.post("/mcp", content=prefix + text.encode(), headers=headers)


class CountingRandom:
    """``random_bytes`` for the service that counts its draws: every mint draws once."""

    def __init__(self) -> None:
        self.draws = 0

    def __call__(self, n: int) -> bytes:
        self.draws += 1
        return secrets.token_bytes(n)


@contextlib.contextmanager
def served(
    monotonic: FakeMonotonic, random: CountingRandom, environ: dict[str, str]
) -> Iterator[TestClient]:
    """The app ``leasekeeper serve`` runs, with settings read from ``environ``, for one
    client address; rate limits run on ``monotonic``."""
    service = LeaseService(MemoryStore(), random_bytes=random)
    app = serve_app(service, Settings.from_env(environ), monotonic=monotonic, run_cleanup=False)
    with TestClient(app, base_url="http://127.0.0.1:8787", client=("203.0.113.66", 4000)) as client:
        yield client


def test_mcp_route_keeps_the_api_guarantees(app_with_mcp: TestClient) -> None:
    """/mcp answers POSTs with stateless JSON and the API's security headers, beside a
    working API; GET and DELETE are 405."""
    response = app_with_mcp.post("/mcp", json=_INITIALIZE, headers=_MCP_HEADERS)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["cache-control"] == "no-store"
    assert response.headers["x-content-type-options"] == "nosniff"
    assert "mcp-session-id" not in response.headers
    assert response.json()["result"]["serverInfo"]["name"] == "leasekeeper"
    minted = app_with_mcp.post("/services/v1/lease/namespace", json={})
    assert minted.status_code == 201
    # Stateless: no standalone SSE stream to open, no session to delete.
    for method in ("GET", "DELETE"):
        refused = app_with_mcp.request(method, "/mcp", headers=_MCP_HEADERS)
        assert refused.status_code == 405
        assert refused.json()["status"] == "method_not_allowed"
    # /mcp/ is /mcp, served without a redirect.
    slash = app_with_mcp.post("/mcp/", json=_INITIALIZE, headers=_MCP_HEADERS)
    assert slash.status_code == 200 and not slash.history
    assert slash.json()["result"]["serverInfo"]["name"] == "leasekeeper"
    # In the metrics, /mcp is a route of its own, not "other".
    metrics = app_with_mcp.get("/metrics").text
    assert 'leasekeeper_requests_total{route="mcp",status="200"} 2.0' in metrics
    assert 'leasekeeper_requests_total{route="mcp",status="405"} 2.0' in metrics
    assert 'route="other"' not in metrics


@pytest.mark.parametrize("era", ERAS)
@pytest.mark.parametrize("number", ["NaN", "-Infinity", "1e999"])
def test_numbers_json_does_not_have_are_a_parse_error_over_mcp(
    app_with_mcp: TestClient, era: str, number: str
) -> None:
    """``NaN``, ``Infinity`` and a number past a double, which the SDK's JSON-RPC parser
    reads as floats, are not JSON: the parse error (-32700, with the request's id), as
    over stdio, wherever they are, in the arguments or not; the lease stays as it was."""
    namespace = app_with_mcp.post("/services/v1/lease/namespace", json={}).json()["namespace"]
    lease = {"namespace": namespace, "key": "job"}
    token = body(call_over_mcp(app_with_mcp, era, "acquire_lease", lease))["owner_token"]
    owned = json.dumps({**lease, "owner_token": token})[:-1]  # to add fields to
    for name, arguments in [
        ("complete_lease", f'{owned}, "result": {{"x": [1, {number}]}}}}'),
        ("renew_lease", f'{owned}, "ttl_seconds": {number}}}'),
        ("renew_lease", f'{owned}}}, "note": {{"x": {number}}}'),  # beside the arguments
    ]:
        response = post_tool_call(app_with_mcp, era, name, arguments)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (response.json()["id"], error["code"]) == (7, -32700)
        assert error["message"].startswith("Parse error: Body is not valid JSON: ")
        assert "number" in error["message"]
    done = call_over_mcp(
        app_with_mcp, era, "complete_lease", {**lease, "owner_token": token, "result": 1}
    )
    assert body(done)["status"] == "completed"


@pytest.mark.parametrize("era", ERAS)
def test_a_byte_order_mark_before_an_mcp_body_is_ignored(
    app_with_mcp: TestClient, era: str
) -> None:
    """As before an API body and a stdio line (the SDK's older transport refused it)."""
    namespace = app_with_mcp.post("/services/v1/lease/namespace", json={}).json()["namespace"]
    arguments = json.dumps({"namespace": namespace, "key": "job"})
    response = post_tool_call(app_with_mcp, era, "acquire_lease", arguments, prefix=UTF8_BOM)
    assert response.status_code == 200, response.text
    assert response.json()["result"]["structuredContent"]["status"] == "held"


@pytest.mark.parametrize(
    ("message", "answer_id"),
    [
        (b'{"jsonrpc": "2.0", "id": true, "method": "ping"}', None),
        (b'{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}', None),
        (b'{"jsonrpc": "2.0", "id": {}, "method": "ping"}', None),
        (b'{"jsonrpc": "1.0", "id": 5, "method": "ping"}', 5),
        (b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]', None),
    ],
)
def test_what_is_not_one_json_rpc_message_is_invalid_request_over_mcp(
    app_with_mcp: TestClient, message: bytes, answer_id: int | None
) -> None:
    """-32600 with the id where it is one, as over stdio: the SDK took a bad id for a
    notification (202, nothing run) and answered a batch with -32602."""
    headers = {**_MCP_HEADERS, "content-type": "application/json"}
    response = app_with_mcp.post("/mcp", content=message, headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["id"] == answer_id
    assert response.json()["error"] == {
        "code": -32600,
        "message": "Validation error: the message is not a valid JSON-RPC request",
    }


@pytest.mark.parametrize("era", ERAS)
def test_a_name_given_twice_is_refused_over_mcp(app_with_mcp: TestClient, era: str) -> None:
    """A tools/call whose JSON repeats a name (in the arguments, or deeper in a result)
    is refused before the SDK reads it, which would keep the last: the JSON-RPC answer
    for JSON that cannot be parsed, HTTP 400. Nothing is acquired or completed."""
    namespace = app_with_mcp.post("/services/v1/lease/namespace", json={}).json()["namespace"]
    lease = {"namespace": namespace, "key": "job"}
    token = body(call_over_mcp(app_with_mcp, era, "acquire_lease", lease))["owner_token"]
    owned = json.dumps({**lease, "owner_token": token})[:-1]
    for name, arguments in [
        ("acquire_lease", f'{{"namespace": "{namespace}", "key": "a", "key": "b"}}'),
        ("complete_lease", f'{owned}, "result": {{"paid": false, "paid": true}}}}'),
    ]:
        response = post_tool_call(app_with_mcp, era, name, arguments)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == -32700
        assert "duplicate field name" in response.json()["error"]["message"]
        assert response.headers["cache-control"] == "no-store"
    for key in ("a", "b"):  # neither was acquired
        acquired = call_over_mcp(app_with_mcp, era, "acquire_lease", {**lease, "key": key})
        assert body(acquired)["status"] == "held" and not acquired.is_error
    done = call_over_mcp(app_with_mcp, era, "complete_lease", {**lease, "owner_token": token,
                                                                "result": 1})  # fmt: skip
    assert body(done)["status"] == "completed"


def test_a_message_that_is_not_json_rpc_is_refused_without_quoting_it(
    app_with_mcp: TestClient,
) -> None:
    """A tools/call without "jsonrpc" is refused by the SDK, whose message quoted the
    input (pydantic's error text): here it names no value, owner token included."""
    namespace = app_with_mcp.post("/services/v1/lease/namespace", json={}).json()["namespace"]
    token = "own_" + "Q" * 42 + "A"
    arguments = {"namespace": namespace, "key": "invoice:2026-09-05", "owner_token": token}
    message = {"id": 1, "method": "tools/call",
               "params": {"name": "release_lease", "arguments": arguments}}  # fmt: skip
    response = app_with_mcp.post("/mcp", json=message, headers=_MCP_HEADERS)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("Validation error")
    for secret in (namespace, token, token[-20:], "invoice:2026-09-05", namespace[-12:]):
        assert secret not in response.text
    assert int(response.headers["content-length"]) == len(response.content)


def test_mcp_route_limits_bodies_and_hosts(app_with_mcp: TestClient) -> None:
    """/mcp refuses bodies over the API's 64 KiB limit, foreign Host headers on loopback
    and bodies without a JSON Content-Type, each with a JSON body."""
    big = {**_INITIALIZE, "params": {**_INITIALIZE["params"], "pad": "x" * 70_000}}
    too_large = app_with_mcp.post("/mcp", json=big, headers=_MCP_HEADERS)
    assert too_large.status_code == 413
    # A JSON-RPC error (an MCP client reads no other body: it would say "Server returned
    # an error response"), with the id unread, and the API's body as its data.
    assert too_large.json() == {
        "jsonrpc": "2.0",
        "id": None,
        "error": {
            "code": -32600,
            "message": "Invalid request: the message is larger than 65536 bytes",
            "data": {
                "ok": False,
                "status": "too_large",
                "error": "Request body is larger than 65536 bytes",
            },
        },
    }
    assert too_large.headers["connection"] == "close"
    rebinding = app_with_mcp.post(
        "/mcp", json=_INITIALIZE, headers={**_MCP_HEADERS, "host": "evil.example"}
    )
    assert rebinding.status_code == 421
    # The SDK's plain-text refusals come as the API's JSON, with the SDK's sentence.
    assert rebinding.json() == {"ok": False, "status": "invalid", "error": "Invalid Host header"}
    untyped = app_with_mcp.post(
        "/mcp", content=json.dumps(_INITIALIZE), headers={**_MCP_HEADERS, "content-type": ""}
    )
    assert untyped.status_code == 400
    assert untyped.json()["status"] == "invalid" and "Content-Type" in untyped.json()["error"]
    assert untyped.headers["content-type"] == "application/json"
    for plain in (rebinding, untyped):  # the SDK's own length went with its plain text
        assert plain.headers.get_list("content-length") == [str(len(plain.content))]


@pytest.mark.parametrize(
    "header",
    [
        {"host": "localhost:8787"},
        {"host": "[::1]:8787"},
        {"host": "[::1]"},
        {"origin": "https://localhost:8787"},
        {"origin": "http://[::1]:8787"},
        {"origin": "https://127.0.0.1"},
    ],
    ids=["localhost", "ipv6", "ipv6-no-port", "https-localhost", "http-ipv6", "https-ipv4"],
)
def test_every_loopback_host_and_origin_is_served(
    app_with_mcp: TestClient, header: dict[str, str]
) -> None:
    """On a loopback listener /mcp refuses foreign Host and Origin headers only: each
    loopback name (IPv6 in brackets, as in a Host header), with or without a port, over
    http or https, is served."""
    response = app_with_mcp.post("/mcp", json=_INITIALIZE, headers={**_MCP_HEADERS, **header})
    assert response.status_code == 200, response.text
    assert response.json()["result"]["serverInfo"]["name"] == "leasekeeper"


def test_a_body_limit_raised_past_the_sdks_own_holds_on_mcp(clock: FakeClock) -> None:
    """LEASEKEEPER_MAX_BODY_BYTES is the /mcp body limit also when raised past the SDK's
    own 4 MiB: a 5 MiB body under a 6 MiB limit is served, one past the limit is 413."""
    limit = 6 * 1024 * 1024
    settings = Settings(max_body_bytes=limit)
    app = serve_app(LeaseService(MemoryStore(clock)), settings, run_cleanup=False)
    with TestClient(app, base_url="http://127.0.0.1:8787") as client:
        for pad, status in ((5 * 1024 * 1024, 200), (limit, 413)):
            padded = {**_INITIALIZE, "params": {**_INITIALIZE["params"], "pad": "x" * pad}}
            response = client.post("/mcp", json=padded, headers=_MCP_HEADERS)
            assert response.status_code == status, response.text[:200]
        assert response.json()["error"]["data"]["status"] == "too_large"


@pytest.mark.parametrize(
    ("message", "answer_id"),
    [
        (b'{"jsonrpc":"2.0","id":3,"method":"ping","x":NaN}', 3),
        (b'{"jsonrpc":"2.0","id":3,"id":4,"method":"ping"}', None),  # which of the two?
        (b'{"jsonrpc":"2.0","id":"\xff","method":"ping"}', None),  # not the client's text
    ],
    ids=["readable", "repeated", "not-utf-8"],
)
def test_a_parse_error_over_mcp_carries_an_id_only_where_it_is_certain(
    app_with_mcp: TestClient, message: bytes, answer_id: int | None
) -> None:
    """The parse error (-32700) answers with the message's id where a lenient reading
    finds exactly one, whole; a repeated id, or one that is not UTF-8 (read as U+FFFD,
    which no client sent), is answered with null."""
    headers = {**_MCP_HEADERS, "content-type": "application/json"}
    response = app_with_mcp.post("/mcp", content=message, headers=headers)
    assert response.status_code == 400, response.text
    assert (response.json()["id"], response.json()["error"]["code"]) == (answer_id, -32700)


def test_refused_host_and_origin_values_are_not_logged(
    app_with_mcp: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK's warning about a refused Host or Origin header says which header, without
    its value (a client's text of any size), in an app that embeds the mount too (no
    quiet_sdk_logs, which the CLI runs)."""
    value = "ns_" + "Q" * 43
    with caplog.at_level(logging.WARNING, logger="mcp"):
        for header in ({"host": value}, {"origin": f"http://x/{value}"}):
            refused = app_with_mcp.post(
                "/mcp", json=_INITIALIZE, headers={**_MCP_HEADERS, **header}
            )
            assert refused.status_code in (400, 403, 421)
    lines = [record.getMessage() for record in caplog.records]
    assert "Invalid Host header (the value is not logged)" in lines
    assert "Invalid Origin header (the value is not logged)" in lines
    assert value not in caplog.text


def test_the_sdks_loggers_are_held_at_warning_under_debug() -> None:
    """``quiet_sdk_logs`` (run by ``serve`` and ``mcp``): under a DEBUG root the SDK's
    loggers, which at DEBUG may print raw frames, log WARNING and above; a root level
    above WARNING still applies."""
    root, sdk = logging.getLogger(), logging.getLogger("mcp")
    saved = root.level, sdk.level
    try:
        root.setLevel(logging.DEBUG)
        leasekeeper.mcp.quiet_sdk_logs()
        frames = logging.getLogger("mcp.server.streamable_http")
        assert not frames.isEnabledFor(logging.INFO) and frames.isEnabledFor(logging.WARNING)
        root.setLevel(logging.ERROR)
        leasekeeper.mcp.quiet_sdk_logs()
        assert sdk.getEffectiveLevel() == logging.ERROR
    finally:
        root.setLevel(saved[0])
        sdk.setLevel(saved[1])


@pytest.mark.anyio
async def test_quiet_sdk_logs_keeps_out_the_frames_the_sdk_logs_whole_at_debug(
    service: LeaseService, caplog: pytest.LogCaptureFixture
) -> None:
    """Why ``quiet_sdk_logs``: at DEBUG, mcp 2.3 logs whole each frame past the eighth
    that comes before a connection's first request, whatever it carries (here a
    namespace). If this test finds the SDK no longer does, ``quiet_sdk_logs`` can go."""
    from mcp.server.stdio import stdio_server

    secret = "ns_" + "S" * 43
    frame = {"jsonrpc": "2.0", "method": "notifications/x", "params": {"namespace": secret}}

    class Stdout:
        async def write(self, text: str) -> None: ...
        async def flush(self) -> None: ...

    async def serve() -> None:
        async def lines() -> AsyncIterator[str]:
            for _ in range(10):
                yield json.dumps(frame) + "\n"

        server = create_mcp_server(service)
        async with stdio_server(stdin=lines(), stdout=Stdout()) as (read, write):  # type: ignore[arg-type]
            await server.run(read, write, server.create_initialization_options())

    sdk = logging.getLogger("mcp")
    saved = sdk.level
    caplog.set_level(logging.DEBUG)
    try:
        await serve()
        assert secret in caplog.text, "the SDK no longer logs frames whole: drop quiet_sdk_logs"
        caplog.clear()
        leasekeeper.mcp.quiet_sdk_logs()
        await serve()
        assert secret not in caplog.text
    finally:
        sdk.setLevel(saved)


@pytest.mark.parametrize("era", ERAS)
def test_mcp_mints_past_the_burst_are_rate_limited_as_over_http(
    monotonic: FakeMonotonic, era: str
) -> None:
    """LEASEKEEPER_NAMESPACE_RATE / _BURST hold for create_lease_namespace over /mcp: past
    the burst a mint is a rate_limited tool error with HTTP's 429 body, and mints nothing."""
    random = CountingRandom()
    limits = {"LEASEKEEPER_NAMESPACE_BURST": "3", "LEASEKEEPER_NAMESPACE_RATE": "0.5"}
    with served(monotonic, random, limits) as client:
        for _ in range(3):
            assert ok(call_over_mcp(client, era, "create_lease_namespace", {}))["namespace"]
        assert random.draws == 3
        for _ in range(2):
            result = call_over_mcp(client, era, "create_lease_namespace", {})
            reply = refused(result, "rate_limited")
            assert "namespace" not in reply
        assert random.draws == 3
        over_http = client.post("/services/v1/lease/namespace")
        assert over_http.status_code == 429
        assert reply == over_http.json()
        assert reply["retry_after_seconds"] == 2  # one token at 0.5 per second
        assert over_http.headers["retry-after"] == "2"
        monotonic.advance(2)
        ok(call_over_mcp(client, era, "create_lease_namespace", {}))
        assert random.draws == 4


@pytest.mark.parametrize("era", ERAS)
@pytest.mark.parametrize("last", ["http", "mcp"])
def test_http_and_mcp_mint_from_one_bucket(monotonic: FakeMonotonic, era: str, last: str) -> None:
    """With a burst of 2, one mint over HTTP and one over MCP from one address spend it:
    the next one is refused, whichever way it comes."""
    random = CountingRandom()
    limits = {"LEASEKEEPER_NAMESPACE_BURST": "2", "LEASEKEEPER_NAMESPACE_RATE": "1"}
    with served(monotonic, random, limits) as client:
        assert client.post("/services/v1/lease/namespace").status_code == 201
        ok(call_over_mcp(client, era, "create_lease_namespace", {}))
        if last == "http":
            third = client.post("/services/v1/lease/namespace")
            assert third.status_code == 429
            assert third.json()["status"] == "rate_limited"
        else:
            refused(call_over_mcp(client, era, "create_lease_namespace", {}), "rate_limited")
        assert random.draws == 2


def lease_over_http(client: TestClient, operation: str, **data: Any) -> httpx.Response:
    path = "/services/v1/lease" if operation == "acquire" else f"/services/v1/lease/{operation}"
    return client.post(path, json=data)


def same_429_then_free(
    client: TestClient,
    era: str,
    monotonic: FakeMonotonic,
    reply: dict[str, Any],
    lease: dict[str, Any],
) -> None:
    """HTTP refuses the same acquire with the body the MCP refusal carried; once the one
    token at 0.5 per second is back, the key, untouched by the refusals, is acquired."""
    over_http = lease_over_http(client, "acquire", **lease)
    assert over_http.status_code == 429
    assert reply == over_http.json()
    assert reply["retry_after_seconds"] == 2
    monotonic.advance(2)
    assert ok(call_over_mcp(client, era, "acquire_lease", lease))["status"] == "held"


@pytest.mark.parametrize("era", ERAS)
def test_mcp_calls_past_the_address_burst_are_rate_limited_as_over_http(
    monotonic: FakeMonotonic, era: str
) -> None:
    """LEASEKEEPER_ADDRESS_RATE / _BURST hold for every tool call over /mcp: past the burst
    a call is a rate_limited tool error with HTTP's 429 body, and does nothing."""
    random = CountingRandom()
    limits = {"LEASEKEEPER_ADDRESS_BURST": "4", "LEASEKEEPER_ADDRESS_RATE": "0.5"}
    with served(monotonic, random, limits) as client:
        namespace = ok(call_over_mcp(client, era, "create_lease_namespace", {}))["namespace"]
        lease = {"namespace": namespace, "key": "job"}
        token = ok(call_over_mcp(client, era, "acquire_lease", lease))["owner_token"]
        owned = {**lease, "owner_token": token}
        ok(call_over_mcp(client, era, "renew_lease", owned))
        ok(call_over_mcp(client, era, "release_lease", owned))
        # The burst of 4 is spent: every tool is refused, a mint included.
        draws = random.draws
        other = {"namespace": namespace, "key": "other"}
        for name, arguments in [
            ("acquire_lease", other),
            ("renew_lease", owned),
            ("complete_lease", {**owned, "result": 1}),
            ("create_lease_namespace", {}),
        ]:
            reply = refused(call_over_mcp(client, era, name, arguments), "rate_limited")
            assert "requests from this address" in reply["error"]
        assert random.draws == draws  # no namespace minted, no owner token issued
        same_429_then_free(client, era, monotonic, reply, other)


def third_is_rate_limited(
    client: TestClient, era: str, last: str, operation: str, data: dict[str, Any]
) -> None:
    """The request after a shared burst is refused as rate_limited, whether it comes over
    HTTP (429) or, as the tool ``{operation}_lease``, over MCP."""
    if last == "http":
        third = lease_over_http(client, operation, **data)
        assert third.status_code == 429
        assert third.json()["status"] == "rate_limited"
    else:
        refused(call_over_mcp(client, era, f"{operation}_lease", data), "rate_limited")


@pytest.mark.parametrize("era", ERAS)
@pytest.mark.parametrize("last", ["http", "mcp"])
def test_http_and_mcp_requests_from_one_address_share_one_bucket(
    monotonic: FakeMonotonic, era: str, last: str
) -> None:
    """With a per-address burst of 2, one HTTP request and one MCP tool call from one
    address spend it: the next request is refused, whichever way it comes."""
    limits = {"LEASEKEEPER_ADDRESS_BURST": "2", "LEASEKEEPER_ADDRESS_RATE": "1"}
    with served(monotonic, CountingRandom(), limits) as client:
        lease = {"key": secrets.token_urlsafe(32)}
        assert lease_over_http(client, "acquire", **lease).status_code == 201
        refused(call_over_mcp(client, era, "acquire_lease", lease), "held")
        third_is_rate_limited(client, era, last, "acquire", lease)


@pytest.mark.parametrize("era", ERAS)
def test_mcp_calls_for_a_hot_namespace_are_rate_limited_as_over_http(
    monotonic: FakeMonotonic, era: str
) -> None:
    """LEASEKEEPER_NAMESPACE_REQUEST_RATE / _BURST hold over /mcp: past the burst, acquire
    and renew for that namespace are rate_limited tool errors with HTTP's 429 body, while
    another namespace is still served."""
    limits = {
        "LEASEKEEPER_NAMESPACE_REQUEST_BURST": "3",
        "LEASEKEEPER_NAMESPACE_REQUEST_RATE": "0.5",
    }
    with served(monotonic, CountingRandom(), limits) as client:
        hot, cold = (
            ok(call_over_mcp(client, era, "create_lease_namespace", {}))["namespace"]
            for _ in range(2)
        )
        lease = {"namespace": hot, "key": "job"}
        token = ok(call_over_mcp(client, era, "acquire_lease", lease))["owner_token"]
        owned = {**lease, "owner_token": token}
        ok(call_over_mcp(client, era, "renew_lease", owned))
        ok(call_over_mcp(client, era, "renew_lease", owned))
        refused(call_over_mcp(client, era, "renew_lease", owned), "rate_limited")
        other = {"namespace": hot, "key": "other"}
        reply = refused(call_over_mcp(client, era, "acquire_lease", other), "rate_limited")
        assert "requests for this namespace" in reply["error"]
        # Another namespace, from the same address, is served.
        ok(call_over_mcp(client, era, "acquire_lease", {"namespace": cold, "key": "job"}))
        same_429_then_free(client, era, monotonic, reply, other)


@pytest.mark.parametrize("era", ERAS)
@pytest.mark.parametrize("last", ["http", "mcp"])
def test_http_and_mcp_requests_for_one_namespace_share_one_bucket(
    monotonic: FakeMonotonic, era: str, last: str
) -> None:
    """With a per-namespace burst of 2, one HTTP request and one MCP tool call for one
    namespace spend it: the next request for it is refused, whichever way it comes, and
    another namespace is served."""
    limits = {"LEASEKEEPER_NAMESPACE_REQUEST_BURST": "2", "LEASEKEEPER_NAMESPACE_REQUEST_RATE": "1"}
    with served(monotonic, CountingRandom(), limits) as client:
        hot, cold = (client.post("/services/v1/lease/namespace").json()["namespace"] for _ in "ab")
        lease = {"namespace": hot, "key": "job"}
        token = lease_over_http(client, "acquire", **lease).json()["owner_token"]
        owned = {**lease, "owner_token": token}
        ok(call_over_mcp(client, era, "renew_lease", owned))
        third_is_rate_limited(client, era, last, "renew", owned)
        ok(call_over_mcp(client, era, "acquire_lease", {"namespace": cold, "key": "job"}))
        assert lease_over_http(client, "acquire", namespace=cold, key="j2").status_code == 201


@pytest.mark.parametrize("era", ERAS)
def test_arguments_too_deep_spend_no_namespace_token_as_over_http(
    monotonic: FakeMonotonic, era: str
) -> None:
    """Arguments that HTTP's parser would refuse (nested past the limit) are refused
    before the namespace limit is spent, as over HTTP: with a per-namespace burst of 1,
    the call after a refused one is still served."""
    limits = {"LEASEKEEPER_NAMESPACE_REQUEST_BURST": "1", "LEASEKEEPER_NAMESPACE_REQUEST_RATE": "1"}
    deep: Any = 1
    for _ in range(70):
        deep = [deep]
    with served(monotonic, CountingRandom(), limits) as client:
        namespace = client.post("/services/v1/lease/namespace").json()["namespace"]
        lease = {"namespace": namespace, "key": "job"}
        body = json.dumps({**lease, "fingerprint": deep})
        over_http = client.post(
            "/services/v1/lease", content=body, headers={"content-type": "application/json"}
        )
        assert over_http.status_code == 400
        too_deep = post_tool_call(client, era, "acquire_lease", {**lease, "fingerprint": deep})
        assert too_deep.status_code == 400  # the message nests past 64 levels: -32700
        assert (
            too_deep.json()["error"]["message"] == "Parse error: Body nests deeper than 64 levels"
        )
        assert ok(call_over_mcp(client, era, "acquire_lease", lease))["status"] == "held"


@pytest.mark.anyio
async def test_call_lease_tool_checks_the_arguments_before_the_namespace_limit(
    service: LeaseService, monotonic: FakeMonotonic
) -> None:
    """``call_lease_tool`` with limits (what ``/mcp`` runs) refuses arguments HTTP's parser
    would refuse (a lone surrogate) before it spends the namespace limit: with a burst of
    1, the call after a refused one is still served."""
    settings = Settings(namespace_request_rate=1, namespace_request_burst=1)
    limits = Limits.from_settings(settings, monotonic=monotonic)
    scope = {"type": "http", "client": ("203.0.113.66", 4000)}
    async with running(service):
        namespace = (await service.handle("namespace", {})).plain()["namespace"]
        lease = {"namespace": namespace, "key": "job"}
        surrogate = {**lease, "fingerprint": "a\ud800b"}
        result = await call_lease_tool(
            service, "acquire_lease", surrogate, limits=limits, scope=scope
        )
        refused(result, "invalid")
        result = await call_lease_tool(service, "acquire_lease", lease, limits=limits, scope=scope)
        assert ok(result)["status"] == "held"


def test_mcp_calls_are_not_rate_limited_by_default(monotonic: FakeMonotonic) -> None:
    """With the default settings (per-address and per-namespace limits off), more tool calls
    from one address for one namespace than either default burst are all served. (One era:
    a thousand calls take seconds, and both eras reach the limits the same way, above.)"""
    era = _MODERN
    settings = Settings()
    assert settings.address_rate == 0 and settings.namespace_request_rate == 0
    calls = max(settings.address_burst, settings.namespace_request_burst) + 50
    with served(monotonic, CountingRandom(), {}) as client:
        namespace = ok(call_over_mcp(client, era, "create_lease_namespace", {}))["namespace"]
        lease = {"namespace": namespace, "key": "job"}
        token = ok(call_over_mcp(client, era, "acquire_lease", lease))["owner_token"]
        owned = {**lease, "owner_token": token}
        for _ in range(calls):
            ok(call_over_mcp(client, era, "renew_lease", owned))


@pytest.mark.anyio
async def test_the_stdio_server_does_not_limit_minting(service: LeaseService) -> None:
    """The server that ``leasekeeper mcp`` serves over stdio has no mint limit (its peer is
    a local process with no address): more mints than the default burst all succeed."""
    async with running(service), Client(create_mcp_server(service)) as client:
        for _ in range(Settings().namespace_burst + 10):
            ok(await client.call_tool("create_lease_namespace", {}))


@pytest.mark.anyio
async def test_the_stdio_servers_first_cleanup_runs_within_the_first_interval() -> None:
    """As under ``serve``, the first cleanup of ``leasekeeper mcp`` runs at a random point of
    the first interval, not after a whole one: a desktop client starts it per session, often
    for less than the hour, and such a store was never cleaned up. Then one per interval."""

    class Cleanups:
        done = 0

        async def cleanup(self) -> int:
            self.done += 1
            return 0

    cleanups, sleep = Cleanups(), ManualSleep()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(lambda: clean_up_every(cleanups, 3600, sleep=sleep))  # type: ignore[arg-type]
        await sleep.until_asleep(1)
        (first,) = sleep.pauses
        assert 0 <= first < 3600
        assert cleanups.done == 0  # not before the first pause ends
        await sleep.wake()
        await sleep.until_asleep(1)
        assert cleanups.done == 1
        assert sleep.pauses == [first, 3600]
        tasks.cancel_scope.cancel()


# -- real transports: subprocesses -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve(tmp_path: Path, log: Path, **settings: str) -> Iterator[str]:
    """``leasekeeper serve`` on a free port with DEBUG logs to ``log`` and ``settings`` as
    LEASEKEEPER_ variables; yields its base URL."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    env["LEASEKEEPER_LOG_LEVEL"] = "DEBUG"
    env.update({f"LEASEKEEPER_{name.upper()}": value for name, value in settings.items()})
    command = [str(LEASEKEEPER), "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--store", f"sqlite:///{tmp_path}/x.db"]
    with log.open("w") as stderr:
        process = subprocess.Popen(command, stderr=stderr, stdout=stderr, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + FLOW_TIMEOUT
        while True:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "leasekeeper serve did not start"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            time.sleep(0.05)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.slow
@pytest.mark.anyio
async def test_streamable_http_against_leasekeeper_serve(tmp_path: Path) -> None:
    """The flow over real streamable HTTP at /mcp, for 2026 and handshake-era clients;
    the server's DEBUG log holds none of the secrets."""
    log = tmp_path / "serve.log"
    secrets = Secrets()
    with serve(tmp_path, log) as base:
        for mode in ("auto", "legacy"):
            async with Client(f"{base}/mcp", mode=mode) as client:
                await full_flow(client, secrets)
    assert_no_secrets(log.read_text(), secrets)


@pytest.mark.slow
@pytest.mark.anyio
async def test_leasekeeper_serve_limits_mints_over_http_and_mcp_together(tmp_path: Path) -> None:
    """``leasekeeper serve`` with a burst of 2 (and next to no refill): a mint over HTTP and
    one over /mcp spend it, and the next mint is refused over both."""
    with serve(
        tmp_path, tmp_path / "serve.log", namespace_burst="2", namespace_rate="0.001"
    ) as base:
        async with httpx.AsyncClient(base_url=base) as http, Client(f"{base}/mcp") as client:
            assert (await http.post("/services/v1/lease/namespace")).status_code == 201
            ok(await client.call_tool("create_lease_namespace", {}))
            refused(await client.call_tool("create_lease_namespace", {}), "rate_limited")
            # (Bodies are compared on a fake clock above: here the wait counts down.)
            over_http = await http.post("/services/v1/lease/namespace")
            assert over_http.status_code == 429
            assert over_http.json()["status"] == "rate_limited"


@pytest.mark.slow
@pytest.mark.anyio
async def test_stdio_against_leasekeeper_mcp(tmp_path: Path) -> None:
    """The flow over stdio against ``leasekeeper mcp``; its stderr (DEBUG) holds none of
    the secrets."""
    log = tmp_path / "stdio.log"
    secrets = Secrets()
    params = StdioServerParameters(
        command=str(LEASEKEEPER),
        args=["mcp", "--store", f"sqlite:///{tmp_path}/y.db"],
        env={"LEASEKEEPER_LOG_LEVEL": "DEBUG"},
    )
    with log.open("w") as errlog:
        for mode in ("auto", "legacy"):
            async with Client(stdio_client(params, errlog=errlog), mode=mode) as client:
                await full_flow(client, secrets)
    text = log.read_text()
    assert "MCP on stdio" in text
    assert_no_secrets(text, secrets)


_INITIALIZE_LINE = (
    b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":'
    b'"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}'
)


class _StdioPeer:
    """``leasekeeper mcp`` driven line by line, raw bytes in and JSON lines out."""

    def __init__(self, db: Path, errlog: Any, env: Mapping[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [str(LEASEKEEPER), "mcp", "--store", f"sqlite:///{db}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errlog,
            env=env,
        )

    def __enter__(self) -> _StdioPeer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process.poll() is None:  # a failed assertion left it running
            self.process.kill()
            self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()

    def send(self, line: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + b"\n")
        self.process.stdin.flush()

    def answer(self, line: bytes) -> dict[str, Any]:
        """Send ``line`` and read the one answer it gets (within FLOW_TIMEOUT seconds)."""
        self.send(line)
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], FLOW_TIMEOUT)
        assert ready, f"no answer to {line[:60]!r}"
        answer = json.loads(self.process.stdout.readline())
        assert isinstance(answer, dict)
        return answer

    def call(self, request_id: int, tool: str, arguments: bytes) -> bytes:
        return (
            b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"%s",'
            % (
                request_id,
                tool.encode(),
            )
            + b'"arguments":%s}}' % arguments
        )

    def close(self) -> int:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.close()
        try:
            return self.process.wait(FLOW_TIMEOUT)
        finally:
            self.process.stdout.close()


@pytest.mark.slow
def test_stdio_refuses_what_the_api_refuses_and_answers_every_line(tmp_path: Path) -> None:
    """Over stdio each line is read as ``/mcp`` reads a body: a repeated name, bytes that
    are not UTF-8, a lone surrogate, NaN, deep nesting and a 5,000-digit number get the
    parse error (-32700), a message that is not JSON-RPC or is over 64 KiB the
    invalid-request error (-32600), with the request's id where one can be read; none of
    them changes anything, and the peer is never left waiting (the SDK alone took the
    last of a repeated name, made bad bytes U+FFFD, and answered the rest with nothing)."""
    with (
        (tmp_path / "stdio.log").open("w") as errlog,
        _StdioPeer(tmp_path / "s.db", errlog) as peer,
    ):
        hello = peer.answer(_INITIALIZE_LINE)
        assert "result" in hello
        peer.send(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
        minted = peer.answer(peer.call(2, "create_lease_namespace", b"{}"))
        ns = minted["result"]["structuredContent"]["namespace"].encode()

        def acquire(request_id: int, rest: bytes) -> bytes:
            return peer.call(request_id, "acquire_lease", b'{"namespace":"%s",%s}' % (ns, rest))

        parse, invalid = -32700, -32600
        refused = [
            (acquire(3, b'"key":"first","key":"second"'), 3, parse, "duplicate field name"),
            (acquire(4, b'"key":"\xff"'), 4, parse, "not valid UTF-8"),
            (acquire(5, b'"key":"\\ud800"'), 5, parse, "lone surrogate"),
            (acquire(6, b'"key":"k","ttl_seconds":NaN'), 6, parse, "NaN is not a JSON number"),
            (acquire(7, b'"key":"k","ttl_seconds":' + b"9" * 5000), None, parse, "4300 digits"),
            (b'{"x":' + b"[" * 3000 + b"]" * 3000 + b"}", None, parse, "deeper than 64"),
            (b"garbage", None, parse, "Expecting value"),
            (b'{"jsonrpc":"2.0","id":8,"method":"ping"} xyz', None, parse, "Extra data"),
            (b'{"jsonrpc":"2.0","id":9}', 9, invalid, "not a valid JSON-RPC request"),
            (b'[{"jsonrpc":"2.0","id":9,"method":"ping"}]', None, invalid, "JSON-RPC"),
            (b"1", None, invalid, "not a valid JSON-RPC request"),
            # Not taken by the SDK for a notification, unanswered: an id is an int or a string.
            (b'{"jsonrpc":"2.0","id":9.5,"method":"ping"}', None, invalid, "JSON-RPC"),
            (b'{"jsonrpc":"2.0","id":null,"method":"ping"}', None, invalid, "JSON-RPC"),
            # Too long to read whole: its id is read from its start, so the call fails at once.
            (
                b'{"jsonrpc":"2.0","id":10,"method":"ping","pad":"' + b"a" * 70_000 + b'"}',
                10,
                invalid,
                "larger than 65536 bytes",
            ),
            (
                b'{"jsonrpc":"2.0","pad":"' + b"a" * 70_000 + b'","id":10,"method":"ping"}',
                None,
                invalid,
                "larger than 65536 bytes",
            ),
        ]
        for line, request_id, code, why in refused:
            answer = peer.answer(line)
            assert answer["id"] == request_id and "result" not in answer, answer
            assert answer["error"]["code"] == code and why in answer["error"]["message"], answer
        peer.send(b"   ")  # a blank line is skipped, unanswered: the next answer is the ping's
        # A byte-order mark is ignored, as before an HTTP body (the SDK alone answered nothing).
        assert peer.answer(b'\xef\xbb\xbf{"jsonrpc":"2.0","id":11,"method":"ping"}') == {
            "jsonrpc": "2.0",
            "id": 11,
            "result": {},
        }
        # Nothing refused took a lease: the first grant in this store is this one.
        for request_id, key in ((12, b"first"), (13, b"second")):
            granted = peer.answer(acquire(request_id, b'"key":"%s"' % key))
            assert granted["result"]["structuredContent"]["status"] == "held"
            assert granted["result"]["structuredContent"]["fencing_token"] == request_id - 11
        assert peer.close() == 0


@pytest.mark.slow
def test_requests_before_the_end_of_stdin_are_answered_with_their_outcome(
    tmp_path: Path,
) -> None:
    """``echo ... | leasekeeper mcp``: calls sent just before stdin closes are answered
    with what they did. The SDK alone cancelled them at the end of its input and
    answered "Connection closed", while the acquires it had started were granted:
    held leases whose owner tokens nobody received."""
    calls = 20
    with (
        (tmp_path / "stdio.log").open("w") as errlog,
        _StdioPeer(tmp_path / "eof.db", errlog) as peer,
    ):
        assert "result" in peer.answer(_INITIALIZE_LINE)
        peer.send(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
        namespace = peer.answer(peer.call(2, "create_lease_namespace", b"{}"))
        ns = namespace["result"]["structuredContent"]["namespace"].encode()
        for request_id in range(10, 10 + calls):
            arguments = b'{"namespace":"%s","key":"job-%d"}' % (ns, request_id)
            peer.send(peer.call(request_id, "acquire_lease", arguments))
        assert peer.process.stdin is not None and peer.process.stdout is not None
        peer.process.stdin.close()
        assert peer.process.wait(FLOW_TIMEOUT) == 0
        answers = [json.loads(line) for line in peer.process.stdout.read().splitlines()]
    assert sorted(answer["id"] for answer in answers) == list(range(10, 10 + calls))
    for answer in answers:
        assert answer["result"]["structuredContent"]["status"] == "held", answer


@pytest.mark.slow
def test_calls_sharing_an_id_before_stdin_closes_are_all_answered(tmp_path: Path) -> None:
    """Three calls with one id (JSON-RPC asks for distinct ones; a client may not care)
    sent just before stdin closes: each is answered before the server exits, not the
    first alone while the others are cancelled after their work was done. And a
    cancellation naming an id no request can have (a list) changes nothing."""
    with (
        (tmp_path / "stdio.log").open("w") as errlog,
        _StdioPeer(tmp_path / "same.db", errlog) as peer,
    ):
        assert "result" in peer.answer(_INITIALIZE_LINE)
        peer.send(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
        peer.send(
            b'{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":[1]}}'
        )
        for _ in range(3):
            peer.send(peer.call(1, "create_lease_namespace", b"{}"))
        assert peer.process.stdin is not None and peer.process.stdout is not None
        peer.process.stdin.close()
        assert peer.process.wait(FLOW_TIMEOUT) == 0
        answers = [json.loads(line) for line in peer.process.stdout.read().splitlines()]
    assert [answer["id"] for answer in answers] == [1, 1, 1]
    minted = {answer["result"]["structuredContent"]["namespace"] for answer in answers}
    assert len(minted) == 3
    assert '"level":"ERROR"' not in (tmp_path / "stdio.log").read_text()


@pytest.mark.slow
def test_ctrl_c_ends_the_stdio_server_while_its_stdin_stays_open(tmp_path: Path) -> None:
    """SIGINT ends ``leasekeeper mcp`` even while its peer keeps stdin open: the line
    reader is a daemon thread, not one the interpreter waits for at exit."""
    with (
        (tmp_path / "stdio.log").open("w") as errlog,
        _StdioPeer(tmp_path / "c.db", errlog) as peer,
    ):
        assert peer.answer(b'{"jsonrpc":"2.0","id":1,"method":"ping"}')["id"] == 1
        peer.process.send_signal(signal.SIGINT)
        assert peer.process.wait(FLOW_TIMEOUT) in (0, 1, -signal.SIGINT)


@pytest.mark.slow
def test_ctrl_c_while_calls_are_served_is_a_clean_stop(tmp_path: Path) -> None:
    """SIGINT while hundreds of calls are in flight stops ``leasekeeper mcp`` as an idle
    one stops: exit 0, and no ERROR with a traceback (the SDK's streams, closed under
    the answers on their way, had made it look like a crash to a supervisor)."""
    with (
        (tmp_path / "stdio.log").open("w") as errlog,
        _StdioPeer(tmp_path / "busy.db", errlog) as peer,
    ):
        assert "result" in peer.answer(_INITIALIZE_LINE)
        peer.send(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
        assert peer.process.stdout is not None
        drained = threading.Thread(target=peer.process.stdout.read, daemon=True)
        drained.start()
        for request_id in range(1, 400):
            peer.send(peer.call(request_id, "acquire_lease", b'{"key":"job-%d"}' % request_id))
        time.sleep(0.05)  # real processes: mid-way through the calls
        peer.process.send_signal(signal.SIGINT)
        assert peer.process.wait(FLOW_TIMEOUT) == 0
    log = (tmp_path / "stdio.log").read_text()
    assert '"level":"ERROR"' not in log and "Traceback" not in log, log


@pytest.mark.slow
def test_a_peer_that_closes_stdout_ends_the_stdio_server_in_one_line(tmp_path: Path) -> None:
    """The peer closes the server's stdout (it went away) and sends on: the server stops,
    exit 0, with one WARNING saying so, not an ERROR and a traceback."""
    with (
        (tmp_path / "stdio.log").open("w") as errlog,
        _StdioPeer(tmp_path / "gone.db", errlog) as peer,
    ):
        assert "result" in peer.answer(_INITIALIZE_LINE)
        assert peer.process.stdout is not None
        peer.process.stdout.close()
        peer.send(b'{"jsonrpc":"2.0","id":1,"method":"ping"}')
        assert peer.process.wait(FLOW_TIMEOUT) == 0
    lines = [json.loads(line) for line in (tmp_path / "stdio.log").read_text().splitlines()]
    assert [line["level"] for line in lines if line["level"] != "INFO"] == ["WARNING"], lines
    assert "stdout is closed" in lines[-1]["message"] or any(
        "stdout is closed" in line["message"] for line in lines
    )


@pytest.mark.slow
def test_a_peer_that_closes_stdout_leaves_no_error_for_the_interpreter_to_print(
    tmp_path: Path,
) -> None:
    """The answer that met the closed pipe is not flushed again when the SDK's writer is
    collected: Python 3.13 prints that second BrokenPipeError ("Exception ignored in:
    <_io.BufferedWriter ...>") to stderr, in no log line's shape; 3.11 and 3.12 do so in
    development mode, as here."""
    env = {**os.environ, "PYTHONDEVMODE": "1"}
    with (
        (tmp_path / "stdio.log").open("w") as errlog,
        _StdioPeer(tmp_path / "gone.db", errlog, env) as peer,
    ):
        assert "result" in peer.answer(_INITIALIZE_LINE)
        assert peer.process.stdout is not None
        peer.process.stdout.close()
        peer.send(b'{"jsonrpc":"2.0","id":1,"method":"ping"}')
        assert peer.process.wait(FLOW_TIMEOUT) == 0
    log = (tmp_path / "stdio.log").read_text()
    assert "stdout is closed" in log
    assert "Exception ignored" not in log and "Traceback" not in log, log


@pytest.mark.slow
def test_stdio_lines_are_bounded_by_the_configured_body_limit() -> None:
    """``leasekeeper mcp`` refuses a line longer than LEASEKEEPER_MAX_BODY_BYTES (here
    1000), not only one past the default 64 KiB: -32600 with its id; one under it is served."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    env["LEASEKEEPER_MAX_BODY_BYTES"] = "1000"

    def ping(request_id: int, pad: int) -> bytes:
        return b'{"jsonrpc":"2.0","id":%d,"method":"ping","pad":"%s"}' % (request_id, b"a" * pad)

    lines = [_INITIALIZE_LINE, ping(2, 1500), ping(3, 900)]
    done = subprocess.run(
        [str(LEASEKEEPER), "mcp", "--store", "memory://"],
        input=b"\n".join(lines) + b"\n",
        env=env,
        capture_output=True,
        timeout=FLOW_TIMEOUT,
        check=True,
    )
    answers = {answer["id"]: answer for answer in map(json.loads, done.stdout.splitlines())}
    assert sorted(answers) == [1, 2, 3]
    assert answers[2]["error"]["code"] == -32600
    assert "larger than 1000 bytes" in answers[2]["error"]["message"]
    assert answers[3]["result"] == {}


@pytest.mark.parametrize(
    ("start", "request_id"),
    [
        (b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"x":"aaaa', 7),
        (b'\xef\xbb\xbf { "id" : "call-1" , "method"', "call-1"),
        (b'{"jsonrpc":"2.0","params":{"a":[1,2]},"id":3,"me', 3),
        (b'{"jsonrpc":"2.0","id":12', None),  # cut off: 12, or 123...?
        (b'{"jsonrpc":"2.0","params":{"x":"aaaa', None),  # the id, if any, comes later
        (b'{"jsonrpc":"2.0","id":true,"method"', None),  # not an id JSON-RPC allows
        (b'{"jsonrpc":"2.0","id":"\xff","method"', None),
        (b'{"jsonrpc":"2.0"}', None),
        (b'[{"id":1}]', None),
        (b"garbage", None),
        (b"", None),
    ],
)
def test_the_id_of_a_line_too_long_is_read_from_its_start(
    start: bytes, request_id: int | str | None
) -> None:
    """Only where every member before it, and the id itself, are whole in the start."""
    from leasekeeper.mcp._jsonrpc import id_from_start

    assert id_from_start(start) == request_id


def test_stdio_lines_are_split_and_bounded_as_sent() -> None:
    """``_FdLines`` (stdin for ``leasekeeper mcp``): lines split across reads, a line of
    exactly the limit and one past it (dropped but for its start), a long line and a
    short one in one write, and a last line without its newline."""
    from leasekeeper.mcp._stdio import _FdLines, _TooLong

    read_end, write_end = os.pipe()
    try:
        lines = _FdLines(read_end, 10)
        os.write(write_end, b'{"a":')
        os.write(write_end, b"1}\n")
        assert lines.readline() == b'{"a":1}\n'
        os.write(write_end, b"x" * 10 + b"\n" + b"y" * 11 + b"\n")
        assert lines.readline() == b"x" * 10 + b"\n"
        assert lines.readline() == _TooLong(b"y" * 11 + b"\n")
        os.write(write_end, b"z" * 10_000 + b"\nshort\n")
        assert lines.readline() == _TooLong(b"z" * 4096)
        assert lines.readline() == b"short\n"
        os.write(write_end, b"last")
        os.close(write_end)
        write_end = -1
        assert lines.readline() == b"last"
        assert lines.readline() == b""
    finally:
        os.close(read_end)
        if write_end != -1:
            os.close(write_end)


def test_a_line_of_the_limit_whose_newline_comes_in_a_later_read_is_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_FdLines``: a line of exactly ``max_bytes`` whose newline is not in the first read
    (a pipe hands over what was written so far) is a line, not one too long."""
    from leasekeeper.mcp import _stdio

    reads = iter([b"x" * 10, b"\n", b""])
    monkeypatch.setattr(_stdio, "os", SimpleNamespace(read=lambda fd, size: next(reads)))
    lines = _stdio._FdLines(0, 10)
    assert lines.readline() == b"x" * 10 + b"\n"
    assert lines.readline() == b""


@pytest.mark.anyio
async def test_a_cancellation_naming_true_leaves_request_1_due() -> None:
    """``StrictStdin`` counts a request handed on as due until it is answered or cancelled
    (the end of stdin waits for it): a ``notifications/cancelled`` naming ``true`` is no
    cancellation of request 1, as ``true`` is no id; one naming ``1`` is."""
    from leasekeeper.mcp._stdio import StrictStdin

    stdin = StrictStdin(0, 100)  # nothing is read from the descriptor here

    def cancel(request_id: object) -> dict[str, Any]:
        params = {"requestId": request_id}
        return {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": params}

    stdin._note({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {}})
    stdin._note(cancel(True))
    assert dict(stdin._unanswered) == {1: 1}
    stdin._note(cancel(1))
    assert not stdin._unanswered


@pytest.mark.parametrize("era", ERAS)
def test_an_accept_without_json_is_406_with_a_sentence(app_with_mcp: TestClient, era: str) -> None:
    """Both of the SDK's transports say why (its 2026-07-28 one sent no body at all)."""
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    headers = {"accept": "text/html", "content-type": "application/json"}
    if era == _MODERN:
        headers |= {"mcp-protocol-version": _MODERN, "mcp-method": "ping"}
        message["params"] = {
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": _MODERN,
                "io.modelcontextprotocol/clientCapabilities": {},
            }
        }
    response = app_with_mcp.post("/mcp", json=message, headers=headers)
    assert response.status_code == 406
    assert "Not Acceptable: Client must accept application/json" in response.text
