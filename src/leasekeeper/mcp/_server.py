"""The MCP adapter: five lease tools over one ``LeaseService``.

Each tool is one service operation. Its arguments are the HTTP body's fields,
passed to ``service.handle`` as they came (the service validates them exactly as
it validates an HTTP body), and its result is the HTTP body: as structured
content, and as JSON text for clients that read only text. A refusal
(``LeaseError``) is a tool error result (``isError: true``) carrying the error's
body, so an agent can read ``status`` and ``retry_after_seconds``. Errors become
results in one place, ``call_lease_tool``.

Tool calls over ``/mcp`` take from the same rate limits as the HTTP routes
(``leasekeeper serve`` makes one ``Limits`` and hands it to both, which apply it
with ``Limits.enforce``): every call from the client's address when the
per-address limit is on, every call naming a namespace from that namespace's
bucket when the per-namespace limit is on, and every mint from the address's
mint bucket. The address is the HTTP client's, which the SDK passes to a tool
handler as ``ctx.request`` (the Starlette request of the POST). Over stdio the
peer is a local process with no address, and nothing is rate limited.

The server is built on the SDK's low-level ``Server`` rather than ``MCPServer``:
``MCPServer`` derives schemas from Python signatures and validates arguments with
pydantic in lax mode (``"60"`` and ``true`` would pass as integers), while the
contract wants the same strict validation as HTTP. Here the input schemas are
written out with the spec's bounds, and the only validation is the service's.

Transports:

- streamable HTTP (``streamable_http_mount``), mounted at ``/mcp`` beside the
  HTTP API by ``leasekeeper serve``. Stateless and with JSON responses: a tool
  call is one self-contained POST, so any instance behind a load balancer can
  answer it and no session state lives in the process. Tool calls are rate
  limited together with the HTTP routes' requests;
- stdio (``serve_stdio``), for desktop agents: ``leasekeeper mcp``.

Nothing here logs tool arguments or results: they hold namespaces, keys, owner
tokens, fingerprints and results.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import gc
import importlib.metadata
import io
import json
import logging
import os
import re
import sys
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, cast

import anyio
import orjson
from mcp import types
from mcp.server import Server, ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import (
    StreamableHTTPASGIApp,
    StreamableHTTPSessionManager,
)
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leasekeeper._asgi import ClientGone, read_body
from leasekeeper._core.secrets import NAMESPACE_PATTERN, OWNER_TOKEN_PATTERN
from leasekeeper._core.validation import (
    MAX_RESULT_BYTES,
    NOT_AN_OBJECT,
    UTF8_BOM,
    check_tree,
    parse_json_object,
)
from leasekeeper._errors import (
    InternalError,
    InvalidRequest,
    LeaseError,
    PayloadTooLarge,
    RequestTimeout,
)
from leasekeeper._limits import Limits
from leasekeeper._metrics import Metrics
from leasekeeper._schemas import DEFAULT_TTL_SECONDS, MAX_TTL_SECONDS
from leasekeeper._service import LeaseService, clean_up_every
from leasekeeper._settings import Settings
from leasekeeper.http import status_code

__all__ = [
    "INSTRUCTIONS",
    "MCP_PATH",
    "TOOL_OPERATIONS",
    "StreamableHttpMount",
    "StrictStdin",
    "call_lease_tool",
    "create_mcp_server",
    "instructions",
    "lease_tools",
    "quiet_sdk_logs",
    "serve_stdio",
    "streamable_http_mount",
]

log = logging.getLogger("leasekeeper.mcp")

MCP_PATH: Final = "/mcp"

#: Tool name -> ``LeaseService.handle`` operation.
TOOL_OPERATIONS: Final[Mapping[str, str]] = {
    "create_lease_namespace": "namespace",
    "acquire_lease": "acquire",
    "renew_lease": "renew",
    "release_lease": "release",
    "complete_lease": "complete",
}

# -- input schemas ---------------------------------------------------------------------------
# The spec's bounds, as JSON Schema. They tell a model what to send; the service
# still checks every argument (a client need not honour a schema).

_NAMESPACE: Final = {
    "type": "string",
    "pattern": NAMESPACE_PATTERN,
    "description": (
        "The namespace returned by create_lease_namespace (ns_ followed by 43 characters). "
        "A secret: keep it in your own state and never show it to users or write it to "
        "logs. Optional: without a namespace the key itself must be a random value (see key)."
    ),
}
_KEY: Final = {
    "type": "string",
    "minLength": 1,
    "maxLength": 200,
    "description": (
        "Names one job, for example 'invoice:2026-09-05'. With a namespace: 1 to 200 "
        "characters, no control characters. Without a namespace: 32 to 200 printable ASCII "
        "characters, no whitespace, visibly random (at least 100 bits of entropy, such as a "
        "UUID4). Use the same key every time you mean the same job. Treat it as a secret."
    ),
}
_TTL: Final = {
    "type": "integer",
    "minimum": 1,
    "maximum": MAX_TTL_SECONDS,
    "description": (
        f"Seconds until the lease expires unless renewed: an integer from 1 to "
        f"{MAX_TTL_SECONDS}, default {DEFAULT_TTL_SECONDS}. Pick a little more than one step "
        "of your work and renew as you go."
    ),
}
_FINGERPRINT: Final = {
    "type": "string",
    "minLength": 1,
    "maxLength": 1024,
    "description": (
        "Identifies the job's input, for example a hash of the request (1 to 1024 "
        "characters). The first acquire binds the key to this fingerprint, or to having none, "
        "for the key's 24-hour lifecycle; an acquire with a different one gets status "
        "conflict. Send the same fingerprint every time for the same job. Treat it as a secret."
    ),
}
_OWNER_TOKEN: Final = {
    "type": "string",
    "pattern": OWNER_TOKEN_PATTERN,
    "description": (
        "The owner_token that acquire_lease returned to you (own_ followed by 43 "
        "characters). A secret: it proves you own the lease."
    ),
}
_RESULT: Final = {
    "description": (
        f"The job's result: any JSON value, at most {MAX_RESULT_BYTES:,} bytes as compact JSON "
        "(and the whole call under 64 KiB, or it is refused before the tool runs). Fields "
        "whose name contains a secret's word (password, passwd, token, secret, apikey, "
        "privatekey, authorization, cookie; case, '-', '_', '.' and spaces ignored, so "
        'tokens_used and API-Key too) are stored as "[redacted]"; keep secrets and personal '
        "data out of other fields too."
    ),
}


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_ERRORS_ANY_TOOL = (
    'Other errors: "invalid" (an argument breaks a rule; the error names it; fix it, do not '
    'retry unchanged), "rate_limited" (too many requests from your address or for this '
    'namespace; wait retry_after_seconds), "unavailable" (the store is unreachable; retry '
    'after retry_after_seconds), "internal" (retry later).'
)

_TOOLS: Final = (
    types.Tool(
        name="create_lease_namespace",
        title="Create a lease namespace",
        description=(
            "Mint a private namespace: a 256-bit secret (ns_...) that lets you use readable keys "
            "such as 'invoice:2026-09-05' with the other lease tools. Call it once per project "
            "or family of jobs and store the namespace in your own durable state: the service "
            "keeps no copy and cannot list or recover it, and anyone who has it can test your "
            "leases and read their results, so never show it to users or write it to logs. Do "
            "not mint a new namespace per lease: the same key in another namespace is another "
            "job, so duplicates would go unnoticed. Takes no arguments; returns "
            "{ok, namespace, entropy_bits}.\n"
            'Tool error "rate_limited": too many namespaces were minted (or requests sent) '
            "from your address; use the namespace you already have, or wait "
            "retry_after_seconds."
        ),
        input_schema=_schema({}, []),
        annotations=types.ToolAnnotations(
            title="Create a lease namespace",
            # Minting stores nothing: the namespace is its own proof. Every call
            # returns a new one, hence not idempotent.
            read_only_hint=True,
            destructive_hint=False,
            idempotent_hint=False,
            open_world_hint=False,
        ),
    ),
    types.Tool(
        name="acquire_lease",
        title="Acquire a lease",
        description=(
            "Ask for the exclusive right to do one job (named by key), or learn that it is "
            "already done. Call it before starting work that must not run twice, for example "
            "a payment, an email or a deployment. Read `status` in the result:\n"
            '- "held" (ok true): you own the lease for ttl_seconds. Keep owner_token secret; '
            "renew_lease, release_lease and complete_lease need it. Do the work, renew before "
            "lease_expires_at, then call complete_lease. If the systems you write to accept "
            "it, send fencing_token with your writes (a higher token always wins).\n"
            '- "completed" (ok true): the job was done before; `result` is its stored result. '
            "Reuse it and do not do the work again. No owner token is issued.\n"
            'Tool errors (ok false):\n- "held": another worker owns the lease right now. Do '
            "not do the work. Wait retry_after_seconds, then call acquire_lease again (you "
            "may then get the completed result), or do something else meanwhile.\n"
            '- "conflict": this key was already used with a different fingerprint (different '
            "input) within its 24-hour lifecycle. Use a new key for different input; never "
            "reuse a key for other work.\n" + _ERRORS_ANY_TOOL
        ),
        input_schema=_schema(
            {
                "namespace": _NAMESPACE,
                "key": _KEY,
                "ttl_seconds": _TTL,
                "fingerprint": _FINGERPRINT,
            },
            ["key"],
        ),
        annotations=types.ToolAnnotations(
            title="Acquire a lease",
            read_only_hint=False,
            # It creates ownership; it takes nothing away from a live owner.
            destructive_hint=False,
            # A repeat after the lease expires makes a new owner: not idempotent.
            idempotent_hint=False,
            open_world_hint=False,
        ),
    ),
    types.Tool(
        name="renew_lease",
        title="Renew a lease",
        description=(
            "Keep your lease while you are still working: it will now expire ttl_seconds "
            "from now, but never after absolute_expires_at, the end of the key's 24-hour "
            "lifecycle (the returned ttl_seconds is what you actually got). Renew well before "
            "lease_expires_at, for example when half the ttl has passed. fencing_token stays "
            "the same.\n"
            'Tool error "lost": you no longer own the lease (it expired, was released or '
            "completed, or the token is wrong), and someone else may own it now. Stop the work "
            "at once, do not write its output, and call acquire_lease again if the job still "
            "needs doing.\n" + _ERRORS_ANY_TOOL
        ),
        input_schema=_schema(
            {
                "namespace": _NAMESPACE,
                "key": _KEY,
                "owner_token": _OWNER_TOKEN,
                "ttl_seconds": _TTL,
            },
            ["key", "owner_token"],
        ),
        annotations=types.ToolAnnotations(
            title="Renew a lease",
            read_only_hint=False,
            destructive_hint=False,
            # Repeating it leaves the same state: held until about now + ttl.
            idempotent_hint=True,
            open_world_hint=False,
        ),
    ),
    types.Tool(
        name="release_lease",
        title="Release a lease",
        description=(
            "Give your lease up without storing a result, so that another worker (or you, "
            "later) can acquire the key at once. Use it when you stop or fail before the job "
            "is done. The key keeps its fingerprint binding; your owner_token is useless "
            'afterwards. Returns {ok, status: "released", fencing_token}.\n'
            'Tool error "lost": you were not the owner any more; there is nothing to release. '
            "Do not write the job's output.\n" + _ERRORS_ANY_TOOL
        ),
        input_schema=_schema(
            {"namespace": _NAMESPACE, "key": _KEY, "owner_token": _OWNER_TOKEN},
            ["key", "owner_token"],
        ),
        annotations=types.ToolAnnotations(
            title="Release a lease",
            read_only_hint=False,
            # It ends the caller's ownership.
            destructive_hint=True,
            # A repeat is refused as lost and changes nothing.
            idempotent_hint=True,
            open_world_hint=False,
        ),
    ),
    types.Tool(
        name="complete_lease",
        title="Complete a lease",
        description=(
            "Finish the job: store its result and end your ownership for good. Until the "
            "key's lifecycle ends (24 hours after its first acquire), acquire_lease with the "
            'same namespace, key and fingerprint returns status "completed" with this result '
            "instead of a lease, so nobody does the work again. The result is returned as "
            "stored, with secret-named fields redacted.\n"
            'Tool error "lost": you no longer own the lease; someone else may have done the '
            "job or be doing it. If an earlier complete_lease call of yours may have succeeded "
            '(a timeout, say), call acquire_lease: status "completed" means it did.\n'
            'Tool error "too_large": the result is over the limit; shrink it and call again '
            "(your lease is unchanged).\n" + _ERRORS_ANY_TOOL
        ),
        input_schema=_schema(
            {
                "namespace": _NAMESPACE,
                "key": _KEY,
                "owner_token": _OWNER_TOKEN,
                "result": _RESULT,
            },
            ["key", "owner_token", "result"],
        ),
        annotations=types.ToolAnnotations(
            title="Complete a lease",
            read_only_hint=False,
            # It ends ownership for the whole lifecycle and fixes the result.
            destructive_hint=True,
            # A repeat is refused as lost and changes nothing.
            idempotent_hint=True,
            open_world_hint=False,
        ),
    ),
)


INSTRUCTIONS: Final = (
    "leasekeeper makes sure a job is done once: one worker at a time holds a lease on the "
    "job's key, and the finished job's result is kept until 24 hours after the key's first "
    "acquire, so that later callers reuse it instead of doing the work again. Typical flow: "
    "create_lease_namespace once and keep the namespace in your own state; acquire_lease with "
    "a key naming the job and a fingerprint of its input; on a result with ok true, status "
    "held and an owner_token, the lease is yours: do the work, renew_lease before the lease "
    "expires, then complete_lease with the result (or release_lease if you give up); on "
    "status completed, reuse the result. Refusals are tool errors (ok false) whose `status` "
    "says what to do next: a tool error with status held means another worker owns the "
    "lease, so do not do the work. The "
    "namespace, key, fingerprint and owner_token are secrets: never show them to users or "
    "write them to logs."
)


def lease_tools(lifecycle_seconds: int = 86_400) -> list[types.Tool]:
    """The five tool definitions, as ``tools/list`` returns them, their texts quoting
    the lifecycle (``LEASEKEEPER_LIFECYCLE_SECONDS``: 24 hours by default)."""
    if lifecycle_seconds == 86_400:
        return list(_TOOLS)
    return [
        types.Tool.model_validate_json(_with_lifecycle(tool.model_dump_json(), lifecycle_seconds))
        for tool in _TOOLS
    ]


def instructions(lifecycle_seconds: int = 86_400) -> str:
    """``INSTRUCTIONS``, quoting the lifecycle as ``lease_tools`` does."""
    return _with_lifecycle(INSTRUCTIONS, lifecycle_seconds)


def _with_lifecycle(text: str, seconds: int) -> str:
    """``text`` with the default lifecycle's words ("24 hours", "24-hour") made those of
    ``seconds``: the texts are written for the default."""
    for size, unit in ((86_400, "day"), (3_600, "hour"), (60, "minute"), (1, "second")):
        # Hours up to two days (48 hours reads better than 2 days less a bit).
        if seconds % size == 0 and (unit != "day" or seconds >= 2 * 86_400):
            count = seconds // size
            break
    noun = f"{count} {unit}" + ("" if count == 1 else "s")
    return text.replace("24 hours", noun).replace("24-hour", f"{count}-{unit}")


# -- calling a tool --------------------------------------------------------------------------


async def call_lease_tool(
    service: LeaseService,
    name: str,
    arguments: Mapping[str, Any] | None,
    *,
    limits: Limits | None = None,
    scope: Mapping[str, Any] | None = None,
) -> types.CallToolResult:
    """Run tool ``name`` on ``service``; every outcome but an unknown tool is a result.

    This is the one place where MCP maps outcomes: a reply is a result, a
    ``LeaseError`` is an error result with the same body as over HTTP. With
    ``limits``, the call spends what an HTTP request of the same operation and
    body would, at the same points (the address before anything else, the mint
    and namespace limits once the arguments pass the checks HTTP's parser makes),
    for the client address of the ASGI ``scope`` of the HTTP request
    (``"unknown"`` without one); a refusal is the ``rate_limited`` error.
    """
    operation = TOOL_OPERATIONS.get(name)
    if operation is None:
        # Protocol error, as the MCP spec asks for unknown tools; a tool name is no secret.
        raise MCPError(code=types.INVALID_PARAMS, message=f"Unknown tool: {name}")
    data = dict(arguments or {})
    try:
        # In HTTP's order: the address pays for any request; the arguments are checked
        # as HTTP's parser checks a body (depth, lone surrogates: JSON-RPC parsers do
        # not); only then are the mint and namespace limits spent.
        if limits is not None:
            limits.enforce_address(scope or {})
        check_tree(data)
        if limits is not None:
            limits.enforce(scope or {}, operation, data, address=False)
        reply = await service.handle(operation, data)
        return _result(reply.plain(), reply.json_bytes(), is_error=False)
    except LeaseError as error:
        body = error.body()
        return _result(body, orjson.dumps(body), is_error=True)
    except Exception:
        # Like HTTP's unexpected_handler: the traceback goes to the log, never
        # the arguments; the caller gets ``internal`` without details.
        log.exception("unexpected error in MCP tool %s", name)
        body = InternalError().body()
        return _result(body, orjson.dumps(body), is_error=True)


def _result(body: dict[str, Any], text: bytes, *, is_error: bool) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(text=text.decode())],
        structured_content=body,
        is_error=is_error,
    )


def create_mcp_server(service: LeaseService, *, limits: Limits | None = None) -> Server[Any]:
    """An MCP server exposing the five lease tools over ``service``.

    The server does not open or close the service: its owner does (the HTTP
    app's lifespan, or ``serve_stdio``). With ``limits`` (streamable HTTP), tool
    calls take from them per HTTP client address and per namespace, as HTTP
    requests do; without (stdio), nothing is rate limited.
    """

    tools = lease_tools(service.lifecycle_seconds)
    schemas = {tool.name: tool.input_schema for tool in tools}

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        # The SDK's streamable HTTP transports hand over the POST's Starlette request.
        request = ctx.request
        scope = request.scope if isinstance(request, HTTPConnection) else None
        return await call_lease_tool(
            service, params.name, params.arguments, limits=limits, scope=scope
        )

    def input_schema(name: str) -> Mapping[str, Any] | None:
        return schemas.get(name)

    return Server(
        "leasekeeper",
        version=_version(),
        title="leasekeeper",
        description="Leases, fencing tokens and idempotent results for agents and workers.",
        instructions=instructions(service.lifecycle_seconds),
        # Lets the 2026-07-28 HTTP path find a tool's schema without a tools/list round.
        get_tool_input_schema=input_schema,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


def _version() -> str:
    try:
        return importlib.metadata.version("leasekeeper")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source checkout
        return "0"


# -- transports ------------------------------------------------------------------------------

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_SCHEMES = ("http", "https")

LifespanHook = Callable[[], contextlib.AbstractAsyncContextManager[None]]


@dataclass(frozen=True, slots=True)
class StreamableHttpMount:
    """What ``create_app`` needs to serve MCP: routes, and lifespan hooks to run them."""

    routes: list[BaseRoute] = field(default_factory=list)
    lifespan_hooks: list[LifespanHook] = field(default_factory=list)


def streamable_http_mount(
    service: LeaseService,
    settings: Settings | None = None,
    *,
    path: str = MCP_PATH,
    limits: Limits | None = None,
) -> StreamableHttpMount:
    """Streamable HTTP at ``path``, for ``create_app(extra_routes=..., lifespan_hooks=...)``.

    Stateless, JSON responses (no SSE streams, no session ids), POST only (GET
    and DELETE are 405 ``method_not_allowed`` like any other route). Request bodies
    are capped at ``settings.max_body_bytes`` like the API's. When the server
    listens on a loopback address, Host and Origin are checked against loopback
    names, as the SDK does by default, against DNS rebinding from a browser.
    Tool calls take from ``limits``: pass the ones the HTTP app has
    (``create_app(limits=...)``) so that the two share one budget per address and
    per namespace; by default the mount makes its own from ``settings``.
    """
    settings = settings or Settings()
    if limits is None:
        limits = Limits.from_settings(settings)
    security = None
    if settings.host in _LOOPBACK:
        # The SDK logs each refused Host or Origin header whole (``_ValuesOut``).
        logging.getLogger("mcp.server.transport_security").addFilter(_VALUES_OUT)
        names = ["127.0.0.1", "localhost", "[::1]"]  # as in a Host header
        hosts = names + [f"{name}:*" for name in names]
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=hosts,
            allowed_origins=[f"{scheme}://{host}" for scheme in _SCHEMES for host in hosts],
        )
    manager = StreamableHTTPSessionManager(
        app=create_mcp_server(service, limits=limits),
        json_response=True,
        stateless=True,
        security_settings=security,
        max_request_body_size=settings.max_body_bytes,
    )
    # POST only. A stateless server never sends anything unprompted, so a GET
    # stream would only hold a connection open; the transport spec lets a server
    # answer GET (and DELETE, with no session to end) with 405.
    app = _Gate(
        StreamableHTTPASGIApp(manager), settings.max_body_bytes, settings.request_timeout_seconds
    )
    return StreamableHttpMount(
        routes=[Route(path, app, methods=["POST"], name="mcp")],  # "mcp" in metrics
        lifespan_hooks=[manager.run],
    )


class _Gate:
    """What ``/mcp`` puts in front of the SDK's app: the body read as the API reads one
    (``http._app.read_body``), then handed to the SDK whole.

    - The whole body must arrive within ``body_timeout`` seconds, or the answer is
      the API's 408 and the connection is closed: the SDK waits for a body as long
      as the client likes, so a few clients promising bodies they do not send would
      hold every connection slot.
    - A body over ``max_body`` bytes, or a ``Content-Length`` announcing one, gets
      the API's 413 (the connection is closed: the rest is not read). Both are
      JSON-RPC errors (-32600) whose data is the API's ``timeout`` or ``too_large``
      body: an MCP client reads no other body at an error status.
    - The body is read by the API's rules (``read_message``, as each line over stdio)
      before the SDK reads it, and one refused gets its JSON-RPC error with HTTP 400,
      as the SDK answers malformed JSON. A byte-order mark is ignored, as before an
      API body (the SDK's older transport refused it).
    - The SDK's answer to a message that is not valid JSON-RPC quotes pydantic's
      error, which quotes the input (namespaces, owner tokens): that message is
      replaced by one that names no value.
    """

    def __init__(self, app: ASGIApp, max_body: int, body_timeout: float) -> None:
        self.app = app
        self.max_body = max_body
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_body(
                scope, receive, self.max_body, self.body_timeout, lambda: _count_slow_body(scope)
            )
        except ClientGone:
            return
        except (PayloadTooLarge, RequestTimeout) as error:
            await self._closing(error)(scope, receive, send)  # the rest is not read
            return
        body = body.removeprefix(UTF8_BOM)  # ignored, as before a body of the API's
        read = read_message(body)
        if isinstance(read, Refusal):
            await _refused(read)(scope, receive, send)
            return
        whole: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed() -> Message:
            return whole.pop() if whole else await receive()

        await self.app(scope, replayed, _sdk_errors_as_json(send))

    def _closing(self, error: PayloadTooLarge | RequestTimeout) -> Response:
        """The API's status for a body too large or too slow, as a JSON-RPC error (an MCP
        client reads no other body at an error status), whose data is the API's body; the
        id is unread (null); the connection is closed."""
        if isinstance(error, PayloadTooLarge):
            message = f"Invalid request: the message is larger than {self.max_body} bytes"
        else:
            message = f"Invalid request: {error.error}"
        refused = {"code": types.INVALID_REQUEST, "message": message, "data": error.body()}
        body = orjson.dumps({"jsonrpc": "2.0", "id": None, "error": refused})
        response = Response(body, status_code=status_code(error), media_type="application/json")
        response.headers["connection"] = "close"
        return response


def _count_slow_body(scope: Scope) -> None:
    """Count a body cut off at its deadline in ``leasekeeper_slow_clients_total{stage="body"}``,
    as the API routes do: the metrics are the application's (``create_app`` keeps them in
    ``app.state``, and Starlette puts itself in the scope); a mount outside one counts nothing."""
    metrics = getattr(getattr(scope.get("app"), "state", None), "metrics", None)
    if isinstance(metrics, Metrics):
        metrics.slow_clients.labels("body").inc()


def _refused(refusal: Refusal) -> Response:
    """The JSON-RPC error for a body ``read_message`` refused: HTTP 400, as the SDK's own."""
    error = {"code": refusal.code, "message": refusal.message}
    body = orjson.dumps({"jsonrpc": "2.0", "id": refusal.id, "error": error})
    return Response(body, status_code=400, media_type="application/json")


_NOT_JSON_RPC = "Validation error: the message is not a valid JSON-RPC request"


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why ``read_message`` refused a message, and the ``id`` to answer it with."""

    id: int | str | None
    code: int
    message: str


def read_message(text: bytes) -> dict[str, Any] | Refusal:
    """One JSON-RPC message, a ``/mcp`` body or a line of stdin (a byte-order mark
    already stripped), read by the API's rules, or why it is refused.

    Not strict JSON (UTF-8, no repeated name, no NaN, no lone surrogate, nesting at
    most 64 levels): the parse error (-32700), with the ``id`` a lenient reading finds.
    The SDK's parsers would keep the last of a repeated name, while a gateway in front
    may read the first. JSON but not one JSON-RPC message (an array, a batch, a
    message of no known shape, an ``id`` that is neither an integer nor a string,
    which the SDK took for a notification and answered nothing): the invalid-request
    error (-32600), with the message's ``id`` where it is one. The sentences quote
    no input (pydantic's would: namespaces, owner tokens).
    """
    try:
        message = parse_json_object(text)
    except InvalidRequest as error:
        if error.error == NOT_AN_OBJECT:  # JSON, but no JSON-RPC message
            return Refusal(None, types.INVALID_REQUEST, _NOT_JSON_RPC)
        return Refusal(_lenient_id(text), types.PARSE_ERROR, f"Parse error: {error.error}")
    try:
        types.jsonrpc_message_adapter.validate_python(message, by_name=False)
        if "id" in message and _id_of(message) is None:
            raise ValueError("an id must be an integer or a string")
    except ValueError:  # pydantic's ValidationError; its text quotes the input
        return Refusal(_id_of(message), types.INVALID_REQUEST, _NOT_JSON_RPC)
    return message


def _sdk_errors_as_json(send: Send) -> Send:
    """``send``, with the SDK's error answers made safe and JSON: a "Validation
    error: ..." (which quotes the message) says ``_NOT_JSON_RPC`` instead, and a
    plain-text one (a foreign Host or Origin, a missing Content-Type) becomes the
    API's ``invalid`` body with the same status and sentence. Each is one piece."""
    held: Message | None = None

    async def sending(message: Message) -> None:
        nonlocal held
        if message["type"] == "http.response.start" and message["status"] >= 400:
            held = message  # until its body shows what it says
            return
        if held is not None and message["type"] == "http.response.body":
            start, held = held, None
            body = _safe_error_body(message.get("body", b""), start["status"])
            if body is not None:
                headers = [
                    (name, value)
                    for name, value in start["headers"]
                    if name not in (b"content-length", b"content-type")
                ]
                headers.append((b"content-type", b"application/json"))
                headers.append((b"content-length", str(len(body)).encode("ascii")))
                start = {**start, "headers": headers}
                message = {**message, "body": body}
            await send(start)
        await send(message)

    return sending


#: What an SDK refusal without a body says (its 2026-07-28 transport answers 406 so).
_EMPTY_REFUSALS: Final = {406: "Not Acceptable: Client must accept application/json"}


def _safe_error_body(body: bytes, status: int) -> bytes | None:
    """What an SDK error body becomes (None: it stays as it is)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:  # the SDK's plain text: fixed sentences, no input
        sentence = body.decode("utf-8", "replace").strip()[:200] or _EMPTY_REFUSALS.get(
            status, "The request was refused"
        )
        return orjson.dumps({"ok": False, "status": "invalid", "error": sentence})
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict) and str(error.get("message")).startswith("Validation error"):
        return orjson.dumps({**parsed, "error": {**error, "message": _NOT_JSON_RPC}})
    return None


async def serve_stdio(
    service: LeaseService,
    *,
    cleanup_interval_seconds: float | None,
    max_message_bytes: int = Settings().max_body_bytes,
) -> None:
    """Serve MCP over this process's stdin and stdout until stdin closes.

    Opens and closes ``service``. With ``cleanup_interval_seconds`` the store's
    finished lifecycles are deleted that often, as ``leasekeeper serve`` does.
    Each line of stdin is checked as ``/mcp`` checks a body (``StrictStdin``), and
    one longer than ``max_message_bytes`` is refused as a body that size would be.
    """
    server = create_mcp_server(service)
    stdin = StrictStdin(sys.stdin.fileno(), max_message_bytes)
    peer_gone = False
    await service.start()
    try:
        async with anyio.create_task_group() as tasks:
            if cleanup_interval_seconds is not None:
                tasks.start_soon(
                    functools.partial(
                        clean_up_every, service, cleanup_interval_seconds, sleep=anyio.sleep
                    )
                )
            # stdin is duck-typed: the SDK only iterates it, line by line, as text.
            lines = cast("anyio.AsyncFile[str]", stdin)
            async with stdio_server(stdin=lines) as (read_stream, write_stream):
                answers = stdin.answer_through(write_stream)
                await server.run(read_stream, answers, server.create_initialization_options())
            tasks.cancel_scope.cancel()
    except* BrokenPipeError:  # the peer closed our stdout: nobody reads the answers
        log.warning("stdout is closed (the MCP client went away); stopping")
        peer_gone = True
    except* (anyio.BrokenResourceError, anyio.ClosedResourceError):
        # Stopped (Ctrl-C) while answers were on their way: the SDK's streams were closed
        # under them. That is the stop asked for, not a failure; anything else is one.
        if not _stopping():
            raise
    finally:
        await service.stop()
    if peer_gone:
        _drop_unsendable_answers()


def _drop_unsendable_answers() -> None:
    """Collect now the SDK's stdout writer, whose peer has gone, without a second report.

    The writer (a buffered file on a duplicate of fd 1) still holds the answer whose
    flush met the closed pipe, and is garbage in a reference cycle (the BrokenPipeError's
    traceback). Its finalizer flushes again and fails again; Python 3.13 reports that
    through ``sys.unraisablehook`` (3.11 and 3.12 only in development mode), which
    prints "Exception ignored in: <_io.BufferedWriter ...>" and the error to stderr:
    lines that are not the log's JSON, about what the WARNING has said. That one error
    is dropped here; any other is reported as before.
    """
    report = sys.unraisablehook

    def dropping(unraisable: sys.UnraisableHookArgs) -> None:
        if not (
            issubclass(unraisable.exc_type, BrokenPipeError)
            and isinstance(unraisable.object, io.BufferedWriter)
        ):
            report(unraisable)

    sys.unraisablehook = dropping
    try:
        gc.collect()
    finally:
        sys.unraisablehook = report


def _stopping() -> bool:
    """Whether the current task is being cancelled (``asyncio.run`` on Ctrl-C)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class StrictStdin:
    """What the SDK's stdio transport reads instead of stdin: lines read as ``/mcp``
    reads a body (``read_message``), and the ones refused answered here, never
    handed on.

    The SDK reads stdin with ``errors="replace"`` (two different malformed byte
    sequences became one key), keeps the last of a repeated name (``"key":"a",
    "key":"b"`` took a lease on ``b``) and answers nothing to a line it cannot
    parse or validate, so its peer waited for ever. Here each refusal is answered
    with the message's ``id`` where one can be read, so the peer's call fails at
    once, and ``null`` otherwise, as JSON-RPC says. A line longer than ``max_bytes``
    is the invalid-request error (-32600). Blank lines are skipped, and a byte-order
    mark is ignored, as before an HTTP body.
    """

    def __init__(self, fd: int, max_bytes: int) -> None:
        self._reader = _FdLines(fd, max_bytes)
        self._max_bytes = max_bytes
        self._answers: Any = None
        self._ready = anyio.Event()
        # Requests handed on, not yet answered, by id (a client may reuse an id).
        self._unanswered: collections.Counter[int | str] = collections.Counter()
        self._answered = anyio.Event()

    def answer_through(self, write_stream: Any) -> _Watched:
        """Send refusals where the server sends its messages (the SDK's write stream),
        and the stream for the server to send through, which tells each answer here."""
        self._answers = write_stream.clone()
        self._ready.set()
        return _Watched(write_stream, self._settled)

    def _settled(self, request_id: object) -> None:
        """One request ``request_id`` (any value a client sent) is answered or cancelled."""
        if (
            isinstance(request_id, int | str)
            and not isinstance(request_id, bool)  # True would settle id 1
            and self._unanswered[request_id] > 0
        ):
            self._unanswered[request_id] -= 1
            if not self._unanswered[request_id]:
                del self._unanswered[request_id]
            self._answered.set()

    async def _drain(self) -> None:
        """Wait, up to ``_DRAIN_SECONDS``, until every request handed on is answered:
        when stdin ends, the SDK cancels the calls still running, and a call the store
        has already decided (a lease granted) would be answered "Connection closed"."""
        with anyio.move_on_after(_DRAIN_SECONDS):
            while self._unanswered:
                await self._answered.wait()
                self._answered = anyio.Event()

    def __aiter__(self) -> AsyncIterator[str]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[str]:
        # Lines come from a daemon thread of their own: one blocked reading stdin must
        # not keep the process from exiting (on Ctrl-C, say), as a worker thread of
        # anyio's, which the interpreter waits for at exit, did.
        lines: asyncio.Queue[bytes | _TooLong] = asyncio.Queue(maxsize=8)
        loop = asyncio.get_running_loop()

        def deliver(line: bytes | _TooLong) -> bool:
            """Hand ``line`` to the loop, waiting while the queue is full; False once
            the loop is closed or closing (nobody reads any more)."""
            put = lines.put(line)
            try:
                asyncio.run_coroutine_threadsafe(put, loop).result()
            except RuntimeError:  # closed: the coroutine never ran
                put.close()
                return False
            except concurrent.futures.CancelledError:
                return False
            return True

        def pump() -> None:
            line: bytes | _TooLong = _TooLong(b"")
            try:
                while line != b"":
                    try:
                        line = self._reader.readline()
                    except OSError:
                        line = b""
                    if not deliver(line):
                        return
            except Exception:  # never leave the reader waiting for a line that won't come
                log.exception("reading stdin failed")
                deliver(b"")

        threading.Thread(target=pump, name="leasekeeper-mcp-stdin", daemon=True).start()
        try:
            while True:
                line = await lines.get()
                if line == b"":
                    await self._drain()
                    return
                if isinstance(line, _TooLong):
                    too_big = f"Invalid request: the message is larger than {self._max_bytes} bytes"
                    await self._refuse(_id_from_start(line.start), types.INVALID_REQUEST, too_big)
                    continue
                line = line.removeprefix(UTF8_BOM)  # ignored, as before a body; the SDK would not
                if not line.strip():
                    continue
                read = read_message(line)
                if isinstance(read, Refusal):
                    await self._refuse(read.id, read.code, read.message)
                    continue
                self._note(read)
                yield line.decode("utf-8")
        finally:
            if self._answers is not None:
                self._answers.close()

    def _note(self, message: Mapping[str, Any]) -> None:
        """Count a request handed on as unanswered; a cancelled one is never answered."""
        request_id = _id_of(message)
        if "method" in message and request_id is not None:
            self._unanswered[request_id] += 1
        if message.get("method") == "notifications/cancelled":
            params = message.get("params")
            if isinstance(params, dict):
                self._settled(params.get("requestId"))

    async def _refuse(self, request_id: int | str | None, code: int, message: str) -> None:
        await self._ready.wait()
        error = types.ErrorData(code=code, message=message)
        reply = types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error)
        await self._answers.send(SessionMessage(reply))


#: The longest ``leasekeeper mcp`` waits, at the end of stdin, for answers still due.
_DRAIN_SECONDS: Final = 30.0


class _Watched:
    """The SDK's write stream for the server's messages, telling ``settled`` the id of
    each answer (a result or an error) once it is sent."""

    def __init__(self, stream: Any, settled: Callable[[object], None]) -> None:
        self._stream = stream
        self._settled = settled

    async def send(self, item: SessionMessage, /) -> None:
        await self._stream.send(item)
        if isinstance(item.message, types.JSONRPCResponse | types.JSONRPCError):
            self._settled(item.message.id)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def __aenter__(self) -> _Watched:
        await self._stream.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return cast("bool | None", await self._stream.__aexit__(*exc_info))


#: How much of a line too long to read whole is kept, to find its ``id`` in.
_KEPT_START: Final = 4096


@dataclass(frozen=True, slots=True)
class _TooLong:
    """A line longer than the limit: only its first ``_KEPT_START`` bytes."""

    start: bytes


class _FdLines:
    """Lines from a file descriptor, read with ``os.read``: no buffered file object,
    whose lock a daemon thread blocked in a read would hold when the interpreter
    closes it at exit (a fatal error)."""

    def __init__(self, fd: int, max_bytes: int) -> None:
        self._fd = fd
        self._max_bytes = max_bytes
        self._buffer = bytearray()

    def readline(self) -> bytes | _TooLong:
        """The next line (``b""`` at the end), or ``_TooLong`` for a line longer than
        ``max_bytes`` without its newline, which is read to its end and dropped but for
        its start."""
        too_long: _TooLong | None = None
        searched = 0  # the buffer before this holds no newline: each byte is looked at once
        while True:
            end = self._buffer.find(b"\n", searched)
            if end >= 0:
                line = bytes(self._buffer[: end + 1])
                del self._buffer[: end + 1]
                if too_long is None and len(line) > self._max_bytes + 1:
                    too_long = _TooLong(line[:_KEPT_START])
                return line if too_long is None else too_long
            searched = len(self._buffer)
            if len(self._buffer) > self._max_bytes:
                if too_long is None:
                    too_long = _TooLong(bytes(self._buffer[:_KEPT_START]))
                self._buffer.clear()
                searched = 0
            chunk = os.read(self._fd, 65_536)
            if not chunk:  # the end: what is left is the last line, without its newline
                line = bytes(self._buffer)
                self._buffer.clear()
                return line if too_long is None else too_long
            self._buffer += chunk


def _id_of(message: Mapping[str, Any]) -> int | str | None:
    """A message's ``id`` when it is one JSON-RPC allows (an integer or a string)."""
    value = message.get("id")
    return value if type(value) is int or type(value) is str else None


def _lenient_id(line: bytes) -> int | str | None:
    """The ``id`` of a line refused as not strict JSON, where Python's lenient reading
    of it finds exactly one at its top level (else None)."""
    objects: list[list[tuple[str, Any]]] = []

    def keep(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        objects.append(pairs)
        return dict(pairs)

    try:
        top = json.loads(line.decode("utf-8", "replace"), object_pairs_hook=keep)
    except (ValueError, RecursionError):
        return None
    if not isinstance(top, dict):
        return None
    ids = [value for name, value in objects[-1] if name == "id"]  # the top level's, made last
    if len(ids) != 1 or (type(ids[0]) is str and "\ufffd" in ids[0]):
        return None
    return _id_of({"id": ids[0]})


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def _id_from_start(start: bytes) -> int | str | None:
    """The ``id`` of a message known only by its start (a line too long to read whole),
    where the members of its top-level object before the ``id`` are whole in ``start``
    and the ``id``'s value is followed by a ``,`` or ``}`` there (else None). Clients
    write the ``id`` near the front (``{"jsonrpc":"2.0","id":7,"method":...``)."""
    text = start.removeprefix(UTF8_BOM).decode("utf-8", "replace")
    decoder = json.JSONDecoder()

    def after_space(at: int) -> int:
        found = _JSON_SPACE.match(text, at)
        return found.end() if found else at

    at = after_space(0)
    if text[at : at + 1] != "{":
        return None
    try:
        while True:
            name, at = decoder.raw_decode(text, after_space(at + 1))
            at = after_space(at)
            if not isinstance(name, str) or text[at : at + 1] != ":":
                return None
            value, at = decoder.raw_decode(text, after_space(at + 1))
            at = after_space(at)
            if text[at : at + 1] not in (",", "}"):  # cut off, or not JSON
                return None
            if name == "id":
                if type(value) is str and "\ufffd" in value:
                    return None
                return _id_of({"id": value})
            if text[at] == "}":
                return None
    except ValueError:  # a member cut off, or not JSON
        return None


class _ValuesOut(logging.Filter):
    """Cuts a log line at its first colon: the SDK's DNS-rebinding check logs each
    refused ``Host`` or ``Origin`` header whole, at WARNING ("Invalid Host header:
    …"), a client's text of any size (64 KiB a line, as often as a client likes)
    that leasekeeper's logs never hold. What is left says what was refused."""

    def filter(self, record: logging.LogRecord) -> bool:
        head, colon, _ = record.getMessage().partition(":")
        if colon:
            record.msg, record.args = f"{head} (the value is not logged)", ()
        return True


_VALUES_OUT = _ValuesOut()


def quiet_sdk_logs() -> None:
    """Keep the MCP SDK's own loggers at WARNING or above. (Its refused Host and Origin
    header values are kept out of its WARNING lines by ``_ValuesOut``, which the ``/mcp``
    mount installs when it turns those checks on.)

    At DEBUG the SDK logs stray frames and parse errors with their content,
    which may hold tool arguments (namespaces, keys, owner tokens) that
    leasekeeper's logs must never contain; its INFO lines are transport chatter.
    A root level above WARNING still applies.
    """
    sdk = logging.getLogger("mcp")
    sdk.setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))
